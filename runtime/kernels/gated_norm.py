"""GDN output norm in one launch: y = w * RMSNorm(o) * SiLU(z) per value head (plain RMSNorm, weight w,
not 1 + w). The normalized value is rounded to the activation dtype before the weight, as the model's
own implementation does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import LAUNCH, pdl_wait
from .qgemv_int8 import QuantizedX, producer_words, write_quantized_x


@triton.jit
def _gated_norm_kernel(o_ptr, z_ptr, w_ptr, y_ptr, xq_ptr, stride_z, HV, eps, D: tl.constexpr, ROUND_BF16: tl.constexpr,
                       QUANT: tl.constexpr, ROW_INTS: tl.constexpr, K_PAD: tl.constexpr, QBITS: tl.constexpr,
                       GROUP: tl.constexpr):
    pdl_wait()
    r = tl.program_id(0)  # one (token, value head) row
    d = tl.arange(0, D)
    o = tl.load(o_ptr + r * D + d).to(tl.float32)
    n = o * tl.rsqrt(tl.sum(o * o, axis=0) / D + eps)
    if ROUND_BF16:
        n = n.to(tl.bfloat16).to(tl.float32)
    tok = r // HV
    z = tl.load(z_ptr + tok * stride_z + (r % HV) * D + d).to(tl.float32)
    w = tl.load(w_ptr + d).to(tl.float32)
    y = (w * n * z * tl.sigmoid(z)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + r * D + d, y)
    if QUANT:  # this head's lanes of the token's row, as the output projection would quantize them
        write_quantized_x(xq_ptr + tok * ROW_INTS, y.to(tl.float32), (r % HV) * D, K_PAD, QBITS, GROUP, D)


def gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype,
               out: torch.Tensor | None = None, xq: QuantizedX | None = None) -> torch.Tensor:
    """o [tokens, HV, D] fp32; z [tokens, HV*D] (any row stride); weight [D] -> [tokens, HV*D] out_dtype.
    With `xq`, the rows are also written there as dp4a words for the output projection."""
    tokens, hv, d = o.shape
    y = out if out is not None else torch.empty(tokens, hv * d, dtype=out_dtype, device=o.device)
    fused, words, quant = producer_words(xq, y, tokens, hv * d, d, hv * d)
    _gated_norm_kernel[(tokens * hv,)](o.contiguous(), z, weight, y, words, z.stride(0), hv, eps, D=d,
                                       ROUND_BF16=out_dtype == torch.bfloat16, **quant, **LAUNCH)
    if xq is not None and not fused:
        xq.fill(y)
    return y


def gated_norm_reference(o, z, weight, eps, out_dtype):
    tokens, hv, d = o.shape
    n = (o.float() * torch.rsqrt(o.float().pow(2).mean(-1, keepdim=True) + eps)).to(out_dtype).float()
    zz = z.float().reshape(tokens, hv, d)
    return (weight.float() * n * torch.nn.functional.silu(zz)).reshape(tokens, hv * d).to(out_dtype)
