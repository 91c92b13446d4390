"""Floating-point weight codes: NVFP4 and FP8 E4M3FN with row scales (specs/tensor-formats.md §6).

Upstream's `nvfp4` profile stores its products as E2M1 codes with one E4M3FN scale per 16 weights (swizzled
in 128-row x 4-group tiles, `blockscale-k16-m128x4-v1`) and FP32 weight divisors, and some as FP8 E4M3FN
with one BF16 multiplier per row (`row-scale-v1`). This module is the numpy reference: the geometry of our
resident layouts (`nvfp4-rows-v1`: the same codes, the scales in natural row order, one divisor per row;
`row-scale-v1` as upstream's), the decoders, and the exact (byte-moving) conversion from upstream's swizzle.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .layouts import align_up

PLANE = 256
# E2M1 nibble -> value: bit 3 sign, 2 exponent bits (bias 1), 1 mantissa bit
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       dtype=np.float32)


def _e4m3fn_table() -> np.ndarray:
    """Every E4M3FN byte as float32: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities,
    S.1111.111 is NaN."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 7
    value = np.where(exp == 0, man / 8.0 * 2.0 ** -6, (1 + man / 8.0) * 2.0 ** (exp - 7.0))
    value = np.where((b & 0x7F) == 0x7F, np.nan, value)
    return (sign * value).astype(np.float32)


E4M3FN_VALUES = _e4m3fn_table()


@dataclass(frozen=True)
class NvFp4Geometry:
    """`nvfp4-rows-v1`: codes [N, K/2] (low nibble = even column), pad to 256; E4M3FN scales [N, K/16]
    in row order, pad to 256; FP32 divisors [N], one per row."""

    rows: int
    cols: int

    @property
    def code_bytes(self) -> int:
        return self.rows * self.cols // 2

    @property
    def scale_offset(self) -> int:
        return align_up(self.code_bytes, PLANE)

    @property
    def scale_bytes(self) -> int:
        return self.rows * self.cols // 16

    @property
    def divisor_offset(self) -> int:
        return self.scale_offset + align_up(self.scale_bytes, PLANE)

    @property
    def total_bytes(self) -> int:
        return self.divisor_offset + 4 * self.rows

    def split(self, buf):
        return (buf[: self.code_bytes], buf[self.scale_offset : self.scale_offset + self.scale_bytes],
                buf[self.divisor_offset : self.divisor_offset + 4 * self.rows])


@dataclass(frozen=True)
class Fp8RowGeometry:
    """`row-scale-v1`: E4M3FN codes [N, K] row-major, pad to 256, BF16 multipliers [N]."""

    rows: int
    cols: int

    @property
    def code_bytes(self) -> int:
        return self.rows * self.cols

    @property
    def scale_offset(self) -> int:
        return align_up(self.code_bytes, PLANE)

    @property
    def total_bytes(self) -> int:
        return self.scale_offset + 2 * self.rows

    def split(self, buf):
        return buf[: self.code_bytes], buf[self.scale_offset : self.scale_offset + 2 * self.rows]


def geometry(fmt_name: str, rows: int, cols: int):
    return NvFp4Geometry(rows, cols) if fmt_name == "NVFP4" else Fp8RowGeometry(rows, cols)


def decode_nvfp4(codes, scales, divisors, rows: int, cols: int) -> np.ndarray:
    """float32 [rows, cols]: E2M1(code) * E4M3FN(scale of its 16) / divisor of its row."""
    c = np.frombuffer(codes, np.uint8).reshape(rows, cols // 2)
    vals = np.empty((rows, cols), np.float32)
    vals[:, 0::2], vals[:, 1::2] = E2M1_VALUES[c & 0xF], E2M1_VALUES[c >> 4]
    s = E4M3FN_VALUES[np.frombuffer(scales, np.uint8).reshape(rows, cols // 16)]
    d = np.frombuffer(divisors, "<f4").reshape(rows, 1)
    return (vals.reshape(rows, cols // 16, 16) * s[:, :, None]).reshape(rows, cols) / d


def decode_fp8_rows(codes, scales, rows: int, cols: int) -> np.ndarray:
    """float32 [rows, cols]: E4M3FN(code) * BF16 row multiplier."""
    v = E4M3FN_VALUES[np.frombuffer(codes, np.uint8).reshape(rows, cols)]
    s = (np.frombuffer(scales, "<u2").astype(np.uint32) << 16).view(np.float32).reshape(rows, 1)
    return v * s


def decode(fmt_name: str, buf, rows: int, cols: int) -> np.ndarray:
    geo = geometry(fmt_name, rows, cols)
    if fmt_name == "NVFP4":
        return decode_nvfp4(*geo.split(buf), rows, cols)
    return decode_fp8_rows(*geo.split(buf), rows, cols)


def block_scale_offsets(rows: int, cols: int) -> np.ndarray:
    """Byte offset in upstream's swizzled scale plane (`blockscale-k16-m128x4-v1`) of natural scale (n, g),
    as an int64 [rows, cols/16] array: 128-row x 4-group tiles of 512 bytes, rows of a tile 32 apart."""
    n = np.arange(rows)[:, None]
    g = np.arange(cols // 16)[None, :]
    k_tiles = cols // 64
    return ((n // 128) * k_tiles + g // 4) * 512 + (n % 128 % 32) * 16 + (n % 128 // 32) * 4 + g % 4


def nvfp4_from_block_scale(buf, rows: int, cols: int, divisors: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [rows, cols/2], natural scales [rows, cols/16], per-row divisors [rows]) of an upstream
    `blockscale-k16-m128x4-v1` object; bytes moved, nothing re-encoded."""
    code_bytes = rows * cols // 2
    scale_offset = align_up(code_bytes, PLANE)
    data = np.frombuffer(buf, np.uint8)
    codes = data[:code_bytes].reshape(rows, cols // 2)
    plane = data[scale_offset : scale_offset + rows * cols // 16]
    scales = plane[block_scale_offsets(rows, cols)]
    start = scale_offset + rows * cols // 16
    per_source = np.frombuffer(data[start : start + 4 * divisors].tobytes(), "<f4")
    return codes, scales, np.repeat(per_source, rows // divisors)


def nvfp4_rows_bytes(codes: np.ndarray, scales: np.ndarray, divisors: np.ndarray) -> bytes:
    """Planes of `nvfp4-rows-v1` from codes [N, K/2], natural scales [N, K/16], divisors [N]."""
    rows, half = codes.shape
    geo = NvFp4Geometry(rows, 2 * half)
    out = np.zeros(geo.total_bytes, np.uint8)
    out[: geo.code_bytes] = codes.reshape(-1)
    out[geo.scale_offset : geo.scale_offset + geo.scale_bytes] = scales.reshape(-1)
    out[geo.divisor_offset :] = np.ascontiguousarray(divisors, "<f4").view(np.uint8)
    return out.tobytes()


def fp8_rows_bytes(codes: np.ndarray, scales: np.ndarray) -> bytes:
    """Planes of `row-scale-v1` from codes [N, K] and BF16 multiplier words [N]."""
    rows, cols = codes.shape
    geo = Fp8RowGeometry(rows, cols)
    out = np.zeros(geo.total_bytes, np.uint8)
    out[: geo.code_bytes] = codes.reshape(-1)
    out[geo.scale_offset :] = np.ascontiguousarray(scales, "<u2").view(np.uint8)
    return out.tobytes()

