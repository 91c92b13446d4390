"""Two small bf16 projections of the same rows in one launch: y1 = x @ W1^T, y2 = x @ W2^T, for the GDN
alpha and beta heads (N = value heads, a few dozen rows each). cuBLAS spends two split-K GEMMs plus
two reductions on these per layer; here each program streams [BLOCK_N, K] slices of both matrices."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from .launch import LAUNCH, pdl_release, pdl_wait

PAIR_MAX_ROWS = 16  # decode and verify blocks; prefill keeps cuBLAS


@triton.jit
def _dense_pair_kernel(x_ptr, w1_ptr, w2_ptr, y1_ptr, y2_ptr, N, K, stride_x,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One program: rows [BLOCK_N] of both matrices for one row of x (x is loaded once for both)."""
    pdl_release()  # PDL: see runtime/kernels/launch.py
    pdl_wait()
    t = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    acc1 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        m = row_ok[:, None] & k_ok[None, :]
        x = tl.load(x_ptr + t * stride_x + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        acc1 += tl.load(w1_ptr + rows[:, None] * K + ks[None, :], mask=m, other=0.0).to(tl.float32) * x
        acc2 += tl.load(w2_ptr + rows[:, None] * K + ks[None, :], mask=m, other=0.0).to(tl.float32) * x
    tl.store(y1_ptr + t * N + rows, tl.sum(acc1, axis=1).to(y1_ptr.dtype.element_ty), mask=row_ok)
    tl.store(y2_ptr + t * N + rows, tl.sum(acc2, axis=1).to(y2_ptr.dtype.element_ty), mask=row_ok)


def dense_pair(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K]; w1, w2 [N, K] contiguous, same shape -> (x @ w1.T, x @ w2.T), each [T, N] in x's dtype."""
    t, k = x.shape
    n = w1.shape[0]
    if w2.shape != w1.shape or w1.shape[1] != k:
        raise ValueError(f"dense_pair: shapes {tuple(w1.shape)}, {tuple(w2.shape)} do not match x [{t}, {k}]")
    if x.stride(-1) != 1:
        x = x.contiguous()
    y1 = torch.empty(t, n, dtype=x.dtype, device=x.device)
    y2 = torch.empty_like(y1)
    # one row per program: the matrices are a few dozen rows, so rows (not K) must fill the SMs
    block_n = 1
    _dense_pair_kernel[(t, triton.cdiv(n, block_n))](x, w1, w2, y1, y2, n, k, x.stride(0), BLOCK_N=block_n,
                                                      BLOCK_K=1024, num_warps=4, **LAUNCH)
    return y1, y2


def dense_pair_reference(x, w1, w2):
    return (x.float() @ w1.float().t()).to(x.dtype), (x.float() @ w2.float().t()).to(x.dtype)
