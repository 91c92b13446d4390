"""Per-head RMSNorm (plain float32 weight) then RoPE on the first R dims (two halves), in one launch.

The DFlash2 drafter's query and key heads: in torch a cast, the norm, and RoPE's slices, negation, two
concatenations and three products (~8 launches per call, two or three calls a drafter layer). Here a
program per (row, head) loads the head once, normalizes it in float32 and rotates it, reading each
element's rotation partner from the same row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.reference_ops import apply_partial_rope

from . import torch_path
from .launch import LAUNCH, pdl_wait


@triton.jit
def _head_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, stride_x, stride_cs, D, R, eps,
                           BLOCK_D: tl.constexpr):
    pdl_wait()
    t, head = tl.program_id(0), tl.program_id(1)
    heads = tl.num_programs(1)
    j = tl.arange(0, BLOCK_D)
    ok = j < D
    row = x_ptr + t * stride_x + head * D
    x = tl.load(row + j, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    y = x * rstd * tl.load(w_ptr + j, mask=ok, other=0.0)
    half = R // 2
    rotated = j < R
    partner = tl.where(j < half, j + half, j - half)
    xp = tl.load(row + partner, mask=ok & rotated, other=0.0).to(tl.float32)
    yp = xp * rstd * tl.load(w_ptr + partner, mask=ok & rotated, other=0.0)
    cos = tl.load(cos_ptr + t * stride_cs + j, mask=ok & rotated, other=1.0)
    sin = tl.load(sin_ptr + t * stride_cs + j, mask=ok & rotated, other=0.0)
    out = y * cos + tl.where(j < half, -yp, yp) * sin
    tl.store(out_ptr + (t * heads + head) * D + j, out, mask=ok)


def head_norm_rope(x: torch.Tensor, heads: int, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads * D] (rows may be a column range of a wider projection; unit column stride), weight [D],
    cos / sin [T, R] float32 (R <= D, even) -> [T, heads, D] float32."""
    t, width = x.shape
    d = width // heads
    r = cos.shape[-1]
    if width != heads * d or weight.shape != (d,) or cos.shape != (t, r) or sin.shape != cos.shape or r > d or r % 2:
        raise ValueError(f"head_norm_rope: x {tuple(x.shape)} as {heads} heads, weight {tuple(weight.shape)}, "
                         f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)} disagree")
    if torch_path(x):
        return head_norm_rope_reference(x, heads, weight, eps, cos, sin)
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin, weight = cos.float().contiguous(), sin.float().contiguous(), weight.float().contiguous()
    out = torch.empty(t, heads, d, dtype=torch.float32, device=x.device)
    _head_norm_rope_kernel[(t, heads)](x, weight, cos, sin, out, x.stride(0), cos.stride(0), d, r, eps,
                                       BLOCK_D=triton.next_power_of_2(d), **LAUNCH)
    return out


def head_norm_rope_reference(x, heads, weight, eps, cos, sin):
    """The same in plain torch: F.rms_norm in float32, then the first R dims rotated as two halves."""
    t = x.shape[0]
    y = torch.nn.functional.rms_norm(x.float().reshape(t, heads, -1), (x.shape[1] // heads,), weight.float(), eps)
    return apply_partial_rope(y, cos.float(), sin.float())
