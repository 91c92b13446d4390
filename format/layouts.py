"""How words become bytes: encoded sizes and plane packing (specs/layouts.md).

This module does not quantize and does not know model roles; it only maps codes and
scales to the byte planes of a layout and back, with checked arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ArtifactError
from .numeric import FORMAT_LAYOUT, DirectFormat, GroupedFormat, get_format

LAYOUTS = ("contiguous-le-v1", "row-split-k128-v1", "nvfp4-rows-v1", "row-scale-v1", "raw-bytes-v1")
TENSOR_ALIGNMENT = 256
RESOURCE_ALIGNMENT = 1
ROW_SPLIT_K_ALIGN = 128
PLANE_ALIGNMENT = 256
MAX_RANK = 8
MAX_U64 = 2**64 - 1


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def checked_product(values, what: str) -> int:
    total = 1
    for v in values:
        if type(v) is not int or v < 0:
            raise ArtifactError(f"{what}: dimension {v!r} is not a non-negative integer")
        total *= v
        if total > MAX_U64:
            raise ArtifactError(f"{what}: element count overflows u64")
    return total


@dataclass(frozen=True)
class RowSplitGeometry:
    """Plane geometry of one [N, K] tensor in row-split-k128-v1."""

    rows: int
    cols: int
    fmt: GroupedFormat

    @property
    def k_pad(self) -> int:
        return align_up(self.cols, ROW_SPLIT_K_ALIGN)

    @property
    def groups_per_row(self) -> int:
        return self.k_pad // self.fmt.group_size

    @property
    def base_bytes(self) -> int:
        return self.rows * self.groups_per_row * self.fmt.base_bytes_per_group

    @property
    def high_bytes(self) -> int:
        return self.rows * self.groups_per_row * self.fmt.high_bytes_per_group

    @property
    def scale_bytes(self) -> int:
        return self.rows * self.groups_per_row * 2

    @property
    def high_offset(self) -> int:
        return align_up(self.base_bytes, PLANE_ALIGNMENT)

    @property
    def scale_offset(self) -> int:
        return self.high_offset + align_up(self.high_bytes, PLANE_ALIGNMENT)

    @property
    def total_bytes(self) -> int:
        return self.scale_offset + self.scale_bytes

    def split(self, buf):
        """(base, high or None, scale) slices of a whole object's bytes (memoryview, array or tensor)."""
        high = buf[self.high_offset : self.high_offset + self.high_bytes] if self.high_bytes else None
        return buf[: self.base_bytes], high, buf[self.scale_offset : self.scale_offset + self.scale_bytes]

    def row_spans(self, row_begin: int, row_end: int) -> list[tuple[int, int]]:
        """(offset within the object, length) of the three plane spans holding rows [begin, end)."""
        g = self.groups_per_row
        n = row_end - row_begin
        spans = [(row_begin * g * self.fmt.base_bytes_per_group, n * g * self.fmt.base_bytes_per_group)]
        if self.fmt.high_bytes_per_group:
            spans.append(
                (self.high_offset + row_begin * g * self.fmt.high_bytes_per_group, n * g * self.fmt.high_bytes_per_group)
            )
        spans.append((self.scale_offset + row_begin * g * 2, n * g * 2))
        return spans


def check_layout_pairing(fmt_name: str, layout: str, what: str) -> None:
    fmt = get_format(fmt_name)
    if layout not in LAYOUTS or layout == "raw-bytes-v1":
        raise ArtifactError(f"{what}: unknown tensor layout: {layout!r}")
    if FORMAT_LAYOUT[fmt.name] != layout:
        raise ArtifactError(f"{what}: format {fmt.name} requires layout {FORMAT_LAYOUT[fmt.name]}, not {layout}")


def encoded_size(fmt_name: str, shape: list[int] | tuple[int, ...], what: str = "tensor") -> int:
    """Exact byte count of a tensor object; raises ArtifactError on shapes the format forbids."""
    fmt = get_format(fmt_name)
    if len(shape) > MAX_RANK:
        raise ArtifactError(f"{what}: rank {len(shape)} exceeds the maximum of {MAX_RANK}")
    elements = checked_product(shape, what)
    if isinstance(fmt, DirectFormat):
        size = elements * fmt.word_bytes
    elif not isinstance(fmt, GroupedFormat):  # floating-point codes (format/float_codes.py)
        from .float_codes import geometry

        if len(shape) != 2 or shape[0] == 0 or shape[1] == 0 or shape[1] % (fmt.block or 1):
            raise ArtifactError(f"{what}: format {fmt.name} needs a non-empty rank-2 shape"
                                + (f" with columns a multiple of {fmt.block}" if fmt.block else "") + f", got {list(shape)}")
        size = geometry(fmt.name, shape[0], shape[1]).total_bytes
    else:
        if len(shape) != 2 or shape[0] == 0 or shape[1] == 0:
            raise ArtifactError(f"{what}: format {fmt.name} needs a non-empty rank-2 shape, got {list(shape)}")
        size = RowSplitGeometry(shape[0], shape[1], fmt).total_bytes
    if size > MAX_U64:
        raise ArtifactError(f"{what}: encoded size overflows u64")
    return size


# --- row-split plane packing -------------------------------------------------------------


def pack_row_split(codes: np.ndarray, scales: np.ndarray, fmt: GroupedFormat) -> tuple[bytes, bytes, bytes]:
    """Pack int codes [n, K_pad] and binary16 scale bits [n, groups] into (base, high, scale) planes."""
    n, k_pad = codes.shape
    u = (codes.astype(np.int16) & ((1 << fmt.bits) - 1)).astype(np.uint8)
    if fmt.bits == 8:
        base = u
    else:
        lo = u & 0xF
        base = lo[:, 0::2] | (lo[:, 1::2] << 4)
    high = b""
    if fmt.bits in (5, 6):
        hb = fmt.bits - 4
        h = (u >> 4) & ((1 << hb) - 1)
        lanes_per_byte = 8 // hb
        h = h.reshape(n, k_pad // lanes_per_byte, lanes_per_byte).astype(np.uint16)
        shifts = (np.arange(lanes_per_byte, dtype=np.uint16) * hb)[None, None, :]
        high = np.bitwise_or.reduce(h << shifts, axis=2).astype(np.uint8).tobytes()
    return np.ascontiguousarray(base).tobytes(), high, np.ascontiguousarray(scales.astype("<u2")).tobytes()


def unpack_row_split(
    base: np.ndarray, high: np.ndarray | None, scale: np.ndarray, rows: int, fmt: GroupedFormat, k_pad: int
) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of pack_row_split: returns (codes int16 [rows, K_pad], scale bits uint16 [rows, groups])."""
    base = np.frombuffer(base, dtype=np.uint8).reshape(rows, -1)
    if fmt.bits == 8:
        u = base.astype(np.int16)
    else:
        u = np.empty((rows, k_pad), dtype=np.int16)
        u[:, 0::2] = base & 0xF
        u[:, 1::2] = base >> 4
        if fmt.bits in (5, 6):
            hb = fmt.bits - 4
            lanes_per_byte = 8 // hb
            hbytes = np.frombuffer(high, dtype=np.uint8).reshape(rows, -1, 1)
            shifts = (np.arange(lanes_per_byte, dtype=np.uint8) * hb)[None, None, :]
            h = ((hbytes >> shifts) & ((1 << hb) - 1)).reshape(rows, k_pad).astype(np.int16)
            u |= h << 4
    sign = 1 << (fmt.bits - 1)
    codes = (u ^ sign) - sign  # sign-extend b-bit two's complement
    scales = np.frombuffer(scale, dtype="<u2").reshape(rows, -1)
    return codes, scales
