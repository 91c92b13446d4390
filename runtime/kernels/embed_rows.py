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

BLOCK = 1024  # columns a program
# False: the engine decodes the rows with torch's gather as before session 47 (side-by-side runs, bench/engine_ab.py
# runtime.kernels.embed_rows.ONE_LAUNCH:False; read at call time). Not yet timed on a GPU.
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


def embed_w8(base: torch.Tensor, scale: torch.Tensor, rows: int, cols: int, group: int, ids: torch.Tensor,
             dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` [n] of a W8 table (`base`: the uint8 codes of `rows` rows, `scale`: their float16 scales, a
    group of `group` columns each) -> [n, cols] in `dtype`: code * scale in float32, rounded once."""
    ids = ids.reshape(-1)
    if torch_path(ids):
        return embed_w8_reference(base, scale, rows, cols, group, ids, dtype)
    codes, scales = base.reshape(rows, -1), scale.reshape(rows, -1)
    if codes.stride(1) != 1 or scales.stride(1) != 1 or codes.shape[1] < cols or scales.shape[1] * group < cols:
        raise ValueError(f"embed_w8: planes {tuple(codes.shape)} / {tuple(scales.shape)} do not hold {cols} columns "
                         f"in groups of {group}")
    out = torch.empty(ids.shape[0], cols, dtype=dtype, device=ids.device)
    if ids.shape[0]:
        _embed_w8_kernel[(ids.shape[0], triton.cdiv(cols, BLOCK))](
            ids, codes, scales, out, cols, codes.stride(0), scales.stride(0), GROUP=group, BLOCK=BLOCK, **LAUNCH)
    return out


def embed_w8_reference(base: torch.Tensor, scale: torch.Tensor, rows: int, cols: int, group: int, ids: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
    ids = ids.reshape(-1).long()
    codes = base.reshape(rows, -1)[ids, :cols].view(torch.int8).float()
    scales = scale.reshape(rows, -1)[ids].float().repeat_interleave(group, dim=1)[:, :cols]
    return (codes * scales).to(dtype)
