"""Prompt data: per-domain Grain sources, the curriculum that mixes them, padded batches."""

from rlpt.data.curriculum import (
    LOSS_WEIGHTINGS,
    SIGNALS,
    STRATEGIES,
    Curriculum,
    CurriculumConfig,
    DifficultyConfig,
    Feedback,
    check_distribution,
    make_curriculum,
)
from rlpt.data.loader import CurriculumLoader, PromptBatch
from rlpt.data.sources import (
    SOURCE_KINDS,
    ArrayRecordSource,
    DataError,
    DomainSource,
    JsonlSource,
    Prepare,
    ProceduralSource,
    TFDSSource,
    make_source,
    materialize_domain,
    record_to_task,
)

__all__ = [
    "LOSS_WEIGHTINGS",
    "SIGNALS",
    "SOURCE_KINDS",
    "STRATEGIES",
    "ArrayRecordSource",
    "Curriculum",
    "CurriculumConfig",
    "CurriculumLoader",
    "DataError",
    "DifficultyConfig",
    "DomainSource",
    "Feedback",
    "JsonlSource",
    "Prepare",
    "ProceduralSource",
    "PromptBatch",
    "TFDSSource",
    "check_distribution",
    "make_curriculum",
    "make_source",
    "materialize_domain",
    "record_to_task",
]
