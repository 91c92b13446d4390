"""The DFlash2 drafter's dynamic short convolution along each lane's block, in one launch.

out[n, i, c] = sum over taps o <= i of (base[o, c] + delta[n, i, o, c // group]) * x[n, i - o, c]
(+ residual[n, i, c]): causal inside the block, the kernel of every row its own (base plus a per-row,
per-channel-group delta). In torch that is a repeat, an add and two ops a tap (~9 launches a call, four
calls a drafter layer); here one launch, optionally adding the residual stream and writing the next
product's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import torch_path
from .launch import LAUNCH, pdl_wait


@triton.jit
def _block_conv_kernel(x_ptr, delta_ptr, base_ptr, res_ptr, out_ptr, B, H, GROUP, stride_xn, stride_xb,
                       stride_dn, stride_db, stride_dt, stride_rn, stride_rb, stride_on, stride_ob,
                       TAPS: tl.constexpr, BLOCK: tl.constexpr, RESIDUAL: tl.constexpr):
    pdl_wait()
    row = tl.program_id(0)
    n, i = row // B, row % B
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for o in tl.static_range(TAPS):
        live = ok & (cols * 0 + i >= o)  # taps reaching before the block's first row read nothing
        w = tl.load(base_ptr + o * H + cols, mask=live, other=0.0).to(tl.float32)
        w += tl.load(delta_ptr + n * stride_dn + i * stride_db + o * stride_dt + cols // GROUP, mask=live,
                     other=0.0).to(tl.float32)
        x = tl.load(x_ptr + n * stride_xn + (i - o) * stride_xb + cols, mask=live, other=0.0).to(tl.float32)
        acc += w * x
    if RESIDUAL:
        acc += tl.load(res_ptr + n * stride_rn + i * stride_rb + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + n * stride_on + i * stride_ob + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def block_conv(x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, group: int,
               residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [N, B, H], delta [N, B, taps, H // group] (any strides but a unit last one), base [taps, H],
    residual [N, B, H] or None -> [N, B, H] in `out_dtype` (default x's)."""
    n, b, h = x.shape
    taps = base.shape[0]
    if delta.shape != (n, b, taps, h // group) or base.shape != (taps, h) or h % group \
            or (residual is not None and residual.shape != x.shape):
        raise ValueError(f"block_conv: x {tuple(x.shape)}, delta {tuple(delta.shape)}, base {tuple(base.shape)}, "
                         f"group {group}, residual {None if residual is None else tuple(residual.shape)} disagree")
    out_dtype = out_dtype or x.dtype
    if torch_path(x):
        return block_conv_reference(x, delta, base, group, residual).to(out_dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if delta.stride(-1) != 1:
        delta = delta.contiguous()
    if residual is not None and residual.stride(-1) != 1:
        residual = residual.contiguous()
    base = base.contiguous()
    out = torch.empty(n, b, h, dtype=out_dtype, device=x.device)
    res = residual if residual is not None else x  # unread
    block = min(1024, triton.next_power_of_2(h))
    _block_conv_kernel[(n * b, triton.cdiv(h, block))](
        x, delta, base, res, out, b, h, group, x.stride(0), x.stride(1), delta.stride(0), delta.stride(1),
        delta.stride(2), res.stride(0), res.stride(1), out.stride(0), out.stride(1), TAPS=taps, BLOCK=block,
        RESIDUAL=residual is not None, **LAUNCH)
    return out


def block_conv_reference(x, delta, base, group, residual=None):
    """The same in plain torch, float32."""
    x = x.float()
    weight = base.float() + delta.float().repeat_interleave(group, dim=-1)  # [N, B, taps, H]
    out = weight[:, :, 0] * x
    for offset in range(1, weight.shape[2]):
        out[:, offset:] += weight[:, offset:, offset] * x[:, :-offset]
    return out if residual is None else out + residual.float()
