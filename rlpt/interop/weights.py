"""Safetensors checkpoints: find each tensor's shard, read blocks of it, write shards.

Reading goes through ``safetensors.safe_open`` one tensor block at a time, so
a loader holds at most one tensor's worth of host memory. numpy has no
bfloat16, so bfloat16 tensors are read through a memory map of the same file
(the safetensors layout: an 8-byte header length, a JSON header, raw data).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence

import ml_dtypes
import numpy as np

from rlpt.interop.convert import ConversionError
from rlpt.runfiles import atomic_write_json, read_json

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_RAW_DTYPES = {"BF16": ml_dtypes.bfloat16}


def _safe_open(path: str):
    try:
        from safetensors import safe_open
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("reading Hugging Face weights needs `pip install safetensors`") from e
    return safe_open(path, framework="numpy")


class SafetensorsCheckpoint:
    """The tensors of a Hugging Face model directory (one file, or shards with an index)."""

    def __init__(self, directory: str):
        self.directory = directory
        index_path = os.path.join(directory, INDEX_FILE)
        single = os.path.join(directory, SINGLE_FILE)
        if os.path.exists(index_path):
            weight_map = read_json(index_path).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ConversionError(f"{index_path}: no 'weight_map'")
            self.index_file = index_path
        elif os.path.exists(single):
            with _safe_open(single) as f:
                weight_map = dict.fromkeys(f.keys(), SINGLE_FILE)
            self.index_file = single
        else:
            raise ConversionError(f"{directory}: neither {INDEX_FILE} nor {SINGLE_FILE} found")
        for name, shard in weight_map.items():
            if not os.path.exists(os.path.join(directory, shard)):
                raise ConversionError(
                    f"missing shard {os.path.join(directory, shard)} (listed in "
                    f"{self.index_file} for tensor {name!r})"
                )
        self.weight_map: dict[str, str] = weight_map
        self._shapes: dict[str, tuple[tuple[int, ...], str]] = {}

    def file_of(self, name: str) -> str:
        return os.path.join(self.directory, self.weight_map[name])

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def names(self) -> list[str]:
        return list(self.weight_map)

    def info(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, safetensors dtype string) of a tensor, from its shard's header."""
        if name not in self._shapes:
            with _safe_open(self.file_of(name)) as f:
                if name not in set(f.keys()):
                    raise ConversionError(
                        f"{self.file_of(name)}: tensor {name!r} listed in {self.index_file} "
                        "is not in the file"
                    )
                sl = f.get_slice(name)
                self._shapes[name] = (tuple(sl.get_shape()), sl.get_dtype())
        return self._shapes[name]

    def read(self, name: str, index: Sequence[slice]) -> np.ndarray:
        """``tensor[index]`` as float32 (contiguous ranges only)."""
        path = self.file_of(name)
        _, dtype = self.info(name)
        if dtype in _RAW_DTYPES:
            block = _raw_block(path, name, _RAW_DTYPES[dtype], index)
        else:
            with _safe_open(path) as f:
                block = f.get_slice(name)[tuple(index)]
        return np.asarray(block, np.float32)


def _raw_block(path: str, name: str, dtype, index: Sequence[slice]) -> np.ndarray:
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    entry = header[name]
    start, stop = entry["data_offsets"]
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len + start,
                     shape=(stop - start,))  # fmt: skip
    return np.array(data.view(dtype).reshape(entry["shape"])[tuple(index)])


def plan_shards(sizes: Iterable[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Group tensors, in order, into shards of at most ``max_shard_bytes`` each.

    A tensor larger than the limit gets a shard of its own.
    """
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def write_safetensors(
    directory: str,
    tensors: Iterator[tuple[str, np.ndarray]],
    shards: list[list[str]],
    metadata: Mapping[str, str] | None = None,
) -> list[str]:
    """Write ``tensors`` (yielded in shard order) as HF shards plus an index when several.

    Only one shard's tensors are held at a time. Returns the written file names.
    """
    from safetensors.numpy import save_file

    total = len(shards)
    names = (
        [SINGLE_FILE]
        if total == 1
        else [f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i in range(total)]
    )
    weight_map, total_size = {}, 0
    for file_name, shard in zip(names, shards):
        block = {}
        for expected in shard:
            name, value = next(tensors)
            assert name == expected, (name, expected)
            block[name] = np.ascontiguousarray(value)
            weight_map[name] = file_name
            total_size += value.nbytes
        save_file(block, os.path.join(directory, file_name), metadata={"format": "pt"})
        del block
    if total > 1:
        index = {"metadata": {"total_size": total_size, **(metadata or {})},
                 "weight_map": weight_map}  # fmt: skip
        atomic_write_json(os.path.join(directory, INDEX_FILE), index, indent=2)
    return names


__all__ = ["INDEX_FILE", "SINGLE_FILE", "SafetensorsCheckpoint", "plan_shards", "write_safetensors"]
