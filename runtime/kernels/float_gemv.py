"""Products with floating-point weight codes (NVFP4, FP8 E4M3FN rows; format/float_codes.py), dequantized
in-kernel: no FP4/FP8 tensor cores needed, so they run on any GPU Triton targets.

Few rows (decode, verify blocks): `float_gemv` decodes each weight tile once into bf16 (exact: E2M1 times
an E4M3FN scale has at most 6 significant bits) and multiplies it with every row of x on the tensor cores,
float32 sums; the row's divisor (NVFP4) or BF16 multiplier (FP8) applies at the end. Many rows (prefill):
`float_linear` decodes row blocks to the activation dtype for the vendor GEMM."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import torch_path
from .launch import LAUNCH, pdl_wait

GEMV_MAX_ROWS = 16


@triton.jit
def _pow2(e):
    """2^e for int32 e in the normal range, exactly (built from the exponent bits, not ex2.approx)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(c):
    """E2M1 nibble (int32) -> float32: bit 3 sign, exponent 2 bits (bias 1), mantissa 1 bit."""
    mag = c & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    val = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * _pow2(e - 1))
    return tl.where((c & 8) != 0, -val, val)


@triton.jit
def _e4m3fn(b):
    """E4M3FN byte (int32) -> float32 (the NaN code decodes as 480: the reader refuses it before)."""
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    val = tl.where(e == 0, m * 0.001953125, (8.0 + m) * _pow2(e - 10))
    return tl.where((b & 128) != 0, -val, val)


@triton.jit
def _float_gemv_kernel(x_ptr, code_ptr, scale_ptr, div_ptr, y_ptr, T, N, K, stride_x, stride_y,
                       NVFP4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                       DOT_BF16: tl.constexpr):
    """y[t, rows] for a block of weight rows and up to BLOCK_T rows of x: every weight tile is decoded once
    (NVFP4: E2M1 times its group's E4M3FN scale, exact in bf16; FP8: E4M3FN, exact in bf16) and multiplied
    with all rows of x at once; the row's divisor / multiplier applies to the float32 sums."""
    pdl_wait()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = rows < N
    tok_ok = toks < T
    dot_type = tl.bfloat16 if DOT_BF16 else tl.float32
    acc = tl.zeros((BLOCK_N, BLOCK_T), tl.float32)
    if NVFP4:
        HALF: tl.constexpr = BLOCK_K // 2
        GROUPS: tl.constexpr = BLOCK_K // 16
        j = tl.arange(0, HALF)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 // 2 + j
            kok = kk < K // 2
            c = tl.load(code_ptr + rows[:, None] * (K // 2) + kk[None, :], mask=ok[:, None] & kok[None, :],
                        other=0).to(tl.int32)
            g = k0 // 16 + tl.arange(0, GROUPS)
            s = _e4m3fn(tl.load(scale_ptr + rows[:, None] * (K // 16) + g[None, :],
                                mask=ok[:, None] & (g[None, :] < K // 16), other=0).to(tl.int32))
            s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, GROUPS, 8)), (BLOCK_N, HALF))
            we = (_e2m1(c & 15) * s).to(dot_type)
            wo = (_e2m1(c >> 4) * s).to(dot_type)
            xm = kok[:, None] & tok_ok[None, :]
            xe = tl.load(x_ptr + toks[None, :] * stride_x + 2 * kk[:, None], mask=xm, other=0.0).to(dot_type)
            xo = tl.load(x_ptr + toks[None, :] * stride_x + 2 * kk[:, None] + 1, mask=xm, other=0.0).to(dot_type)
            acc = tl.dot(we, xe, acc, input_precision="ieee")
            acc = tl.dot(wo, xo, acc, input_precision="ieee")
        acc = acc / tl.load(div_ptr + rows, mask=ok, other=1.0)[:, None]
    else:
        k = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + k
            kok = kk < K
            c = tl.load(code_ptr + rows[:, None] * K + kk[None, :], mask=ok[:, None] & kok[None, :], other=0).to(tl.int32)
            xv = tl.load(x_ptr + toks[None, :] * stride_x + kk[:, None], mask=kok[:, None] & tok_ok[None, :],
                         other=0.0).to(dot_type)
            acc = tl.dot(_e4m3fn(c).to(dot_type), xv, acc, input_precision="ieee")
        acc = acc * tl.load(scale_ptr + rows, mask=ok, other=0).to(tl.float32)[:, None]
    out = y_ptr + toks[None, :] * stride_y + rows[:, None]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=ok[:, None] & tok_ok[None, :])


class FloatCodes:
    """A resident NVFP4 (`nvfp4-rows-v1`) or FP8 row-scale (`row-scale-v1`) matrix [rows, cols]: its code
    plane, scale plane and (NVFP4) per-row divisors as device tensor views."""

    def __init__(self, fmt: str, codes: torch.Tensor, scales: torch.Tensor, divisors: torch.Tensor | None,
                 rows: int, cols: int):
        self.fmt, self.rows, self.cols = fmt, rows, cols
        self.nvfp4 = fmt == "NVFP4"
        self.codes = codes.view(torch.uint8)
        self.scales = scales.view(torch.uint8) if self.nvfp4 else scales.view(torch.bfloat16)
        self.divisors = divisors.view(torch.float32) if divisors is not None else None

    def take(self, rows) -> "FloatCodes":
        """Rows `rows` as a matrix of their own: a slice gives views, a long tensor a compact copy."""
        codes = self.codes.view(self.rows, -1)[rows]
        scales = self.scales.view(self.rows, -1)[rows] if self.nvfp4 else self.scales[rows]
        divisors = self.divisors[rows] if self.nvfp4 else None
        return FloatCodes(self.fmt, codes.reshape(-1), scales.reshape(-1), divisors, codes.shape[0], self.cols)

    def rows_view(self, begin: int, end: int) -> "FloatCodes":
        return self.take(slice(begin, end))

    def dense(self, begin: int = 0, end: int | None = None, dtype=torch.float32) -> torch.Tensor:
        """Rows [begin, end) decoded (the torch reference of every product here)."""
        return dense_reference(self.rows_view(begin, self.rows if end is None else end)).to(dtype)


def float_codes(fmt: str, raw: torch.Tensor, rows: int, cols: int) -> FloatCodes:
    """FloatCodes viewing a whole object's bytes (a uint8 tensor) in its layout."""
    from format.float_codes import geometry

    geo = geometry(fmt, rows, cols)
    if fmt == "NVFP4":
        codes, scales, divisors = geo.split(raw)
        return FloatCodes(fmt, codes, scales, divisors, rows, cols)
    codes, scales = geo.split(raw)
    return FloatCodes(fmt, codes, scales, None, rows, cols)


def _e2m1_torch(c: torch.Tensor) -> torch.Tensor:
    """E2M1 nibbles -> float32 with device ops only (no host table: safe inside CUDA-graph capture)."""
    mag = c & 7
    e = (mag >> 1).float()
    m = (mag & 1).float()
    val = torch.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * torch.exp2(e - 1))
    return torch.where((c & 8) != 0, -val, val)


def dense_reference(w: FloatCodes) -> torch.Tensor:
    """float32 [rows, cols] with torch ops (bit-exact with format.float_codes)."""
    if w.nvfp4:
        c = w.codes.view(w.rows, w.cols // 2).to(torch.int32)
        vals = torch.stack([_e2m1_torch(c & 15), _e2m1_torch(c >> 4)], dim=-1).view(w.rows, w.cols // 16, 16)
        s = w.scales.view(w.rows, w.cols // 16).view(torch.float8_e4m3fn).float()
        return (vals * s[:, :, None]).view(w.rows, w.cols) / w.divisors.view(w.rows, 1)
    v = w.codes.view(w.rows, w.cols).view(torch.float8_e4m3fn).float()
    return v * w.scales.float().view(w.rows, 1)


def float_gemv(x: torch.Tensor, w: FloatCodes, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] -> x @ W^T [T, N] in x's dtype, T <= GEMV_MAX_ROWS (more rows: float_linear)."""
    t, k = x.shape
    if k != w.cols:
        raise ValueError(f"float_gemv: x has {k} columns, the weight {w.cols}")
    if torch_path(x):
        y = (x.float() @ dense_reference(w).t()).to(x.dtype)
        return out.copy_(y) if out is not None else y
    y = out if out is not None else torch.empty(t, w.rows, dtype=x.dtype, device=x.device)
    return launch_float_gemv(x, w, y, TUNING["block_n"], TUNING["block_k"], TUNING["num_warps"])


TUNING = {"block_n": 64, "block_k": 128, "num_warps": 4}  # bench/gemv_compare.py float_codes sweeps these


def launch_float_gemv(x, w: FloatCodes, y, block_n: int, block_k: int, num_warps: int) -> torch.Tensor:
    """The product with an explicit tile (K need not divide block_k: the tail is masked)."""
    div = w.divisors if w.nvfp4 else w.scales  # unused for FP8
    t = x.shape[0]
    _float_gemv_kernel[(triton.cdiv(w.rows, block_n), triton.cdiv(t, 16))](
        x, w.codes, w.scales, div, y, t, w.rows, x.shape[1], x.stride(0), y.stride(0), NVFP4=w.nvfp4,
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_T=16, DOT_BF16=x.dtype == torch.bfloat16, num_warps=num_warps,
        **LAUNCH)
    return y


DECODE_BLOCK_BYTES = 64 << 20  # float32 rows decoded at once for the prefill GEMM (within the planned workspace)


def float_linear(x: torch.Tensor, w: FloatCodes) -> torch.Tensor:
    """x [T, K] @ W^T: the in-kernel GEMV for few rows, else row blocks decoded for the GEMM."""
    if x.shape[0] <= GEMV_MAX_ROWS or torch_path(x):
        return float_gemv(x, w)
    chunk_rows = max(128, DECODE_BLOCK_BYTES // (4 * w.cols))
    y = torch.empty(x.shape[0], w.rows, dtype=x.dtype, device=x.device)
    for r0 in range(0, w.rows, chunk_rows):
        r1 = min(w.rows, r0 + chunk_rows)
        y[:, r0:r1] = x @ w.dense(r0, r1, x.dtype).t()
    return y
