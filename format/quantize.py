"""MAXABS_F16_RECIP_RNE_V1, the canonical grouped encoder (specs/tensor-formats.md §Encoder).

`quantize_reference` is the numpy oracle, written step by step after the spec.
`quantize_torch` is the fast path (CPU or GPU) and must agree with it bit for bit.
"""

from __future__ import annotations

import numpy as np

from .errors import QuantizationError
from .layouts import ROW_SPLIT_K_ALIGN, align_up, pack_row_split, unpack_row_split
from .numeric import GroupedFormat, get_format

F16_SMALLEST_SUBNORMAL_BITS = 0x0001


def _as_grouped(fmt: GroupedFormat | str) -> GroupedFormat:
    f = get_format(fmt) if isinstance(fmt, str) else fmt
    if not isinstance(f, GroupedFormat):
        raise QuantizationError(f"format {f.name} is not a grouped integer format")
    return f


def quantize_reference(x: np.ndarray, fmt: GroupedFormat | str) -> tuple[np.ndarray, np.ndarray]:
    """Encode a float [N, K] matrix. Returns (codes int8 [N, K_pad], scale bits uint16 [N, groups])."""
    f = _as_grouped(fmt)
    x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2:
        raise QuantizationError(f"grouped formats encode rank-2 tensors, got shape {list(x.shape)}")
    if not np.isfinite(x).all():
        raise QuantizationError("input holds NaN or infinity; grouped formats encode finite values only")
    n, k = x.shape
    k_pad = align_up(k, ROW_SPLIT_K_ALIGN)
    padded = np.zeros((n, k_pad), dtype=np.float32)
    padded[:, :k] = x
    groups = padded.reshape(n, k_pad // f.group_size, f.group_size)
    amax = np.abs(groups).max(axis=2)  # step 1
    raw = (amax / np.float32(f.qmax)).astype(np.float32)  # step 2, f32 division
    with np.errstate(over="ignore"):
        s16 = raw.astype(np.float16)  # step 3, RNE
    if np.isinf(s16).any():
        raise QuantizationError("a group's scale overflows binary16 (|x| too large for this format)")
    bits = s16.view(np.uint16).copy()
    rescue = (bits == 0) & (amax > 0)
    bits[rescue] = F16_SMALLEST_SUBNORMAL_BITS
    s32 = bits.view(np.float16).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(s32 > 0, np.float32(1.0) / s32, np.float32(0.0)).astype(np.float32)  # step 4
    scaled = (groups * inv[:, :, None]).astype(np.float32)  # step 5: multiply, never divide
    codes = np.clip(np.rint(scaled), f.qmin, f.qmax).astype(np.int8)
    return codes.reshape(n, k_pad), bits


def quantize_torch(x, fmt: GroupedFormat | str):
    """Torch implementation of the same encoder; returns (codes int8, scale bits int16) tensors."""
    import torch

    f = _as_grouped(fmt)
    x = x.to(torch.float32)
    if x.dim() != 2:
        raise QuantizationError(f"grouped formats encode rank-2 tensors, got shape {list(x.shape)}")
    if not torch.isfinite(x).all():
        raise QuantizationError("input holds NaN or infinity; grouped formats encode finite values only")
    n, k = x.shape
    k_pad = align_up(k, ROW_SPLIT_K_ALIGN)
    if k_pad != k:
        x = torch.nn.functional.pad(x, (0, k_pad - k))
    groups = x.view(n, k_pad // f.group_size, f.group_size)
    amax = groups.abs().amax(dim=2)
    raw = amax / f.qmax
    s16 = raw.to(torch.float16)
    if torch.isinf(s16).any():
        raise QuantizationError("a group's scale overflows binary16 (|x| too large for this format)")
    bits = s16.view(torch.int16).clone()
    bits[(bits == 0) & (amax > 0)] = F16_SMALLEST_SUBNORMAL_BITS
    s32 = bits.view(torch.float16).to(torch.float32)
    inv = torch.where(s32 > 0, 1.0 / s32, torch.zeros_like(s32))
    codes = torch.round(groups * inv[:, :, None]).clamp_(f.qmin, f.qmax).to(torch.int8)
    return codes.view(n, k_pad), bits


def encode_rows(x, fmt: GroupedFormat | str) -> tuple[bytes, bytes, bytes]:
    """Quantize rows (numpy array or torch tensor) and pack them into row-split planes."""
    f = _as_grouped(fmt)
    if isinstance(x, np.ndarray):
        codes, bits = quantize_reference(x, f)
    else:
        codes_t, bits_t = quantize_torch(x, f)
        codes, bits = codes_t.cpu().numpy(), bits_t.cpu().numpy().view(np.uint16)
    return pack_row_split(codes, bits, f)


def dequantize(base: bytes, high: bytes | None, scale: bytes, rows: int, cols: int, fmt: GroupedFormat | str) -> np.ndarray:
    """Decode row-split planes to float32 [rows, cols]: w = f32(scale) * f32(code)."""
    f = _as_grouped(fmt)
    k_pad = align_up(cols, ROW_SPLIT_K_ALIGN)
    codes, bits = unpack_row_split(base, high, scale, rows, f, k_pad)
    s = bits.view(np.float16).astype(np.float32)
    w = codes.reshape(rows, -1, f.group_size).astype(np.float32) * s[:, :, None]
    return w.reshape(rows, k_pad)[:, :cols]
