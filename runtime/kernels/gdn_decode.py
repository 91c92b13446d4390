"""Gated delta rule, recurrent form, for decode and short verify blocks (T small).

One program per (sequence, value head, block of value dims) keeps its [Dk, BLOCK_V] slice of the
float32 state in registers across the T steps; inputs are the already l2-normalized, pre-scaled
q and k, repeated to value heads.

The state lives in a slot stack [lanes, slots, HV, DK, DV]: slot 0 is the committed state, and
with `snapshot` the state after step t is also written to slot t+1, so speculative verification
can roll back to any accepted prefix by copying one slot (no recomputation). The kernel reads its
lane through an index, so no gather/scatter copies of the (large) state are needed.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _gdn_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, lanes_ptr, o_ptr, T, HV, SLOTS,
                          DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr, SNAPSHOT: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    lane = tl.load(lanes_ptr + b).to(tl.int64)
    dk = tl.arange(0, DK)
    dv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    slot_elems = HV * DK * DV
    tile = (h * DK) * DV + dk[:, None] * DV + dv[None, :]
    base = state_ptr + lane * SLOTS * slot_elems
    s = tl.load(base + tile)
    for t in range(T):
        row = (b * T + t) * HV + h
        q = tl.load(q_ptr + row * DK + dk).to(tl.float32)
        k = tl.load(k_ptr + row * DK + dk).to(tl.float32)
        v = tl.load(v_ptr + row * DV + dv).to(tl.float32)
        g = tl.load(g_ptr + row).to(tl.float32)
        beta = tl.load(beta_ptr + row).to(tl.float32)
        s = s * tl.exp(g)
        remembered = tl.sum(s * k[:, None], axis=0)
        delta = (v - remembered) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptr + row * DV + dv, o.to(o_ptr.dtype.element_ty))
        if SNAPSHOT:
            tl.store(base + (t + 1) * slot_elems + tile, s)
    tl.store(base + tile, s)


def gdn_recurrent(q, k, v, g, beta, state, lanes=None, snapshot=False, out=None):
    """q, k [B, T, HV, DK]; v [B, T, HV, DV]; g, beta [B, T, HV].
    state: [B, HV, DK, DV] fp32, or a slot stack [N, S, HV, DK, DV] whose lanes `lanes` (int [B]) are
    used; slot 0 is updated in place, and with `snapshot` slot t+1 receives the state after step t."""
    bsz, t, hv, dk = q.shape
    dv = v.shape[-1]
    stack = state if state.dim() == 5 else state.unsqueeze(1)
    slots = stack.shape[1]
    if snapshot and slots < t + 1:
        raise ValueError(f"snapshots of {t} steps need {t + 1} slots; the state has {slots}")
    if lanes is None:
        lanes = torch.arange(bsz, device=q.device, dtype=torch.int32)
    assert stack.is_contiguous() and stack.dtype == torch.float32
    o = out if out is not None else torch.empty(bsz, t, hv, dv, dtype=torch.float32, device=q.device)
    # the CPU interpreter (tests) pays per program, not per byte: one wide program per head there
    block_v = dv if os.environ.get("TRITON_INTERPRET") == "1" else min(32, dv)
    _gdn_recurrent_kernel[(bsz, hv, dv // block_v)](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), stack, lanes, o, t, hv,
        slots, DK=dk, DV=dv, BLOCK_V=block_v, SNAPSHOT=snapshot)
    return o


def gdn_recurrent_reference(q, k, v, g, beta, state):
    """Returns outputs [B, T, HV, DV] and the states after every step [B, T, HV, DK, DV]."""
    from runtime.reference_ops import gated_delta_rule

    outs, states = [], []
    for b in range(q.shape[0]):
        s = state[b]
        steps = []
        o_rows = []
        for i in range(q.shape[1]):
            o, s = gated_delta_rule(q[b, i:i + 1].float(), k[b, i:i + 1].float(), v[b, i:i + 1].float(),
                                    g[b, i:i + 1].float(), beta[b, i:i + 1].float(), s)
            o_rows.append(o)
            steps.append(s)
        outs.append(torch.cat(o_rows))
        states.append(torch.stack(steps))
    return torch.stack(outs), torch.stack(states)
