"""SwiGLU on a fused [T, 2I] gate/up projection: y = silu(gate) * up."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import torch_path
from .launch import LAUNCH, pdl_wait
from .qgemv_int8 import QuantizedX, producer_words, write_quantized_x


@triton.jit
def _swiglu_kernel(gu_ptr, y_ptr, xq_ptr, inter, stride_gu, stride_y, BLOCK: tl.constexpr, QUANT: tl.constexpr,
                   ROW_INTS: tl.constexpr, K_PAD: tl.constexpr, QBITS: tl.constexpr, GROUP: tl.constexpr):
    pdl_wait()
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    g = tl.load(gu_ptr + t * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_gu + inter + cols, mask=ok, other=0.0).to(tl.float32)
    y = (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + t * stride_y + cols, y, mask=ok)
    if QUANT:  # this block of the row as the down projection would quantize it (zero past `inter`)
        write_quantized_x(xq_ptr + t * ROW_INTS, y.to(tl.float32), tl.program_id(1) * BLOCK, K_PAD, QBITS, GROUP, BLOCK)


def swiglu(gate_up: torch.Tensor, out: torch.Tensor | None = None, xq: QuantizedX | None = None) -> torch.Tensor:
    """gate_up [T, 2I] -> [T, I]; with `xq`, also those rows as dp4a words for the down projection."""
    t, two_i = gate_up.shape
    inter = two_i // 2
    if torch_path(gate_up):
        y = swiglu_reference(gate_up)
        y = out.copy_(y) if out is not None else y
        if xq is not None:
            xq.fill(y)
        return y
    y = out if out is not None else torch.empty(t, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    fused, words, quant = producer_words(xq, y, t, inter, block, triton.cdiv(inter, block) * block)
    _swiglu_kernel[(t, triton.cdiv(inter, block))](gate_up, y, words, inter, gate_up.stride(0), y.stride(0),
                                                   BLOCK=block, **quant, **LAUNCH)
    if xq is not None and not fused:
        xq.fill(y)
    return y


def swiglu_reference(gate_up):
    g, u = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(gate_up.dtype)
