"""Sources: TFDS ArrayRecord round trip, JSONL and ArrayRecord files, bad input."""

import json

import numpy as np
import pytest

from rlpt.data import (
    ArrayRecordSource,
    CurriculumLoader,
    DataError,
    JsonlSource,
    ProceduralSource,
    TFDSSource,
    make_curriculum,
    make_source,
    materialize_domain,
)


def _loader(sources, **kwargs):
    names = list(sources)
    cur = make_curriculum(
        {"strategy": "uniform", "floor": 0.0},
        names,
        max_levels=[s.max_difficulty for s in sources.values()],
        sizes=[s.size for s in sources.values()],
    )
    kwargs.setdefault("batch_size", 4)
    return CurriculumLoader(sources, cur, shard_index=0, shard_count=1, buckets=(64, 256), **kwargs)


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_tfds_array_record_round_trip(tmp_path):
    path = materialize_domain("arithmetic", str(tmp_path), n=6, levels=[1, 2], name="rlpt_arith_t")
    source = TFDSSource(path, name="arithmetic")
    assert source.max_difficulty == 2 and source.size == 12
    procedural = ProceduralSource("arithmetic")
    for level in (1, 2):
        got = sorted(
            (t["id"].decode(), t["prompt"].decode())
            for t in source.dataset(level).to_iter_dataset()
        )
        want = sorted((t.id, t.prompt) for t in list(procedural.dataset(level)[:6]))
        assert got == want
    # Also by name inside a data_dir, from config.
    by_name = make_source(
        "arith", {"kind": "tfds", "path": "rlpt_arith_t", "data_dir": str(tmp_path)}
    )
    batch = next(_loader({"arith": by_name}))
    assert all(t.domain == "arithmetic" and t.answer for t in batch.tasks)


def test_jsonl_source_and_corrupt_records_are_skipped_and_counted(tmp_path):
    lines = [json.dumps({"prompt": f"q{i}", "answer": str(i), "id": f"j{i}"}) for i in range(5)]
    lines.insert(2, "{not json")
    source = JsonlSource(_write_jsonl(tmp_path / "d.jsonl", lines), name="mine")
    assert source.size == 6
    loader = _loader({"mine": source}, batch_size=10)
    batch = next(loader)
    assert {t.prompt for t in batch.tasks} == {f"q{i}" for i in range(5)}
    assert loader.metrics()["data/mine/corrupt_skipped"] >= 1  # once per epoch read
    assert loader.metrics()["data/corrupt_skipped"] == loader.metrics()["data/mine/corrupt_skipped"]


def test_array_record_file_source(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    path = str(tmp_path / "d.array_record")
    writer = ArrayRecordWriter(path, "group_size:1")
    for i in range(3):
        writer.write(json.dumps({"prompt": f"p{i}", "data": {"k": i}}).encode())
    writer.close()
    source = make_source("ar", {"kind": "array_record", "path": path})
    assert isinstance(source, ArrayRecordSource) and source.size == 3
    batch = next(_loader({"ar": source}, batch_size=3))
    assert sorted(t.prompt for t in batch.tasks) == ["p0", "p1", "p2"]
    assert sorted(t.data["k"] for t in batch.tasks) == [0, 1, 2]


def test_too_long_prompts_are_filtered_and_counted(tmp_path):
    lines = [json.dumps({"prompt": "x" * n}) for n in (5, 500, 6)]
    source = JsonlSource(_write_jsonl(tmp_path / "d.jsonl", lines), name="m")
    loader = _loader({"m": source}, batch_size=4)
    batch = next(loader)
    assert all(len(t.prompt) < 10 for t in batch.tasks)
    assert batch.tokens.shape == (4, 64)
    assert loader.metrics()["data/m/too_long_skipped"] >= 1


def test_bad_input_errors_name_domain_and_field(tmp_path):
    with pytest.raises(DataError, match="'ghost'.*does not exist"):
        make_source("ghost", {"kind": "jsonl", "path": str(tmp_path / "missing.jsonl")})
    with pytest.raises(DataError, match="'ghost'.*no prepared TFDS dataset"):
        make_source("ghost", {"kind": "tfds", "path": str(tmp_path / "nothing")})
    with pytest.raises(DataError, match="'nodomain'.*unknown domain"):
        make_source("nodomain")
    with pytest.raises(DataError, match="'x'.*needs the field 'path'"):
        make_source("x", {"kind": "jsonl"})
    with pytest.raises(DataError, match="unknown source kind"):
        make_source("x", {"kind": "parquet", "path": "p"})
    source = JsonlSource(_write_jsonl(tmp_path / "d.jsonl", ['{"question": "q"}']), name="qa")
    with pytest.raises(DataError, match="domain 'qa'.*missing required field 'prompt'"):
        next(_loader({"qa": source}))


def test_all_corrupt_domain_raises_instead_of_spinning(tmp_path):
    source = JsonlSource(_write_jsonl(tmp_path / "d.jsonl", ["garbage"] * 3), name="bad")
    with pytest.raises(DataError, match="'bad'.*in a row"):
        next(_loader({"bad": source}, max_consecutive_skips=50))


def test_procedural_item_depends_on_level_and_index_only():
    source = ProceduralSource("arithmetic", seed=3)
    a, b = source.dataset(2)[7], source.dataset(2)[7]
    assert a == b and a.difficulty == 2
    assert source.dataset(1)[7].prompt != a.prompt or source.dataset(1)[7].difficulty == 1
    assert np.isinf(source.size)
