"""Closed registry of tensor formats: what one stored word means (specs/tensor-formats.md)."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from .errors import ArtifactError


@dataclass(frozen=True)
class DirectFormat:
    """Raw little-endian words, one per element."""

    name: str
    word_bytes: int
    numpy_dtype: str  # numpy dtype string of one word (bf16 is carried as uint16)


@dataclass(frozen=True)
class GroupedFormat:
    """Signed integer codes in groups along K, one binary16 scale per group."""

    name: str
    bits: int
    group_size: int
    qmin: int
    qmax: int
    base_bytes_per_group: int  # low-bits plane (nibbles, or whole bytes for 8-bit)
    high_bytes_per_group: int  # extra high-bit plane (Q5, Q6), 0 otherwise

    @property
    def bits_per_weight(self) -> float:
        return (8 * (self.base_bytes_per_group + self.high_bytes_per_group) + 16) / self.group_size


@dataclass(frozen=True)
class FloatCodeFormat:
    """Floating-point codes with their own scale planes (specs/tensor-formats.md §6): NVFP4 (E2M1, an
    E4M3FN scale per 16, an FP32 divisor per row) and FP8 E4M3FN with a BF16 multiplier per row."""

    name: str
    code_bits: int
    block: int  # columns per scale (the row, 0, for FP8 rows)

    @property
    def bits_per_weight(self) -> float:
        return self.code_bits + (8 / self.block if self.block else 0)


FORMATS = MappingProxyType(
    {
        "BF16": DirectFormat("BF16", 2, "<u2"),
        "FP32": DirectFormat("FP32", 4, "<f4"),
        "I32": DirectFormat("I32", 4, "<i4"),
        "Q4G64_F16S": GroupedFormat("Q4G64_F16S", 4, 64, -8, 7, 32, 0),
        "Q5G64_F16S": GroupedFormat("Q5G64_F16S", 5, 64, -16, 15, 32, 8),
        "Q6G64_F16S": GroupedFormat("Q6G64_F16S", 6, 64, -32, 31, 32, 16),
        "W8G32_F16S": GroupedFormat("W8G32_F16S", 8, 32, -127, 127, 32, 0),
        "NVFP4": FloatCodeFormat("NVFP4", 4, 16),
        "FP8_E4M3FN_ROW_BF16S": FloatCodeFormat("FP8_E4M3FN_ROW_BF16S", 8, 0),
    }
)

# Layout each format must use; a closed pairing, not a choice left to the writer.
FORMAT_LAYOUT = MappingProxyType(
    {
        "BF16": "contiguous-le-v1",
        "FP32": "contiguous-le-v1",
        "I32": "contiguous-le-v1",
        "Q4G64_F16S": "row-split-k128-v1",
        "Q5G64_F16S": "row-split-k128-v1",
        "Q6G64_F16S": "row-split-k128-v1",
        "W8G32_F16S": "row-split-k128-v1",
        "NVFP4": "nvfp4-rows-v1",
        "FP8_E4M3FN_ROW_BF16S": "row-scale-v1",
    }
)

RESOURCE_ENCODING = "raw-bytes-v1"


def get_format(name: str) -> DirectFormat | GroupedFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ArtifactError(f"unknown tensor format: {name!r} (known: {', '.join(FORMATS)})") from None


def is_grouped(name: str) -> bool:
    return isinstance(get_format(name), GroupedFormat)
