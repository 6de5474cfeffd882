"""rlpt.runfiles: atomic writes survive a kill, damaged files and bad workdirs get one line."""

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest

from rlpt.runfiles import (
    RunFileError,
    atomic_file,
    atomic_write_json,
    atomic_write_lines,
    atomic_write_text,
    check_workdir,
    move_aside,
    read_json,
    set_aside_run_files,
)

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_atomic_writes_replace_the_file_and_leave_no_temporary(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("old")
    atomic_write_json(path, {"b": [1, 2], "a": 0.5}, indent=2, sort_keys=True)
    assert path.read_text() == '{\n  "a": 0.5,\n  "b": [\n    1,\n    2\n  ]\n}\n'
    atomic_write_text(path, "text")
    assert path.read_text() == "text"
    atomic_write_lines(tmp_path / "m.jsonl", ['{"step": 1}\n', '{"step": 2}\n'])
    assert (tmp_path / "m.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    with atomic_file(tmp_path / "plot.png", "wb") as f:
        f.write(b"\x89PNG")
    assert (tmp_path / "plot.png").read_bytes() == b"\x89PNG"
    assert sorted(os.listdir(tmp_path)) == ["m.jsonl", "plot.png", "summary.json"]


def test_atomic_file_gets_the_usual_permissions(tmp_path):
    umask = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.json", "{}")
    finally:
        os.umask(umask)
    assert os.stat(tmp_path / "a.json").st_mode & 0o777 == 0o644


def test_a_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "config.json"
    atomic_write_json(path, {"seed": 1})
    with pytest.raises(TypeError):
        atomic_write_json(path, {"seed": object()})
    with pytest.raises(RuntimeError), atomic_file(path) as f:
        f.write('{"seed": ')
        raise RuntimeError("killed half way")
    assert read_json(path) == {"seed": 1}
    assert os.listdir(tmp_path) == ["config.json"]


_WRITER = """
import json
import sys
from rlpt.runfiles import atomic_file
path = sys.argv[1]
for i in range(1_000_000):
    # json.dump writes about 1 MB in many pieces while it encodes: a kill lands
    # inside a write, not between two.
    with atomic_file(path) as f:
        json.dump({"i": i, "data": [i] * 200_000}, f)
    print(i, flush=True)
"""


def test_a_writer_killed_mid_write_leaves_a_file_that_parses(tmp_path):
    path = tmp_path / "summary.json"
    env = {**os.environ, "PYTHONPATH": _REPO}
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        for line in proc.stdout:
            if int(line) >= 15:
                break
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    record = read_json(path)
    # The file is one complete write, not a mix of two.
    assert record["i"] >= 15 and set(record["data"]) == {record["i"]}
    assert len(record["data"]) == 200_000


@pytest.mark.parametrize(
    ("content", "what"),
    [
        (None, "missing"),
        ("", "empty"),
        ('{"eval": {"sft": 0.5', "truncated JSON"),
        ('{"eval": "unfinished str', "truncated JSON"),
        ("{'single': 'quotes'}", r"not JSON \(Expecting property name"),
        ('{"a": 1} trailing', r"not JSON \(Extra data at line 1 column 10\)"),
        (b"\xff\xfe", r"not JSON \(not UTF-8"),
    ],
)
def test_read_json_names_the_path_and_the_damage(tmp_path, content, what):
    path = tmp_path / "run_config.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(RunFileError, match=f"^{path}: {what}") as info:
        read_json(path)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


def test_read_json_of_a_directory(tmp_path):
    with pytest.raises(RunFileError, match="is a directory"):
        read_json(tmp_path)


def test_move_aside_never_overwrites_an_earlier_copy(tmp_path):
    for i in range(3):
        (tmp_path / "metrics.jsonl").write_text(f"run {i}\n")
        new = move_aside(tmp_path / "metrics.jsonl", "no checkpoint")
        assert new == str(tmp_path / f"metrics.jsonl.no-checkpoint-{i + 1}")
    assert not (tmp_path / "metrics.jsonl").exists()
    for i in range(3):
        assert (tmp_path / f"metrics.jsonl.no-checkpoint-{i + 1}").read_text() == f"run {i}\n"
    (tmp_path / "checkpoints").mkdir()
    assert move_aside(tmp_path / "checkpoints", "overwritten").endswith("checkpoints.overwritten-1")


def test_set_aside_run_files_moves_the_existing_ones(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 3}\n')
    (tmp_path / "summary.json").write_text("{}")
    moved = set_aside_run_files(
        tmp_path, ["metrics.jsonl", "samples.jsonl", "summary.json"], "no-checkpoint"
    )
    assert moved == {
        str(tmp_path / "metrics.jsonl"): str(tmp_path / "metrics.jsonl.no-checkpoint-1"),
        str(tmp_path / "summary.json"): str(tmp_path / "summary.json.no-checkpoint-1"),
    }
    assert sorted(os.listdir(tmp_path)) == [
        "metrics.jsonl.no-checkpoint-1", "summary.json.no-checkpoint-1"
    ]  # fmt: skip
    assert (tmp_path / "metrics.jsonl.no-checkpoint-1").read_text() == '{"step": 3}\n'


def test_check_workdir_accepts_directories_and_creatable_paths(tmp_path):
    assert check_workdir(tmp_path) == str(tmp_path)
    new = tmp_path / "a" / "b"
    check_workdir(new)
    assert not new.exists()
    check_workdir(new, create=True)
    assert new.is_dir()


def test_check_workdir_refuses_a_file_in_one_line(tmp_path):
    (tmp_path / "run").write_text("")
    with pytest.raises(RunFileError, match=f"^workdir {tmp_path}/run: is a file, not a directory$"):
        check_workdir(tmp_path / "run")
    with pytest.raises(RunFileError, match=f"cannot be created, {tmp_path}/run is a file$"):
        check_workdir(tmp_path / "run" / "sub")


def _check_as_unprivileged(path) -> str:
    """check_workdir's answer for a user other than the owner.

    Root passes every permission check, so as root the check runs in a forked child that
    has dropped to the ``nobody`` user (a fork, not a new interpreter: the interpreter
    may live where that user cannot read).
    """
    if os.geteuid() != 0:
        try:
            check_workdir(path)
        except RunFileError as e:
            return str(e)
        return "ok"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read)
            os.setgid(65534)
            os.setuid(65534)
            try:
                check_workdir(path)
                answer = "ok"
            except RunFileError as e:
                answer = str(e)
            os.write(write, answer.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        answer = f.read().decode()
    os.waitpid(pid, 0)
    return answer


@pytest.fixture
def open_dir():
    """A directory every user can reach (pytest's own temp directories are private)."""
    path = tempfile.mkdtemp(prefix="rlpt-runfiles-")
    os.chmod(path, 0o755)
    yield pathlib.Path(path)
    shutil.rmtree(path)


def test_check_workdir_refuses_an_unreadable_directory(open_dir):
    workdir = open_dir / "run"
    workdir.mkdir()
    os.chmod(workdir, 0o777)
    assert _check_as_unprivileged(workdir) == "ok"
    os.chmod(workdir, 0o700)
    assert _check_as_unprivileged(workdir) == (
        f"workdir {workdir}: not readable and writable by this user"
    )
    assert _check_as_unprivileged(open_dir / "new") == (
        f"workdir {open_dir}/new: cannot be created, {open_dir} is not writable"
    )
