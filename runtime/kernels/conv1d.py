"""Depthwise causal conv (width W) + SiLU over a short block, carrying the last W-1 inputs as state."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_kernel(x_ptr, state_ptr, w_ptr, y_ptr, T, C, W: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = cols < C
    for t in range(T):
        acc = tl.zeros((BLOCK_C,), dtype=tl.float32)
        for j in range(W):
            src = t + j - (W - 1)  # input index; negative reads come from the carried state
            if src >= 0:
                xv = tl.load(x_ptr + (b * T + src) * C + cols, mask=ok, other=0.0).to(tl.float32)
            else:
                xv = tl.load(state_ptr + (b * (W - 1) + (W - 1 + src)) * C + cols, mask=ok, other=0.0).to(tl.float32)
            acc += xv * tl.load(w_ptr + cols * W + j, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + (b * T + t) * C + cols, (acc * tl.sigmoid(acc)).to(y_ptr.dtype.element_ty), mask=ok)
    # new state = the last W-1 inputs of [state, x]
    for j in range(W - 1):
        src = T - (W - 1) + j
        if src >= 0:
            xv = tl.load(x_ptr + (b * T + src) * C + cols, mask=ok, other=0.0)
        else:
            xv = tl.load(state_ptr + (b * (W - 1) + (W - 1 + src)) * C + cols, mask=ok, other=0.0)
        tl.debug_barrier()
        tl.store(state_ptr + (b * (W - 1) + j) * C + cols, xv.to(state_ptr.dtype.element_ty), mask=ok)


def causal_conv1d(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None):
    """x [B, T, C]; state [B, W-1, C] (updated in place); weight [C, W]. Returns SiLU(conv) [B, T, C]."""
    bsz, t, c = x.shape
    y = out if out is not None else torch.empty_like(x)
    block = 256
    if t < state.shape[1]:
        # a short block reads and rewrites overlapping state rows: work from a copy of the old state
        old = state.clone()
        _conv_kernel[(bsz, triton.cdiv(c, block))](x.contiguous(), old, weight, y, t, c, W=weight.shape[1], BLOCK_C=block)
        state.copy_(old)
        return y
    _conv_kernel[(bsz, triton.cdiv(c, block))](x.contiguous(), state, weight, y, t, c, W=weight.shape[1], BLOCK_C=block)
    return y


def causal_conv1d_reference(x, state, weight):
    from runtime.reference_ops import causal_conv1d as ref

    ys, states = [], []
    for b in range(x.shape[0]):
        y, s = ref(x[b].float(), state[b].float(), weight.float())
        ys.append(y)
        states.append(s)
    return torch.stack(ys).to(x.dtype), torch.stack(states)
