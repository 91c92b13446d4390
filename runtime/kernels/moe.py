"""MoE routing (softmax over all experts, top-k, renormalized) and the expert GEMV over
(token, expert) pairs, for decode and verify blocks. Both stay on the device, so a MoE decode
step can be captured in a CUDA graph. Prefill uses per-expert dense GEMMs instead."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .qgemv_int8 import INT8_BITS, _dot_rows_int8, _weight_tile, code_words, high_plane, native_dp4a
from .qlinear import GEMV_PATH, INT8_TUNING, VEC_TUNING, PackedLinear, _dot_rows
from .launch import LAUNCH, pdl_wait


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, weights_ptr, E, TOPK: tl.constexpr, BLOCK_E: tl.constexpr):
    pdl_wait()
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    logit = tl.load(logits_ptr + t * E + e, mask=ok, other=float("-inf")).to(tl.float32)
    p = tl.exp(logit - tl.max(logit, axis=0))
    p = tl.where(ok, p / tl.sum(p, axis=0), -1.0)
    k = tl.arange(0, TOPK)
    picked_ids = tl.zeros((TOPK,), dtype=tl.int32)
    picked = tl.zeros((TOPK,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)  # lowest index among ties, like torch.topk
        picked_ids = tl.where(k == j, idx, picked_ids)
        picked = tl.where(k == j, best, picked)
        p = tl.where(e == idx, -1.0, p)
    tl.store(ids_ptr + t * TOPK + k, picked_ids)
    tl.store(weights_ptr + t * TOPK + k, picked / tl.sum(picked, axis=0))


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (expert ids [T, k] int32, weights [T, k] float32 summing to 1)."""
    t, e = router_logits.shape
    ids = torch.empty(t, top_k, dtype=torch.int32, device=router_logits.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
    _route_kernel[(t,)](router_logits.contiguous(), ids, weights, e, TOPK=top_k, BLOCK_E=triton.next_power_of_2(e), **LAUNCH)
    return ids, weights


def route_reference(router_logits, top_k):
    probs = torch.softmax(router_logits.float(), dim=-1)
    w, idx = torch.topk(probs, top_k, dim=-1)
    return idx.int(), w / w.sum(-1, keepdim=True)


@triton.jit
def _expert_gemv_kernel(x_ptr, x_rows_ptr, experts_ptr, base_ptr, high_ptr, scale_ptr, y_ptr, ROWS_PER_EXPERT, K,
                        stride_x, GPR: tl.constexpr, K_PAD: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                        HIGH_BYTES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        INT8: tl.constexpr, USE_ASM: tl.constexpr):
    pdl_wait()
    pair = tl.program_id(0)
    local = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = local < ROWS_PER_EXPERT
    expert = tl.load(experts_ptr + pair)
    x_row = tl.load(x_rows_ptr + pair)
    rows = expert * ROWS_PER_EXPERT + local
    if INT8:
        # expert matrices are small: each program quantizes its row of x (no extra launch)
        words, high, w_scale = _weight_tile(base_ptr, high_ptr, scale_ptr, rows, ok[:, None], 0, GPR, K_PAD, BITS,
                                            GROUP, HIGH_BYTES, BLOCK_K)
        y = _dot_rows_int8(x_ptr + x_row * stride_x, base_ptr, high_ptr, scale_ptr, rows, ok, K, 0, K_PAD, words, high,
                           w_scale, GPR, K_PAD, BITS, GROUP, HIGH_BYTES, BLOCK_N, BLOCK_K, USE_ASM, False)
    else:
        y = _dot_rows(x_ptr + x_row * stride_x, base_ptr, high_ptr, scale_ptr, rows, ok, K, 0, K_PAD,
                      GPR, K_PAD, BITS, GROUP, HIGH_BYTES, BLOCK_N, BLOCK_K)
    tl.store(y_ptr + pair * ROWS_PER_EXPERT + local, y.to(y_ptr.dtype.element_ty), mask=ok)


def expert_gemv(x: torch.Tensor, x_rows: torch.Tensor, experts: torch.Tensor, w: PackedLinear,
                rows_per_expert: int) -> torch.Tensor:
    """For each pair p: y[p] = W[experts[p]] @ x[x_rows[p]], with W stacked expert-major
    ([E * rows_per_expert, K] packed). Returns [pairs, rows_per_expert] in x's dtype. Rows of x are
    quantized per group as in the dp4a GEMV (see qgemv_int8) unless NINFER_GEMV=float."""
    pairs = experts.numel()
    y = torch.empty(pairs, rows_per_expert, dtype=x.dtype, device=x.device)
    int8 = GEMV_PATH == "int8" and w.fmt.bits in INT8_BITS
    tuning = INT8_TUNING if int8 else VEC_TUNING
    block_n, block_k = tuning["block_n"], tuning["block_k"]
    while w.k_pad % block_k:
        block_k //= 2
    x = x.contiguous()
    if int8:
        base, high = code_words(w.base), high_plane(w)
    else:
        base, high = w.base, (w.high if w.high is not None else w.base)
    _expert_gemv_kernel[(pairs, triton.cdiv(rows_per_expert, block_n))](
        x, x_rows.contiguous(), experts.contiguous(), base, high, w.scale, y, rows_per_expert, w.cols,
        x.stride(0), GPR=w.groups_per_row, K_PAD=w.k_pad, BITS=w.fmt.bits, GROUP=w.fmt.group_size,
        HIGH_BYTES=w.fmt.high_bytes_per_group, BLOCK_N=block_n, BLOCK_K=block_k, INT8=int8, USE_ASM=native_dp4a(),
        num_warps=tuning["num_warps"], **LAUNCH)
    return y


def expert_gemv_reference(x, x_rows, experts, w: PackedLinear, rows_per_expert):
    from .qgemv_int8 import qgemv_int8_reference
    from .qlinear import qlinear_reference

    if GEMV_PATH == "int8" and w.fmt.bits in INT8_BITS:  # the same 14-bit activations, row by row
        dense_out = qgemv_int8_reference(x, w).float()
    else:
        dense_out = qlinear_reference(x, w).float()  # [T, E * rows]
    out = [dense_out[int(r), int(e) * rows_per_expert:(int(e) + 1) * rows_per_expert] for r, e in zip(x_rows, experts)]
    return torch.stack(out).to(x.dtype)
