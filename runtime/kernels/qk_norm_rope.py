"""Attention inputs in one launch: the query and key heads of the fused projection row, each
RMS-normed (zero-centred weight, rounded to the activation dtype as a separate norm would store it),
then rotated on their first R dims (partial RoPE, two halves). It replaced, per attention layer and
step, two copies out of the projection row, two norms, two RoPE launches and a position cast."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import torch_path
from .launch import LAUNCH, pdl_wait


@functools.lru_cache(maxsize=16)
def inverse_frequencies(rotary_dim: int, theta: float, device: str) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)).to(device)


@triton.jit
def _qk_norm_rope_kernel(qgkv_ptr, q_w_ptr, k_w_ptr, pos_ptr, inv_freq_ptr, q_ptr, k_ptr, stride_row, HQ, HKV,
                         k_offset, eps, D: tl.constexpr, ROT: tl.constexpr, HALF_P: tl.constexpr):
    pdl_wait()
    t = tl.program_id(0)
    j = tl.program_id(1)  # heads 0..HQ-1 are queries, then HKV keys
    is_q = j < HQ
    # a query head sits in the row as [query (D) | gate (D)]; key heads follow the query-gate block
    src = qgkv_ptr + t * stride_row + tl.where(is_q, j * (2 * D), k_offset + (j - HQ) * D)
    d = tl.arange(0, D)
    x = tl.load(src + d).to(tl.float32)
    w = tl.where(is_q, tl.load(q_w_ptr + d), tl.load(k_w_ptr + d)).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = (x * inv_rms * (1.0 + w)).to(q_ptr.dtype.element_ty)
    q_dst = q_ptr + (t * HQ + j) * D
    k_dst = k_ptr + (t * HKV + j - HQ) * D
    tail = d >= ROT  # unrotated dims
    q_lanes = tl.full((D,), j, tl.int32) < HQ  # block-shaped: triton 3.9's interpreter rejects scalar masks
    tl.store(q_dst + d, y, mask=tail & q_lanes)
    tl.store(k_dst + d, y, mask=tail & ~q_lanes)
    half: tl.constexpr = ROT // 2
    i = tl.arange(0, HALF_P)
    ok = i < half
    q_half = tl.full((HALF_P,), j, tl.int32) < HQ
    # the two rotated halves again from the row (cached), normed and rounded as above
    a = tl.load(src + i, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(src + half + i, mask=ok, other=0.0).to(tl.float32)
    wa = tl.where(is_q, tl.load(q_w_ptr + i, mask=ok, other=0.0), tl.load(k_w_ptr + i, mask=ok, other=0.0))
    wb = tl.where(is_q, tl.load(q_w_ptr + half + i, mask=ok, other=0.0), tl.load(k_w_ptr + half + i, mask=ok, other=0.0))
    a = (a * inv_rms * (1.0 + wa.to(tl.float32))).to(q_ptr.dtype.element_ty).to(tl.float32)
    b = (b * inv_rms * (1.0 + wb.to(tl.float32))).to(q_ptr.dtype.element_ty).to(tl.float32)
    ang = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + i, mask=ok, other=0.0)
    c, s = tl.cos(ang), tl.sin(ang)
    ra = (a * c - b * s).to(q_ptr.dtype.element_ty)
    rb = (b * c + a * s).to(q_ptr.dtype.element_ty)
    tl.store(q_dst + i, ra, mask=ok & q_half)
    tl.store(q_dst + half + i, rb, mask=ok & q_half)
    tl.store(k_dst + i, ra, mask=ok & ~q_half)
    tl.store(k_dst + half + i, rb, mask=ok & ~q_half)


def qk_norm_rope(qgkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float, positions: torch.Tensor, rotary_dim: int,
                 theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """qgkv [n, heads * 2D + 2 * kv_heads * D] (query-gate block, keys, values; unit stride inside a
    row); positions int [n]. Returns (q [n, heads, D], k [n, kv_heads, D]) normed and rotated."""
    n = qgkv.shape[0]
    if qgkv.stride(-1) != 1 or head_dim & (head_dim - 1) or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"qk_norm_rope: head size {head_dim} / rotary {rotary_dim} / layout not supported")
    if torch_path(qgkv):
        return qk_norm_rope_reference(qgkv, heads, kv_heads, head_dim, q_weight, k_weight, eps, positions, rotary_dim,
                                      theta)
    q = torch.empty(n, heads, head_dim, dtype=qgkv.dtype, device=qgkv.device)
    k = torch.empty(n, kv_heads, head_dim, dtype=qgkv.dtype, device=qgkv.device)
    if n:
        inv = inverse_frequencies(rotary_dim, theta, str(qgkv.device))
        _qk_norm_rope_kernel[(n, heads + kv_heads)](
            qgkv, q_weight, k_weight, positions, inv, q, k, qgkv.stride(0), heads, kv_heads, heads * 2 * head_dim, eps,
            D=head_dim, ROT=rotary_dim, HALF_P=triton.next_power_of_2(max(1, rotary_dim // 2)), **LAUNCH)
    return q, k


def qk_norm_rope_reference(qgkv, heads, kv_heads, head_dim, q_weight, k_weight, eps, positions, rotary_dim, theta):
    from runtime.reference_ops import apply_partial_rope, rope_cos_sin

    from .rmsnorm import rmsnorm_reference

    def rope_reference(x, positions, rotary_dim, theta):
        cos, sin = rope_cos_sin(positions, rotary_dim, theta, torch.float32)
        return apply_partial_rope(x.float(), cos, sin).to(x.dtype)

    n = qgkv.shape[0]
    q = qgkv[:, : heads * 2 * head_dim].reshape(n, heads, 2 * head_dim)[..., :head_dim]
    k = qgkv[:, heads * 2 * head_dim : heads * 2 * head_dim + kv_heads * head_dim].reshape(n, kv_heads, head_dim)
    q = rmsnorm_reference(q.reshape(-1, head_dim), q_weight, eps)[0].view(n, heads, head_dim)
    k = rmsnorm_reference(k.reshape(-1, head_dim), k_weight, eps)[0].view(n, kv_heads, head_dim)
    return rope_reference(q, positions, rotary_dim, theta), rope_reference(k, positions, rotary_dim, theta)
