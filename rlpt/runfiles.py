"""Run files that survive a kill: atomic writes, checked reads, nothing deleted.

A run may be killed at any instruction (pre-emption, out of memory, Ctrl-C). What it
leaves behind must still parse, so every file a run rewrites goes through
``atomic_file``: the new content is written to a temporary file in the same directory,
flushed and fsynced, then renamed over the old name (``os.replace`` is atomic on POSIX
file systems), and the directory entry is fsynced too. A reader sees the old file or
the new one, never half of either.

Nothing a run wrote is deleted either: files that no checkpoint matches (a run killed
before its first checkpoint, a run replaced with ``overwrite``) are moved aside under a
name that says why (``metrics.jsonl.no-checkpoint-1``), never over an earlier one.

Bad workdirs and damaged files raise ``RunFileError``, a ``ValueError`` whose message is
one line naming the path and what is wrong with it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import secrets
from collections.abc import Iterable, Iterator
from typing import IO, Any

from absl import logging

# What a ``move_aside`` reason may keep of itself in a file name.
_REASON_CHARS = re.compile(r"[^A-Za-z0-9_.]+")


class RunFileError(ValueError):
    """A run file or workdir that cannot be used; the message is one line naming the path."""


def _fsync_dir(directory: str) -> None:
    # The rename is durable only once the directory entry is on disk. Some file systems
    # (and every non-POSIX one) refuse to open a directory: then the rename is as good
    # as it gets.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(
    path: str | os.PathLike[str], mode: str = "w", *, encoding: str | None = "utf-8"
) -> Iterator[IO[Any]]:
    """Opens a temporary file beside ``path``; on a clean exit it replaces ``path``.

    ``mode`` is ``"w"`` (text, ``encoding``) or ``"wb"`` (bytes). On an exception the
    temporary file is removed and ``path`` is left as it was.

    Hand-written rather than taken from a library: ``atomicwrites`` is archived, and
    ``tempfile.mkstemp`` creates files with mode 0600, while run files should get the
    usual permissions (0666 less the umask) like any other file the run writes.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_file mode must be 'w' or 'wb', got {mode!r}")
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(
        directory, f".{os.path.basename(path)}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    )
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        if mode == "wb":
            f = os.fdopen(fd, "wb")
        else:
            f = os.fdopen(fd, "w", encoding=encoding)
        with f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def atomic_write_text(path: str | os.PathLike[str], text: str) -> None:
    """Writes ``text`` (UTF-8) to ``path`` atomically: a kill leaves the old or the new file."""
    with atomic_file(path, "w") as f:
        f.write(text)


def atomic_write_lines(path: str | os.PathLike[str], lines: Iterable[str]) -> None:
    """Writes ``lines`` (each ending in a newline) to ``path`` atomically (JSONL rewrites)."""
    with atomic_file(path, "w") as f:
        f.writelines(lines)


def atomic_write_json(path: str | os.PathLike[str], obj: Any, **json_kwargs: Any) -> None:
    """Writes ``json.dumps(obj, **json_kwargs)`` and a newline to ``path`` atomically.

    The object is serialised before the file is opened, so an object that is not JSON
    raises without touching ``path``.
    """
    atomic_write_text(path, json.dumps(obj, **json_kwargs) + "\n")


def read_json(path: str | os.PathLike[str]) -> Any:
    """Parses the JSON file ``path``.

    Raises:
      RunFileError: one line naming ``path`` and what is wrong: missing, a directory,
        unreadable, empty, truncated (the text ends inside a value), or not JSON.
    """
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise RunFileError(f"{path}: missing") from None
    except IsADirectoryError:
        raise RunFileError(f"{path}: is a directory, not a JSON file") from None
    except PermissionError as e:
        raise RunFileError(f"{path}: not readable ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise RunFileError(f"{path}: not JSON (not UTF-8 text at byte {e.start})") from None
    if not text.strip():
        raise RunFileError(f"{path}: empty (truncated by a crash?)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        # A cut-off file fails at its very end, or inside a string it never closes.
        if e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated string"):
            raise RunFileError(
                f"{path}: truncated JSON (ends inside a value after {len(text)} characters)"
            ) from None
        raise RunFileError(
            f"{path}: not JSON ({e.msg} at line {e.lineno} column {e.colno})"
        ) from None


def move_aside(path: str | os.PathLike[str], reason: str) -> str:
    """Renames ``path`` (file or directory) to ``PATH.REASON-N`` and returns the new path.

    ``N`` counts up from 1 to the first name not taken, so an earlier moved-aside copy is
    never overwritten. ``reason`` says why (``no-checkpoint``, ``overwritten``); characters
    other than letters, digits, ``_`` and ``.`` become ``-``.
    """
    path = os.fspath(path)
    reason = _REASON_CHARS.sub("-", reason).strip("-") or "aside"
    for n in itertools.count(1):
        target = f"{path}.{reason}-{n}"
        # Only one process (JAX process 0) writes a run's files, so nothing races
        # between this check and the rename.
        if not os.path.lexists(target):
            os.rename(path, target)
            return target
    raise AssertionError("unreachable")


def set_aside_run_files(
    workdir: str | os.PathLike[str], names: Iterable[str], reason: str
) -> dict[str, str]:
    """Moves each existing ``workdir/NAME`` aside with ``move_aside(..., reason)``.

    Returns ``{old path: new path}`` for the files that existed, and logs one line each.
    """
    moved = {}
    for name in names:
        path = os.path.join(os.fspath(workdir), name)
        if os.path.lexists(path):
            moved[path] = move_aside(path, reason)
            logging.warning("Moved %s aside to %s (%s)", path, moved[path], reason)
    return moved


def check_workdir(path: str | os.PathLike[str], *, create: bool = False) -> str:
    """Checks that ``path`` can hold a run, and returns it.

    An existing ``path`` must be a directory this process can list, read and write; a
    missing one must be creatable (its nearest existing parent a writable directory),
    and is created when ``create``.

    Raises:
      RunFileError: one line naming the path: a file, not readable or writable, or
        not creatable.
    """
    path = os.fspath(path)
    if os.path.lexists(path):
        if not os.path.isdir(path):
            raise RunFileError(f"workdir {path}: is a file, not a directory")
        if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
            raise RunFileError(f"workdir {path}: not readable and writable by this user")
        return path
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise RunFileError(f"workdir {path}: cannot be created, {parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise RunFileError(f"workdir {path}: cannot be created, {parent} is not writable")
    if create:
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise RunFileError(f"workdir {path}: cannot be created ({e.strerror})") from None
    return path


__all__ = [
    "RunFileError",
    "atomic_file",
    "atomic_write_json",
    "atomic_write_lines",
    "atomic_write_text",
    "check_workdir",
    "move_aside",
    "read_json",
    "set_aside_run_files",
]
