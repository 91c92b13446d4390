"""Zero-centred RMSNorm, optionally fused with the residual add: h = x + r; y = norm(h) * (1 + w).
x may be a product's unsummed K-split partials (SplitPartials), and y may also be written in the dp4a
words of the next quantized product (QuantizedX): the launches before and after it fold in here."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import LAUNCH, pdl_wait
from .qgemv_int8 import QuantizedX, SplitPartials, producer_words, write_quantized_x


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, xq_ptr, H, eps, stride_x, stride_r, stride_y,
                    split_stride, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr,
                    QUANT: tl.constexpr, ROW_INTS: tl.constexpr, K_PAD: tl.constexpr, QBITS: tl.constexpr,
                    GROUP: tl.constexpr):
    pdl_wait()
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    if SPLITS == 0:
        h = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    else:  # float32 partials summed in split order and rounded as finish_splits would
        h = tl.zeros((BLOCK,), tl.float32)
        for s in tl.static_range(SPLITS):
            h += tl.load(x_ptr + s * split_stride + row * stride_x + cols, mask=ok, other=0.0)
        h = h.to(y_ptr.dtype.element_ty).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(res_out_ptr + row * stride_r + cols, h.to(res_out_ptr.dtype.element_ty), mask=ok)
    var = tl.sum(h * h, axis=0) / H
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = (h * tl.rsqrt(var + eps) * (1.0 + w)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + cols, y, mask=ok)
    if QUANT:  # the stored (rounded) values, as the product would quantize them from memory
        write_quantized_x(xq_ptr + row * ROW_INTS, y.to(tl.float32), 0, K_PAD, QBITS, GROUP, BLOCK)


def rmsnorm(x: torch.Tensor | SplitPartials, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
            out: torch.Tensor | None = None, xq: QuantizedX | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, H] (or a product's SplitPartials, summed here). With `residual`, returns
    (norm(x + residual), x + residual) and writes the sum in place of `residual`. Without, returns
    (norm(x), None). With `xq` (made by QuantizedX.empty for the next product's weight), the normed
    rows are also written there as dp4a words."""
    splits, split_stride = 0, 0
    if isinstance(x, SplitPartials):
        parts, x = x.parts, x.y  # x: the unwritten product output, for shape and dtype
        splits, split_stride = parts.shape[0], parts.stride(0)
    t, h = x.shape
    y = out if out is not None else torch.empty_like(x)
    res = residual if residual is not None else x
    block = triton.next_power_of_2(h)
    fused, words, quant = producer_words(xq, y, t, h, block, block)
    source = parts if splits else x
    _rmsnorm_kernel[(t,)](source, res, weight, y, res, words, h, eps,
                          source.stride(1) if splits else x.stride(0), res.stride(0), y.stride(0), split_stride,
                          HAS_RESIDUAL=residual is not None, BLOCK=block, SPLITS=splits,
                          **quant,
                          num_warps=min(16, max(4, block // 512)), **LAUNCH)  # a one-program row: latency-bound
    if xq is not None and not fused:
        xq.fill(y)
    return y, residual


def rmsnorm_reference(x, weight, eps, residual=None):
    h = x.float() + (residual.float() if residual is not None else 0)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    return y.to(x.dtype), (h.to(x.dtype) if residual is not None else None)
