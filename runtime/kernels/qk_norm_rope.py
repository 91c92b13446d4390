"""Attention inputs in one launch: the query and key heads of the fused projection row, each
RMS-normed (zero-centred weight, rounded to the activation dtype as a separate norm would store it),
then rotated on their first R dims (partial RoPE, two halves). It replaced, per attention layer and
step, two copies out of the projection row, two norms, two RoPE launches and a position cast.

`attention_inputs` also appends the new keys and values to the KV cache (kv_append's encoders) and, for
codecs that store keys rotated, hands back the queries H64-rotated (the rotations in float32 as rotate64
computes them): per attention layer and step five launches fewer with a rotating codec (two rotations and two
appends of K and V, the query's rotation), two with bf16 or int8 KV."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from runtime.kv.hadamard import hadamard_on_device

from . import torch_path
from .hadamard import rotate64, rotate_group64
from .kv_append import KIND_IDS, append_keys_values, append_vector
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
    _norm_rope_head(qgkv_ptr, q_w_ptr, k_w_ptr, pos_ptr, inv_freq_ptr, q_ptr, k_ptr, stride_row, HQ, HKV, k_offset,
                    eps, t, j, D, ROT, HALF_P)


@triton.jit
def _rotated_groups(src, dst, h_ptr, D: tl.constexpr):
    """dst = src with H64 applied to each 64-element group, in float32 (rotate64's arithmetic)."""
    i = tl.arange(0, 64)
    for grp in tl.static_range(D // 64):
        x = tl.load(src + grp * 64 + i).to(tl.float32)
        tl.store(dst + grp * 64 + i, rotate_group64(x, h_ptr).to(dst.dtype.element_ty))


@triton.jit
def _attention_inputs_kernel(qgkv_ptr, q_w_ptr, k_w_ptr, pos_ptr, inv_freq_ptr, q_ptr, k_ptr, qr_ptr, scratch_ptr,
                             h_ptr, page_ptr, slot_ptr, kp0, kp1, vp0, vp1, stride_row, HQ, HKV, k_offset, eps,
                             D: tl.constexpr, ROT: tl.constexpr, HALF_P: tl.constexpr, ROTATE_K: tl.constexpr,
                             ROTATE_V: tl.constexpr, K_KIND: tl.constexpr, V_KIND: tl.constexpr,
                             KW0: tl.constexpr, KW1: tl.constexpr, VW0: tl.constexpr, VW1: tl.constexpr):
    """Heads 0..HQ-1: queries (normed, RoPE, then H64-rotated into qr with ROTATE_K); HQ..HQ+HKV-1: keys (normed,
    RoPE, rotated in float32 into the scratch with ROTATE_K, encoded into the cache); then HKV values (rotated
    with ROTATE_V, encoded). A program re-reads what it stored only after a barrier."""
    pdl_wait()
    t = tl.program_id(0)
    j = tl.program_id(1)
    if j < HQ + HKV:
        _norm_rope_head(qgkv_ptr, q_w_ptr, k_w_ptr, pos_ptr, inv_freq_ptr, q_ptr, k_ptr, stride_row, HQ, HKV,
                        k_offset, eps, t, j, D, ROT, HALF_P)
        tl.debug_barrier()
    page = tl.load(page_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if j < HQ:
        if ROTATE_K:  # keys are stored rotated: the queries meet them rotated
            _rotated_groups(q_ptr + (t * HQ + j) * D, qr_ptr + (t * HQ + j) * D, h_ptr, D)
    elif j < HQ + HKV:
        head = j - HQ
        src = k_ptr + (t * HKV + head) * D
        row = (page * 64 + slot) * HKV + head
        if ROTATE_K:
            scratch = scratch_ptr + (t * 2 * HKV + head) * D
            _rotated_groups(src, scratch, h_ptr, D)
            tl.debug_barrier()
            append_vector(scratch, row, kp0, kp1, D, K_KIND, KW0, KW1)
        else:
            append_vector(src, row, kp0, kp1, D, K_KIND, KW0, KW1)
    else:
        head = j - HQ - HKV
        src = qgkv_ptr + t * stride_row + k_offset + (HKV + head) * D  # values follow the keys in the row
        row = (page * 64 + slot) * HKV + head
        if ROTATE_V:
            scratch = scratch_ptr + (t * 2 * HKV + HKV + head) * D
            _rotated_groups(src, scratch, h_ptr, D)
            tl.debug_barrier()
            append_vector(scratch, row, vp0, vp1, D, V_KIND, VW0, VW1)
        else:
            append_vector(src, row, vp0, vp1, D, V_KIND, VW0, VW1)


@triton.jit
def _norm_rope_head(qgkv_ptr, q_w_ptr, k_w_ptr, pos_ptr, inv_freq_ptr, q_ptr, k_ptr, stride_row, HQ, HKV, k_offset,
                    eps, t, j, D: tl.constexpr, ROT: tl.constexpr, HALF_P: tl.constexpr):
    """Head j of token t (queries first, then keys): normed and rotated, stored to q or k."""
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


def attention_inputs(qgkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, q_weight: torch.Tensor,
                     k_weight: torch.Tensor, eps: float, positions: torch.Tensor, rotary_dim: int, theta: float,
                     codec, k_planes: list[torch.Tensor], v_planes: list[torch.Tensor], page: torch.Tensor,
                     slot: torch.Tensor) -> torch.Tensor:
    """qk_norm_rope, then the new keys and values (values: the row's last kv_heads x D) encoded into their
    planes at (page, slot) as `codec` says (its sub-codecs kv_append encodes); returns the queries [n, heads, D]
    as attention takes them (H64-rotated when the codec stores keys rotated)."""
    n = qgkv.shape[0]
    if torch_path(qgkv):  # the separate ops
        q, k = qk_norm_rope(qgkv, heads, kv_heads, head_dim, q_weight, k_weight, eps, positions, rotary_dim, theta)
        start = heads * 2 * head_dim + kv_heads * head_dim
        v = qgkv[:, start : start + kv_heads * head_dim].reshape(n, kv_heads, head_dim)
        append_keys_values(k, v, codec, k_planes, v_planes, page, slot)
        return rotate64(q) if codec.rotate_keys else q
    if qgkv.stride(-1) != 1 or head_dim & (head_dim - 1) or rotary_dim % 2 or rotary_dim > head_dim or head_dim % 64:
        raise ValueError(f"attention_inputs: head size {head_dim} / rotary {rotary_dim} / layout not supported")
    q = torch.empty(n, heads, head_dim, dtype=qgkv.dtype, device=qgkv.device)
    k = torch.empty(n, kv_heads, head_dim, dtype=qgkv.dtype, device=qgkv.device)
    rotating = codec.rotate_keys or codec.rotate_values
    qr = torch.empty_like(q) if codec.rotate_keys else q
    scratch = torch.empty(n, 2 * kv_heads, head_dim, dtype=torch.float32, device=qgkv.device) if rotating else k
    if n:
        inv = inverse_frequencies(rotary_dim, theta, str(qgkv.device))
        h = hadamard_on_device(64, str(qgkv.device)) if rotating else inv
        kp0, kp1, vp0, vp1 = k_planes[0], k_planes[-1], v_planes[0], v_planes[-1]
        _attention_inputs_kernel[(n, heads + 2 * kv_heads)](
            qgkv, q_weight, k_weight, positions, inv, q, k, qr, scratch, h, page, slot, kp0, kp1, vp0, vp1,
            qgkv.stride(0), heads, kv_heads, heads * 2 * head_dim, eps, D=head_dim, ROT=rotary_dim,
            HALF_P=triton.next_power_of_2(max(1, rotary_dim // 2)), ROTATE_K=codec.rotate_keys,
            ROTATE_V=codec.rotate_values, K_KIND=KIND_IDS[codec.key], V_KIND=KIND_IDS[codec.value],
            KW0=kp0.shape[-1], KW1=kp1.shape[-1], VW0=vp0.shape[-1], VW1=vp1.shape[-1], **LAUNCH)
    return qr


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
