"""Depthwise causal conv (width W) + SiLU over a short block, carrying the last W-1 inputs as state."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..switches import setting
from . import interpreted, torch_path
from .launch import LAUNCH, pdl_wait


@triton.jit
def _conv_kernel(x_ptr, state_ptr, w_ptr, y_ptr, T, C, W: tl.constexpr, BLOCK_C: tl.constexpr):
    pdl_wait()
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
    if torch_path(x):
        y, new_state = causal_conv1d_reference(x, state, weight)
        state.copy_(new_state)
        return out.copy_(y) if out is not None else y
    y = out if out is not None else torch.empty_like(x)
    block = 256
    if t < state.shape[1]:
        # a short block reads and rewrites overlapping state rows: work from a copy of the old state
        old = state.clone()
        _conv_kernel[(bsz, triton.cdiv(c, block))](x.contiguous(), old, weight, y, t, c, W=weight.shape[1], BLOCK_C=block, **LAUNCH)
        state.copy_(old)
        return y
    _conv_kernel[(bsz, triton.cdiv(c, block))](x.contiguous(), state, weight, y, t, c, W=weight.shape[1], BLOCK_C=block, **LAUNCH)
    return y


def causal_conv1d_reference(x, state, weight):
    from runtime.reference_ops import causal_conv1d as ref

    ys, states = [], []
    for b in range(x.shape[0]):
        y, s = ref(x[b].float(), state[b].float(), weight.float())
        ys.append(y)
        states.append(s)
    return torch.stack(ys).to(x.dtype), torch.stack(states)


@triton.jit
def _window_input(x_ptr, st, b, src, T, C, stride_x, cols, ok):
    """Input `src` of the lane's sequence as float32: x's row when src >= 0, else carried state slot 3 + src."""
    src_v = tl.full(cols.shape, src, tl.int32)  # block-shaped: triton 3.9's interpreter rejects scalar masks
    from_x = tl.load(x_ptr + (b * T + tl.maximum(src, 0)) * stride_x + cols, mask=ok & (src_v >= 0), other=0.0)
    from_state = tl.load(st + (3 + tl.minimum(src, -1)) * C + cols, mask=ok & (src_v < 0), other=0.0)
    return tl.where(src_v >= 0, from_x.to(tl.float32), from_state.to(tl.float32))


@triton.jit
def conv4_weights(w_ptr, cols, ok):
    """The four taps of channels `cols` of a width-4 conv weight [C, 4], as float32."""
    w0 = tl.load(w_ptr + cols * 4 + 0, mask=ok, other=0.0).to(tl.float32)
    w1 = tl.load(w_ptr + cols * 4 + 1, mask=ok, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + cols * 4 + 2, mask=ok, other=0.0).to(tl.float32)
    w3 = tl.load(w_ptr + cols * 4 + 3, mask=ok, other=0.0).to(tl.float32)
    return w0, w1, w2, w3


@triton.jit
def conv4_silu(w0, w1, w2, w3, p0, p1, p2, xt):
    """One step of the width-4 causal conv (three carried inputs, the new one) and its SiLU, in float32: the one
    arithmetic of this kernel and of the qkvz product's conv epilogue (qgemv_int8), so both round alike."""
    acc = w0 * p0 + w1 * p1 + w2 * p2 + w3 * xt
    return acc * tl.sigmoid(acc)


@triton.jit
def _conv4_lanes_kernel(x_ptr, state_ptr, lanes_ptr, w_ptr, y_ptr, T, C, SLOTS, stride_x, T_CHUNK, yk_ptr, yv_ptr,
                        BLOCK_C: tl.constexpr, SNAPSHOT: tl.constexpr, WRITE_STATE: tl.constexpr,
                        SPLIT_KEYS: tl.constexpr = 0, REPLACE_STATE: tl.constexpr = False):
    """Width-4 causal conv + SiLU for one lane's channel block over steps [t0, t0 + T_CHUNK). The three
    carried inputs live in registers across the steps, so the lane's slot-0 state is read once and
    (with WRITE_STATE: the only time chunk) written once; with SNAPSHOT, the window after step t also
    goes to slot t+1 (speculative rollback). Prefill blocks run in many time chunks at once: one
    program stepping 2,048 tokens in sequence was latency-bound (0.9 ms per layer, run 23). SPLIT_KEYS > 0:
    channels [0, SPLIT_KEYS) (q), [SPLIT_KEYS, 2 SPLIT_KEYS) (k) and the rest (v) go to three dense outputs
    y_ptr, yk_ptr, yv_ptr, as the chunked GDN kernel reads them (no copies to make them contiguous)."""
    pdl_wait()
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t0 = tl.program_id(2) * T_CHUNK
    ok = cols < C
    lane = tl.load(lanes_ptr + b).to(tl.int64)
    slot = 3 * C
    st = state_ptr + lane * SLOTS * slot
    p0 = _window_input(x_ptr, st, b, t0 - 3, T, C, stride_x, cols, ok)
    p1 = _window_input(x_ptr, st, b, t0 - 2, T, C, stride_x, cols, ok)
    p2 = _window_input(x_ptr, st, b, t0 - 1, T, C, stride_x, cols, ok)
    w0, w1, w2, w3 = conv4_weights(w_ptr, cols, ok)
    for t in range(t0, tl.minimum(t0 + T_CHUNK, T)):
        xt = tl.load(x_ptr + (b * T + t) * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        silu = conv4_silu(w0, w1, w2, w3, p0, p1, p2, xt).to(y_ptr.dtype.element_ty)
        if SPLIT_KEYS > 0:  # each channel to its section's row (a block may straddle two sections)
            row = b * T + t
            tl.store(y_ptr + row * SPLIT_KEYS + cols, silu, mask=ok & (cols < SPLIT_KEYS))
            tl.store(yk_ptr + row * SPLIT_KEYS + cols - SPLIT_KEYS, silu,
                     mask=ok & (cols >= SPLIT_KEYS) & (cols < 2 * SPLIT_KEYS))
            tl.store(yv_ptr + row * (C - 2 * SPLIT_KEYS) + cols - 2 * SPLIT_KEYS, silu, mask=ok & (cols >= 2 * SPLIT_KEYS))
        else:
            tl.store(y_ptr + (b * T + t) * C + cols, silu, mask=ok)
        p0, p1, p2 = p1, p2, xt
        if SNAPSHOT:
            snap = st + (t + 1) * slot
            tl.store(snap + cols, p0.to(state_ptr.dtype.element_ty), mask=ok)
            tl.store(snap + C + cols, p1.to(state_ptr.dtype.element_ty), mask=ok)
            tl.store(snap + 2 * C + cols, p2.to(state_ptr.dtype.element_ty), mask=ok)
    if WRITE_STATE:
        tl.store(st + cols, p0.to(state_ptr.dtype.element_ty), mask=ok)
        tl.store(st + C + cols, p1.to(state_ptr.dtype.element_ty), mask=ok)
        tl.store(st + 2 * C + cols, p2.to(state_ptr.dtype.element_ty), mask=ok)
    elif REPLACE_STATE and t0 == 0:  # several chunks of 3+ steps: the first is the only one that read the carried
        # window, so it puts the block's last three inputs in its place after its own reads (no launch for that)
        for i in tl.static_range(3):
            xi = tl.load(x_ptr + (b * T + T - 3 + i) * stride_x + cols, mask=ok, other=0.0)
            tl.store(st + i * C + cols, xi.to(state_ptr.dtype.element_ty), mask=ok)


# The chunked GDN kernel (fla) reads q, k and v as dense tensors: the prefill conv writes them so (a copy of each
# less per GDN layer and chunk: ~0.7 ms of a 512-token 27B riding chunk, session 41's profile); NINFER_CONV_SECTIONS=off
# writes the conv's output whole, as before (untimed side by side)
CONV_SECTIONS = setting("NINFER_CONV_SECTIONS") == "on"
CONV_TIME_CHUNK = 16  # steps per program for long blocks (prefill chunks): 5,120 programs for 2,048 tokens of the 27B


def causal_conv1d_lanes(x: torch.Tensor, stack: torch.Tensor, lanes: torch.Tensor, weight: torch.Tensor,
                        snapshot: bool = False, out: torch.Tensor | None = None, split_keys: int = 0):
    """Width-4 conv over x [B, T, C] (rows may be strided) for lanes `lanes` of a state stack
    [N, S, 3, C]: slot 0 in place, snapshots of each step's window in slots 1..T. Returns [B, T, C]; with
    `split_keys` (GDN's key width) the three sections q, k, v as dense tensors [B, T, keys], [B, T, keys],
    [B, T, C - 2 keys] instead."""
    bsz, t, c = x.shape
    if weight.shape[1] != 4 or stack.shape[2] != 3:
        raise ValueError("causal_conv1d_lanes handles width-4 convolutions only")
    if snapshot and stack.shape[1] < t + 1:
        raise ValueError(f"snapshots of {t} steps need {t + 1} slots; the state has {stack.shape[1]}")
    if split_keys and (out is not None or not 0 < 2 * split_keys < c):
        raise ValueError(f"causal_conv1d_lanes: {split_keys} key channels do not split {c} (and no out= with them)")
    if torch_path(x):
        y = causal_conv1d_lanes_reference(x, stack, lanes, weight, snapshot)
        if split_keys:
            return tuple(part.contiguous() for part in y.split([split_keys, split_keys, c - 2 * split_keys], -1))
        return out.copy_(y) if out is not None else y
    # the kernel steps rows (b, s) by one stride: one row per lane (decode) takes the lanes' own stride, so a
    # column slice of a wider product (qkv of qkvz) needs no copy — on the GPU a launch per layer for 2+ lanes
    row_stride = x.stride(0) if t == 1 else x.stride(1)
    if x.stride(-1) != 1 or (t > 1 and x.stride(0) != t * x.stride(1)):
        x = x.contiguous()
        row_stride = x.stride(1)
    if split_keys:
        y, yk, yv = (torch.empty(bsz, t, width, dtype=x.dtype, device=x.device)
                     for width in (split_keys, split_keys, c - 2 * split_keys))
    else:
        y = out if out is not None else torch.empty(bsz, t, c, dtype=x.dtype, device=x.device)
        yk = yv = y  # unwritten
    block = 1024 if interpreted() else 256
    # snapshots and short blocks step through time in one program; long blocks in chunks side by side, of which
    # only the first reads the carried window (and then replaces it)
    t_chunk = t if snapshot or t <= CONV_TIME_CHUNK else CONV_TIME_CHUNK
    chunks = triton.cdiv(t, t_chunk)
    _conv4_lanes_kernel[(bsz, triton.cdiv(c, block), chunks)](
        x, stack, lanes, weight, y, t, c, stack.shape[1], row_stride, t_chunk, yk, yv, BLOCK_C=block,
        SNAPSHOT=snapshot, WRITE_STATE=chunks == 1, SPLIT_KEYS=split_keys, REPLACE_STATE=chunks > 1 and t_chunk >= 3,
        **LAUNCH)
    if chunks > 1 and t_chunk < 3:  # chunks of 1-2 steps (tests): several read the window; replace it after them
        stack[lanes.long(), 0] = x[:, t - 3 :].to(stack.dtype)
    return (y, yk, yv) if split_keys else y


def causal_conv1d_lanes_reference(x, stack, lanes, weight, snapshot=False):
    """causal_conv1d_lanes in plain torch (float32 math, the same roundings): the lanes' slot-0 windows
    before x, SiLU(conv) per step, the new window into slot 0 and, with `snapshot`, step t's window
    into slot t + 1."""
    bsz, t, c = x.shape
    idx = lanes.long()
    seq = torch.cat([stack[idx, 0].float(), x.float()], dim=1)  # [B, 3 + T, C]
    windows = seq.unfold(1, 4, 1)  # [B, T + 1, C, 4]: window j covers inputs j - 3 .. j
    acc = (windows[:, :t] * weight.float()[None, None]).sum(-1)
    if snapshot:
        stack[idx, 1 : t + 1] = torch.stack([seq[:, s + 1 : s + 4] for s in range(t)], dim=1).to(stack.dtype)
    stack[idx, 0] = seq[:, t : t + 3].to(stack.dtype)
    return torch.nn.functional.silu(acc).to(x.dtype)
