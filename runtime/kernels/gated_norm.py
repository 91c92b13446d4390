"""GDN output norm in one launch: y = w * RMSNorm(o) * SiLU(z) per value head (plain RMSNorm, weight w,
not 1 + w). The normalized value is rounded to the activation dtype before the weight, as the model's
own implementation does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import torch_path
from .launch import LAUNCH, pdl_wait
from .qgemv_int8 import QuantizedX, producer_words, write_quantized_x


@triton.jit
def gated_norm_rows(o, z, w, eps, D: tl.constexpr, ROUND_BF16: tl.constexpr):
    """w * RMSNorm(o) * SiLU(z) over rows [R, D] of float32 o and z, weight w [D] float32; float32 out. Shared
    with gdn_fused's epilogue (NINFER_GDN_NORM_EPILOGUE), so both round alike."""
    n = o * tl.rsqrt(tl.sum(o * o, axis=1) / D + eps)[:, None]
    if ROUND_BF16:
        n = n.to(tl.bfloat16).to(tl.float32)
    return w[None, :] * n * z * tl.sigmoid(z)


@triton.jit
def _gated_norm_kernel(o_ptr, z_ptr, w_ptr, y_ptr, xq_ptr, stride_z, HV, ROWS, eps, D: tl.constexpr,
                       ROUND_BF16: tl.constexpr, BLOCK_R: tl.constexpr, QUANT: tl.constexpr, ROW_INTS: tl.constexpr,
                       K_PAD: tl.constexpr, QBITS: tl.constexpr, GROUP: tl.constexpr):
    """BLOCK_R (token, value head) rows per program: one for decode (which may write dp4a words),
    several for prefill chunks, whose 100K head rows of 128 lanes are too small for a program each."""
    pdl_wait()
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = (r < ROWS)[:, None]
    d = tl.arange(0, D)
    o = tl.load(o_ptr + r[:, None] * D + d[None, :], mask=ok, other=0.0).to(tl.float32)
    tok = r // HV
    z = tl.load(z_ptr + (tok * stride_z + (r % HV) * D)[:, None] + d[None, :], mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + d).to(tl.float32)
    y = gated_norm_rows(o, z, w, eps, D, ROUND_BF16).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + r[:, None] * D + d[None, :], y, mask=ok)
    if QUANT:  # (one row per program) this head's lanes of the token's row, as the output projection would quantize them
        row = tl.program_id(0)
        write_quantized_x(xq_ptr + (row // HV) * ROW_INTS, tl.reshape(y.to(tl.float32), (D,)), (row % HV) * D, K_PAD,
                          QBITS, GROUP, D)


def gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype,
               out: torch.Tensor | None = None, xq: QuantizedX | None = None) -> torch.Tensor:
    """o [tokens, HV, D] fp32; z [tokens, HV*D] (any row stride); weight [D] -> [tokens, HV*D] out_dtype.
    With `xq`, the rows are also written there as dp4a words for the output projection."""
    tokens, hv, d = o.shape
    if torch_path(o):
        y = gated_norm_reference(o, z, weight, eps, out_dtype)
        y = out.copy_(y) if out is not None else y
        if xq is not None:
            xq.fill(y)
        return y
    y = out if out is not None else torch.empty(tokens, hv * d, dtype=out_dtype, device=o.device)
    fused, words, quant = producer_words(xq, y, tokens, hv * d, d, hv * d)
    rows = tokens * hv
    block_r = 1 if quant["QUANT"] or rows < 1024 else 16
    _gated_norm_kernel[(triton.cdiv(rows, block_r),)](o.contiguous(), z, weight, y, words, z.stride(0), hv, rows, eps, D=d,
                                                      ROUND_BF16=out_dtype == torch.bfloat16, BLOCK_R=block_r, **quant,
                                                      **LAUNCH)
    if xq is not None and not fused:
        xq.fill(y)
    return y


def gated_norm_reference(o, z, weight, eps, out_dtype):
    tokens, hv, d = o.shape
    n = (o.float() * torch.rsqrt(o.float().pow(2).mean(-1, keepdim=True) + eps)).to(out_dtype).float()
    zz = z.float().reshape(tokens, hv, d)
    return (weight.float() * n * torch.nn.functional.silu(zz)).reshape(tokens, hv * d).to(out_dtype)
