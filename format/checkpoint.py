"""Read-only access to a Hugging Face safetensors checkpoint directory, row range by row range.

Tensors are read with pread rather than a shared mmap, so a conversion's resident memory is
bounded by the chunk being encoded, not by the shards it has touched.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import ConvertError

_DTYPES = {"BF16": ("bf16", 2), "F16": ("<f2", 2), "F32": ("<f4", 4)}
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class SourceTensor:
    path: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte

    @property
    def item_bytes(self) -> int:
        return _DTYPES[self.dtype][1]


def _tensor_fields(shard: str, key: str, info) -> tuple[str, tuple[int, ...], tuple[int, int]]:
    """dtype, shape and data offsets of one header entry, each of the type safetensors defines."""
    def bad(what: str):
        return ConvertError(f"{shard}: tensor {key[:80]!r} has {what} (corrupt shard?)")

    if not isinstance(info, dict):
        raise bad("a header entry that is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad("no dtype")
    if not isinstance(shape, list) or len(shape) > 8 or not all(_is_count(d) for d in shape):
        raise bad(f"a shape that is not a list of non-negative integers ({str(shape)[:40]})")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets) \
            or offsets[0] > offsets[1]:
        raise bad(f"data_offsets that are not two ordered non-negative integers ({str(offsets)[:40]})")
    return dtype, tuple(shape), (offsets[0], offsets[1])


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 48


class Checkpoint:
    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise ConvertError(f"{self.dir}: not a directory (expected a Hugging Face checkpoint folder)")
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise ConvertError(f"{self.dir}: no *.safetensors files found")
        self.tensors: dict[str, SourceTensor] = {}
        self.largest_shard_bytes = max(f.stat().st_size for f in files)
        for f in files:
            self._index(f)

    def _index(self, path: Path) -> None:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ConvertError(f"{path.name}: truncated safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise ConvertError(f"{path.name}: corrupt safetensors header length {n}")
            try:
                header = json.loads(fh.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError, ValueError, RecursionError) as exc:
                raise ConvertError(f"{path.name}: corrupt safetensors header ({str(exc)[:200]})") from None
        if not isinstance(header, dict):
            raise ConvertError(f"{path.name}: corrupt safetensors header (a {type(header).__name__}, not an object)")
        for key, info in header.items():
            if key == "__metadata__":
                continue
            dtype, shape, (b, e) = _tensor_fields(path.name, key, info)
            if dtype not in _DTYPES:
                raise ConvertError(
                    f"{path.name}: tensor {key} has dtype {dtype}; convert reads BF16, F16 or F32 checkpoints only"
                )
            if e - b != int(np.prod(shape, dtype=np.int64)) * _DTYPES[dtype][1] or 8 + n + e > size:
                raise ConvertError(f"{path.name}: tensor {key} has inconsistent offsets (corrupt shard?)")
            if key in self.tensors:
                raise ConvertError(f"tensor {key} appears in two shards ({self.tensors[key].path.name}, {path.name})")
            self.tensors[key] = SourceTensor(path, dtype, shape, 8 + n + b)

    def has(self, key: str) -> bool:
        return key in self.tensors

    def shape(self, key: str) -> tuple[int, ...]:
        return self.get(key).shape

    def get(self, key: str) -> SourceTensor:
        try:
            return self.tensors[key]
        except KeyError:
            raise ConvertError(f"checkpoint lacks tensor {key}") from None

    def read(self, key: str, index: int | None = None, row_begin: int = 0, row_end: int | None = None):
        """Rows [row_begin, row_end) of a 2-D tensor (or of slice `index` of a 3-D one) as a torch tensor."""
        import torch

        t = self.get(key)
        shape = t.shape
        base = t.begin
        if index is not None:
            per_slice = int(np.prod(shape[1:], dtype=np.int64)) * t.item_bytes
            base += index * per_slice
            shape = shape[1:]
        rows = shape[0] if shape else 1
        row_end = rows if row_end is None else row_end
        row_elems = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        nbytes = (row_end - row_begin) * row_elems * t.item_bytes
        buf = bytearray(nbytes)
        with open(t.path, "rb", buffering=0) as fh:
            got = os.preadv(fh.fileno(), [buf], base + row_begin * row_elems * t.item_bytes)
        if got != nbytes:
            raise ConvertError(f"short read of {key} from {t.path.name} (file truncated?)")
        if t.dtype == "BF16":
            out = torch.frombuffer(buf, dtype=torch.int16).view(torch.bfloat16)
        else:
            out = torch.from_numpy(np.frombuffer(buf, dtype=_DTYPES[t.dtype][0]).copy())
        new_shape = (row_end - row_begin,) + tuple(shape[1:]) if shape else ()
        return out.reshape(new_shape)
