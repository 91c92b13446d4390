"""The token embedding lookup of a W8 table (8-bit codes, a float16 scale per group of 32 columns: every recipe's
embedding but bf16): the step's rows dequantized straight into the activation dtype in one launch. torch's
gather and decode took seven small kernels a step (the codes' and the scales' rows, three casts, the product, the
cast to bf16), none of which takes part in programmatic dependent launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import torch_path
from .launch import LAUNCH, pdl_wait
from .qlinear import PackedLinear, gather_rows

BLOCK = 1024  # columns a program
# False: the engine decodes the rows with torch's gather as before session 47 (side-by-side runs, bench/engine_ab.py
# runtime.kernels.embed_rows.ONE_LAUNCH:False; read at call time). Side by side on an H100 (session 48, one lane):
# 35B-A3B 2.071 against 2.083 ms a step with torch's gather (0.6 %).
ONE_LAUNCH = True


@triton.jit
def _embed_w8_kernel(ids_ptr, base_ptr, scale_ptr, out_ptr, cols, row_bytes, row_groups,
                     GROUP: tl.constexpr, BLOCK: tl.constexpr):
    pdl_wait()  # the ids may be the tokens the step before picked
    r = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < cols
    token = tl.load(ids_ptr + r).to(tl.int64)
    code = tl.load(base_ptr + token * row_bytes + c, mask=ok, other=0).to(tl.int8, bitcast=True)
    scale = tl.load(scale_ptr + token * row_groups + c // GROUP, mask=ok, other=0.0)
    value = code.to(tl.float32) * scale.to(tl.float32)
    tl.store(out_ptr + r.to(tl.int64) * cols + c, value.to(out_ptr.dtype.element_ty), mask=ok)


def takes(w: PackedLinear) -> bool:
    """Whether embed_w8 decodes `w`'s rows: 8-bit codes on the artifact's row planes."""
    return w.fmt.bits == 8 and w.high is None and w.fragment is None


def embed_w8(w: PackedLinear, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of the W8 table `w` (takes(w)) -> [n, cols] in `dtype`: code * scale in float32, rounded once,
    as the torch decoder (qlinear.gather_rows) gives them."""
    ids = ids.reshape(-1)
    if torch_path(ids):
        return gather_rows(w, ids).to(dtype)
    codes, scales = w.base.view(w.rows, -1), w.scale.view(w.rows, -1)
    out = torch.empty(ids.shape[0], w.cols, dtype=dtype, device=ids.device)
    if ids.shape[0]:
        _embed_w8_kernel[(ids.shape[0], triton.cdiv(w.cols, BLOCK))](
            ids, codes, scales, out, w.cols, codes.stride(0), scales.stride(0), GROUP=w.fmt.group_size, BLOCK=BLOCK,
            **LAUNCH)
    return out
