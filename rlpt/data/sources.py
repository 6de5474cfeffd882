"""Per-domain data sources: procedural domains, TFDS ArrayRecord datasets, ArrayRecord, JSONL.

Every source exposes ``dataset(level) -> grain.MapDataset`` of raw records plus
``max_difficulty`` and ``size`` (how many distinct items it can supply;
``inf`` for procedural domains, which the curriculum's size prior reads).
Raw records become ``Task`` objects inside the pipeline (``Prepare``), so they
are decoded and tokenised in Grain worker processes when those are on.

A record is a mapping (or JSON text of one) with a required ``prompt`` and
optional ``id``, ``answer``, ``difficulty``, ``data`` (a mapping, or JSON text
of one), ``domain``. A record without ``prompt`` is a schema error and raises,
naming the domain and field; a record that cannot be decoded at all is
corrupt, and the loader skips and counts it.

The item of a procedural source at index ``i`` and level ``d`` is
``domain.generate(split, stable_hash(seed, i), d)``: the level is an argument,
not hidden state, so the loader resumes exactly by rebuilding a source at the
restored level and position.
"""

from __future__ import annotations

import abc
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import grain
import numpy as np

from rlpt.tasks import Domain, Task, get_domain, stable_hash

# Procedural domains are unbounded; this is the index range a MapDataset over one needs.
PROCEDURAL_LENGTH = 1 << 40
REQUIRED_FIELDS = ("prompt",)


class DataError(ValueError):
    """A data problem that names the domain (and field) it concerns."""


class DomainSource(abc.ABC):
    """Where one domain's prompts come from."""

    name: str
    max_difficulty: int = 1
    size: float = math.inf

    @abc.abstractmethod
    def dataset(self, level: int) -> grain.MapDataset:
        """Raw records of difficulty ``level`` (1-based), in a fixed order."""

    @property
    def procedural(self) -> bool:
        return False

    def check_level(self, level: int) -> None:
        if not 1 <= level <= self.max_difficulty:
            raise DataError(f"domain {self.name!r}: level {level} not in 1..{self.max_difficulty}")


class _ProceduralRecords:
    """Index ``i`` -> the task a domain generates for ``stable_hash(seed, i)``."""

    def __init__(self, domain: Domain, split: str, seed: int, level: int):
        self._domain = domain
        self._split = split
        self._seed = seed
        self._level = level

    def __len__(self) -> int:
        return PROCEDURAL_LENGTH

    def __getitem__(self, index: int) -> Task:
        seed = stable_hash("rlpt-data", self._seed, int(index)) % (1 << 62)
        return self._domain.generate(self._split, seed, self._level)


class ProceduralSource(DomainSource):
    """A procedural ``Domain`` as an unbounded source."""

    def __init__(
        self, domain: Domain | str, *, name: str | None = None, split: str = "train", seed: int = 0
    ):
        try:
            self.domain = get_domain(domain)
        except ValueError as e:
            raise DataError(f"domain {name or domain!r}: {e}") from e
        self.name = name or self.domain.name
        self.split = split
        self.seed = seed
        self.max_difficulty = self.domain.max_difficulty
        self.size = math.inf

    @property
    def procedural(self) -> bool:
        return True

    def dataset(self, level: int) -> grain.MapDataset:
        self.check_level(level)
        return grain.MapDataset.source(
            _ProceduralRecords(self.domain, self.split, self.seed, level)
        )


class JsonlSource(DomainSource):
    """One JSON object per line; blank lines are ignored, undecodable ones counted as corrupt.

    Only byte offsets are held in memory; a line is read when its index is asked for.
    """

    def __init__(self, path: str, *, name: str):
        self.name = name
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise DataError(f"domain {name!r}: JSONL file {self.path!r} does not exist")
        offsets = []
        with open(self.path, "rb") as f:
            pos = 0
            for line in f:
                if line.strip():
                    offsets.append(pos)
                pos += len(line)
        if not offsets:
            raise DataError(f"domain {name!r}: JSONL file {self.path!r} has no records")
        self.size = float(len(offsets))
        self._offsets = offsets

    def dataset(self, level: int) -> grain.MapDataset:
        self.check_level(level)
        return grain.MapDataset.source(_JsonlLines(self.path, self._offsets))


class _JsonlLines:
    def __init__(self, path: str, offsets: list[int]):
        self._path = path
        self._offsets = offsets
        self._file = None

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, index: int) -> bytes:
        if self._file is None:
            self._file = open(self._path, "rb")  # noqa: SIM115 - held open across reads
        self._file.seek(self._offsets[index])
        return self._file.readline()

    def __getstate__(self):
        # An open file cannot cross into a worker process; each process opens its own.
        return {**self.__dict__, "_file": None}


class ArrayRecordSource(DomainSource):
    """Plain ArrayRecord files whose records are JSON objects (UTF-8 bytes)."""

    def __init__(self, paths: str | Sequence[str], *, name: str):
        self.name = name
        self.paths = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
        missing = [p for p in self.paths if not os.path.exists(p)]
        if missing:
            raise DataError(f"domain {name!r}: ArrayRecord file(s) {missing} do not exist")
        self._source = grain.sources.ArrayRecordDataSource([os.fspath(p) for p in self.paths])
        self.size = float(len(self._source))

    def dataset(self, level: int) -> grain.MapDataset:
        self.check_level(level)
        return grain.MapDataset.source(self._source)


class TFDSSource(DomainSource):
    """A prepared TFDS dataset in ArrayRecord format, read with ``tfds`` data sources.

    If the dataset has splits ``{split}_d1 .. {split}_dL`` (as ``materialize_domain``
    writes them), level ``d`` reads ``{split}_d{d}``; otherwise it has one level.
    ``path`` is either the versioned dataset directory or, with ``data_dir``,
    the dataset name.
    """

    def __init__(self, path: str, *, name: str, data_dir: str | None = None, split: str = "train"):
        import tensorflow_datasets as tfds

        self.name = name
        directory = _tfds_directory(path, data_dir)
        if directory is None:
            where = f"{path!r} in data_dir {data_dir!r}" if data_dir else repr(path)
            raise DataError(f"domain {name!r}: no prepared TFDS dataset at {where}")
        builder = tfds.builder_from_directory(directory)
        splits = set(builder.info.splits.keys())
        levels = 0
        while f"{split}_d{levels + 1}" in splits:
            levels += 1
        if levels:
            self._splits = [f"{split}_d{i}" for i in range(1, levels + 1)]
        elif split in splits:
            self._splits = [split]
        else:
            raise DataError(
                f"domain {name!r}: TFDS dataset {directory} has no split {split!r} "
                f"(splits: {sorted(splits)})"
            )
        self._builder = builder
        self.max_difficulty = len(self._splits)
        self._sources = [builder.as_data_source(split=s) for s in self._splits]
        self.size = float(sum(len(s) for s in self._sources))

    def dataset(self, level: int) -> grain.MapDataset:
        self.check_level(level)
        return grain.MapDataset.source(self._sources[level - 1])


def _tfds_directory(path: str, data_dir: str | None) -> str | None:
    """The versioned directory holding ``dataset_info.json``, or None."""
    root = os.path.join(data_dir, path) if data_dir else path
    if os.path.isfile(os.path.join(root, "dataset_info.json")):
        return root
    if os.path.isdir(root):
        versions = sorted(
            d
            for d in os.listdir(root)
            if os.path.isfile(os.path.join(root, d, "dataset_info.json"))
        )
        if versions:
            return os.path.join(root, versions[-1])
    return None


# -- turning records into tokenised tasks (runs in Grain workers) ------------------------------


class Prepare:
    """Raw record -> ``{"task", "ids"}``, or ``{"error", "kind"}`` for a bad record.

    Errors travel as values, not exceptions, so the main process decides: a
    corrupt record is skipped and counted, a schema error raises. A top-level
    class (not a closure) so that spawned worker processes can unpickle it.
    """

    def __init__(self, domain_name: str, level: int, tokenizer: Any, add_bos: bool):
        self.domain_name = domain_name
        self.level = level
        self.tokenizer = tokenizer
        self.add_bos = add_bos

    def __call__(self, record: Any) -> dict[str, Any]:
        try:
            task = record_to_task(record, self.domain_name, self.level)
        except DataError as e:
            return {"error": str(e), "kind": "schema"}
        except (ValueError, TypeError, UnicodeDecodeError) as e:
            return {"error": f"domain {self.domain_name!r}: corrupt record: {e}", "kind": "corrupt"}
        ids = np.asarray(self.tokenizer.encode(task.prompt, add_bos=self.add_bos), np.int32)
        return {"task": task, "ids": ids}


def _text(value: Any) -> str:
    if isinstance(value, bytes | np.bytes_):
        return bytes(value).decode("utf-8")
    if isinstance(value, np.ndarray) and value.shape == ():
        return _text(value.item())
    return str(value)


def record_to_task(record: Any, domain_name: str, level: int) -> Task:
    """A ``Task`` from a raw record; ``DataError`` names a missing required field."""
    if isinstance(record, Task):
        return record
    if isinstance(record, bytes | str):
        record = json.loads(record)
    if not isinstance(record, Mapping):
        raise TypeError(f"record is a {type(record).__name__}, not a mapping")
    for field in REQUIRED_FIELDS:
        if field not in record:
            raise DataError(
                f"domain {domain_name!r}: record is missing required field {field!r} "
                f"(has {sorted(record)})"
            )
    prompt = _text(record["prompt"])
    data = record.get("data", {})
    if isinstance(data, bytes | str | np.bytes_):
        text = _text(data)
        data = json.loads(text) if text else {}
    if not isinstance(data, Mapping):
        raise TypeError(f"field 'data' is a {type(data).__name__}, not a mapping")
    data = dict(data)
    answer = record.get("answer")
    answer = None if answer is None else _text(answer)
    # TFDS text features cannot hold None; materialize_domain marks it in data.
    if data.pop("answer_is_none", False):
        answer = None
    difficulty = int(record.get("difficulty", level))
    task_domain = _text(record["domain"]) if "domain" in record else domain_name
    task_id = _text(record["id"]) if "id" in record else f"{domain_name}/{stable_hash(prompt)}"
    return Task(
        id=task_id,
        domain=task_domain,
        prompt=prompt,
        difficulty=difficulty,
        answer=answer,
        data=data,
        split=_text(record.get("split", "")),
    )


# -- materialising a domain as a TFDS ArrayRecord dataset --------------------------------------


def materialize_domain(
    domain: Domain | str,
    data_dir: str,
    *,
    n: int,
    name: str | None = None,
    levels: Sequence[int] | None = None,
    split: str = "train",
    seed: int = 0,
) -> str:
    """Write ``n`` tasks per level of ``domain`` as a TFDS dataset in ArrayRecord format.

    Level ``d`` goes to split ``{split}_d{d}`` and holds the same items a
    ``ProceduralSource(domain, split=split, seed=seed)`` yields at indices
    ``0..n-1``. Returns the versioned dataset directory, which ``TFDSSource``
    (or ``tfds.builder_from_directory(...).as_data_source``) reads back with no
    TensorFlow installed.
    """
    import tensorflow_datasets as tfds

    dom = get_domain(domain)
    ds_name = name or f"rlpt_{dom.name}"
    levels = list(levels) if levels is not None else list(range(1, dom.max_difficulty + 1))
    for level in levels:
        dom.check_difficulty(level)

    def items(level: int):
        source = _ProceduralRecords(dom, split, seed, level)
        for i in range(n):
            task = source[i]
            data = dict(task.data)
            if task.answer is None:
                data["answer_is_none"] = True
            yield (
                task.id,
                {
                    "id": task.id,
                    "domain": task.domain,
                    "prompt": task.prompt,
                    "answer": task.answer or "",
                    "difficulty": task.difficulty,
                    "data": json.dumps(data, sort_keys=True),
                    "split": task.split,
                },
            )

    text = tfds.features.Text()
    features = tfds.features.FeaturesDict(
        {
            "id": text,
            "domain": text,
            "prompt": text,
            "answer": text,
            "difficulty": np.int32,
            "data": text,
            "split": text,
        }
    )

    class _Builder(tfds.core.GeneratorBasedBuilder):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            return tfds.core.DatasetInfo(builder=self, features=features)

        def _split_generators(self, dl_manager):
            del dl_manager  # nothing to download: items are generated
            return {f"{split}_d{level}": self._generate_examples(level) for level in levels}

        def _generate_examples(self, level):
            yield from items(level)

    # A dynamically made builder must not enter TFDS's global registry, where a
    # second call with the same name would clash; it is read back by directory.
    with tfds.core.registered.skip_registration():
        builder_cls = type(ds_name, (_Builder,), {"name": ds_name})
    builder = builder_cls(data_dir=data_dir, file_format="array_record")
    builder.download_and_prepare()
    return os.fspath(builder.data_dir)


# -- sources from config -----------------------------------------------------------------------

SOURCE_KINDS = ("procedural", "tfds", "array_record", "jsonl")


def make_source(name: str, spec: Any = None) -> DomainSource:
    """A source from a config entry.

    ``spec`` is None (the registered domain ``name``), a string (a registered
    domain name), or a mapping with ``kind`` in ``SOURCE_KINDS`` and, by kind:
    ``procedural``: ``domain`` (default ``name``), ``split``, ``seed``;
    ``tfds``: ``path`` (dataset dir, or name with ``data_dir``), ``split``;
    ``array_record``: ``path`` (a file or list of files); ``jsonl``: ``path``.
    """
    if isinstance(spec, DomainSource):
        return spec
    if spec is None or isinstance(spec, str | Domain):
        return ProceduralSource(spec if spec is not None else name, name=name)
    spec = dict(spec.to_dict() if hasattr(spec, "to_dict") else spec)
    kind = spec.pop("kind", "procedural")
    if kind not in SOURCE_KINDS:
        raise DataError(f"domain {name!r}: unknown source kind {kind!r}; use one of {SOURCE_KINDS}")
    if kind == "procedural":
        return ProceduralSource(spec.pop("domain", name), name=name, **spec)
    if "path" not in spec:
        raise DataError(f"domain {name!r}: a {kind} source needs the field 'path'")
    path = spec.pop("path")
    if kind == "tfds":
        return TFDSSource(path, name=name, **spec)
    if kind == "array_record":
        return ArrayRecordSource(path, name=name, **spec)
    return JsonlSource(path, name=name, **spec)
