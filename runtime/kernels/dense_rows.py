"""A bf16 matrix times a block of 1-16 rows of x (several lanes, a verify block): the MoE router with the
shared-expert gate (257 x 2,048 for the 35B-A3B, a strided view of the plan's two matrices) is the product that
takes it. The vendor GEMM picks a split-K tensor-core kernel plus a reduction launch for such a block (output
width 257: one-element alignment), ~8 µs a layer for 1 MB of weights on an H100 (session 29 profile, 8 lanes);
here each program owns 16 weight rows over the whole K, one launch, the rows of x as one 16-column tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import torch_path
from .launch import LAUNCH, pdl_wait

MAX_ROWS = 16
TUNING = {"block_n": 16, "block_k": 256, "num_warps": 4, "num_stages": 4}
# 1-4 rows of x: no tensor-core tile (16 columns of which 1-4 are used) but a program per 2 weight rows over the
# whole K (129 programs for the 35B-A3B's 257 rows: every SM streams its share), the first K tile of its weights
# loaded before pdl_wait so it arrives while the kernel before drains (cuBLAS's GEMV, which one lane takes by
# default, takes no part in PDL). Session 47, unmeasured: NINFER_DENSE_ROWS=all / on selects it for those rows;
# ROW_KERNEL_MAX_ROWS = 0 keeps the tile kernel for them (side-by-side runs; read at call time).
ROW_KERNEL_MAX_ROWS = 4
ROW_TUNING = {"block_n": 2, "block_k": 1024, "num_warps": 4}


@triton.jit
def _preload_weights(w_rows, k, ok, K):
    """A [BLOCK_N, BLOCK_K] tile of weight rows at columns k (fixed during inference: may be read before
    pdl_wait)."""
    return tl.load(w_rows + k[None, :], mask=ok[:, None] & (k < K)[None, :], other=0.0)


@triton.jit
def _dense_few_rows_kernel(x_ptr, w_ptr, y_ptr, T, N, K, stride_x, stride_w, stride_y,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr):
    """y[t, rows] = sum_k W[rows, k] * x[t, k] in float32 for this program's BLOCK_N rows and every t < T <= BLOCK_T,
    by products and sums on the CUDA cores; each K tile's weights are loaded a tile ahead, the first before the
    wait."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows[:, None] * stride_w
    w = _preload_weights(w_rows, k, ok, K)
    pdl_wait()
    toks = tl.arange(0, BLOCK_T)
    tok_ok = toks < T
    acc = tl.zeros((BLOCK_N, BLOCK_T), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        xt = tl.load(x_ptr + toks[:, None] * stride_x + kk[None, :], mask=tok_ok[:, None] & (kk < K)[None, :],
                     other=0.0).to(tl.float32)
        w_next = _preload_weights(w_rows, kk + BLOCK_K, ok, K)
        acc += tl.sum(w.to(tl.float32)[:, None, :] * xt[None, :, :], axis=2)
        w = w_next
    tl.store(y_ptr + toks[None, :] * stride_y + rows[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=ok[:, None] & tok_ok[None, :])


@triton.jit
def _dense_rows_kernel(x_ptr, w_ptr, y_ptr, T, N, K, stride_x, stride_w, stride_y,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr):
    """y[t, rows] = sum_k W[rows, k] * x[t, k] in float32 for this program's BLOCK_N rows and every t < T."""
    pdl_wait()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = tl.arange(0, BLOCK_T)
    ok, tok_ok = rows < N, toks < T
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_T), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        kok = kk < K
        w = tl.load(w_ptr + rows[:, None] * stride_w + kk[None, :], mask=ok[:, None] & kok[None, :], other=0.0)
        xt = tl.load(x_ptr + toks[None, :] * stride_x + kk[:, None], mask=kok[:, None] & tok_ok[None, :], other=0.0)
        acc = tl.dot(w, xt.to(w.dtype), acc)
    tl.store(y_ptr + toks[None, :] * stride_y + rows[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=ok[:, None] & tok_ok[None, :])


def dense_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [T, K] @ w[N, K]^T -> [T, N] in x's dtype for T <= MAX_ROWS (w may have any row stride, unit column
    stride); float32 sums."""
    t, k = x.shape
    if t > MAX_ROWS or w.shape[1] != k:
        raise ValueError(f"dense_rows: x is {t} x {k}, the weight {tuple(w.shape)} (at most {MAX_ROWS} rows of x)")
    if torch_path(x):
        return dense_rows_reference(x, w)
    if w.stride(1) != 1:
        raise ValueError("dense_rows: the weight's columns must be contiguous")
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(t, w.shape[0], dtype=x.dtype, device=x.device)
    if t <= ROW_KERNEL_MAX_ROWS:
        _dense_few_rows_kernel[(triton.cdiv(w.shape[0], ROW_TUNING["block_n"]),)](
            x, w, y, t, w.shape[0], k, x.stride(0), w.stride(0), y.stride(0), BLOCK_N=ROW_TUNING["block_n"],
            BLOCK_K=ROW_TUNING["block_k"], BLOCK_T=triton.next_power_of_2(t), num_warps=ROW_TUNING["num_warps"],
            **LAUNCH)
        return y
    _dense_rows_kernel[(triton.cdiv(w.shape[0], TUNING["block_n"]),)](
        x, w, y, t, w.shape[0], k, x.stride(0), w.stride(0), y.stride(0), BLOCK_N=TUNING["block_n"],
        BLOCK_K=TUNING["block_k"], BLOCK_T=MAX_ROWS, num_warps=TUNING["num_warps"], num_stages=TUNING["num_stages"],
        **LAUNCH)
    return y


def dense_rows_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.float() @ w.float().t()).to(x.dtype)
