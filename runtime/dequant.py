"""Torch decoding of artifact tensors (CPU or GPU); numpy's format.quantize.dequantize is the oracle."""

from __future__ import annotations

import numpy as np
import torch

from format.container import Artifact
from format.numeric import FloatCodeFormat, GroupedFormat, get_format


def _u8(view, device) -> torch.Tensor:
    arr = np.frombuffer(view, dtype=np.uint8)
    return torch.from_numpy(arr.copy()).to(device)


def unpack_codes(base: torch.Tensor, high: torch.Tensor | None, rows: int, k_pad: int, fmt: GroupedFormat) -> torch.Tensor:
    """Row-split planes (uint8) -> signed codes int16 [rows, K_pad]."""
    base = base.reshape(rows, -1)
    if fmt.bits == 8:
        return base.view(torch.int8).to(torch.int16)
    u = torch.empty(rows, k_pad, dtype=torch.int16, device=base.device)
    u[:, 0::2] = (base & 0xF).to(torch.int16)
    u[:, 1::2] = (base >> 4).to(torch.int16)
    if high is not None:
        hb = fmt.bits - 4
        per_byte = 8 // hb
        shifts = torch.arange(per_byte, device=base.device, dtype=torch.int16) * hb
        h = (high.view(rows, -1, 1).to(torch.int16) >> shifts) & ((1 << hb) - 1)
        u |= h.reshape(rows, k_pad) << 4
    sign = 1 << (fmt.bits - 1)
    return (u ^ sign) - sign


def dense_rows(base: torch.Tensor, high: torch.Tensor | None, scale: torch.Tensor, rows: int, cols: int,
               fmt: GroupedFormat) -> torch.Tensor:
    """Packed planes of `rows` rows (uint8 tensors, scales as float16 bits) -> float32 [rows, cols]."""
    k_pad = -(-cols // 128) * 128
    codes = unpack_codes(base, high, rows, k_pad, fmt)
    s = scale.reshape(rows, -1, 1).to(torch.float32)
    return (codes.view(rows, -1, fmt.group_size).to(torch.float32) * s).view(rows, k_pad)[:, :cols]


def load_tensor(art: Artifact, name: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """Decode one artifact tensor to `dtype` on `device` (w = f32(scale) * f32(code), then cast)."""
    e = art.entry(name)
    fmt = get_format(e.format)
    if isinstance(fmt, GroupedFormat):
        base, high, scale, geo = art.planes(name)
        w = dense_rows(_u8(base, device), _u8(high, device) if high is not None else None,
                       _u8(scale, device).view(torch.float16), geo.rows, geo.cols, fmt)
        return w.to(dtype).contiguous()
    if isinstance(fmt, FloatCodeFormat):
        from .kernels.float_gemv import dense_reference, float_codes

        return dense_reference(float_codes(e.format, _u8(art.raw(name), device), e.shape[0], e.shape[1])).to(dtype)
    words = torch.from_numpy(art.read_direct(name).copy())
    if e.format == "BF16":
        return words.view(torch.bfloat16).to(device=device, dtype=dtype)
    if e.format == "FP32":
        return words.to(device=device, dtype=dtype)
    return words.to(device)  # I32 stays integer
