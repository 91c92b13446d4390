"""Partial rotary embedding in place: the first R dims of each head rotate as two halves."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from .launch import LAUNCH, pdl_release, pdl_wait


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, inv_freq_ptr, stride_t, stride_h, ROT: tl.constexpr):
    pdl_release()  # PDL: see runtime/kernels/launch.py
    pdl_wait()
    t = tl.program_id(0)
    h = tl.program_id(1)
    half: tl.constexpr = ROT // 2
    i = tl.arange(0, half)
    pos = tl.load(pos_ptr + t).to(tl.float32)
    ang = pos * tl.load(inv_freq_ptr + i)  # same f32 product as the reference
    c, s = tl.cos(ang), tl.sin(ang)
    base = x_ptr + t * stride_t + h * stride_h
    a = tl.load(base + i).to(tl.float32)
    b = tl.load(base + half + i).to(tl.float32)
    tl.store(base + i, (a * c - b * s).to(x_ptr.dtype.element_ty))
    tl.store(base + half + i, (b * c + a * s).to(x_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=16)
def inverse_frequencies(rotary_dim: int, theta: float, device: str) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)).to(device)


def apply_rope_(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """x [T, heads, D] rotated in place at int positions [T]."""
    t, heads, _ = x.shape
    inv = inverse_frequencies(rotary_dim, theta, str(x.device))
    _rope_kernel[(t, heads)](x, positions, inv, x.stride(0), x.stride(1), ROT=rotary_dim, **LAUNCH)
    return x


def rope_reference(x, positions, rotary_dim, theta):
    from runtime.reference_ops import apply_partial_rope, rope_cos_sin

    cos, sin = rope_cos_sin(positions, rotary_dim, theta, torch.float32)
    return apply_partial_rope(x.float(), cos, sin).to(x.dtype)
