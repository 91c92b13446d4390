"""Gated delta rule, recurrent form, for decode and short verify blocks (T small).

One program per (sequence, value head, block of value dims) keeps its [Dk, BLOCK_V] slice of the
float32 state in registers across the T steps; inputs are the already l2-normalized, pre-scaled
q and k, repeated to value heads. The chunked prefill form comes from flash-linear-attention on GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gdn_recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, o_ptr, T, HV,
                          DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    dk = tl.arange(0, DK)
    dv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    st_ptr = state_ptr + ((b * HV + h) * DK) * DV + dk[:, None] * DV + dv[None, :]
    s = tl.load(st_ptr)
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
    tl.store(st_ptr, s)


def gdn_recurrent(q, k, v, g, beta, state, out=None):
    """q, k [B, T, HV, DK]; v [B, T, HV, DV]; g, beta [B, T, HV]; state [B, HV, DK, DV] fp32 (updated in place)."""
    bsz, t, hv, dk = q.shape
    dv = v.shape[-1]
    o = out if out is not None else torch.empty(bsz, t, hv, dv, dtype=torch.float32, device=q.device)
    block_v = min(32, dv)
    _gdn_recurrent_kernel[(bsz, hv, dv // block_v)](q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
                                                     beta.contiguous(), state, o, t, hv, DK=dk, DV=dv, BLOCK_V=block_v)
    return o


def gdn_recurrent_reference(q, k, v, g, beta, state):
    from runtime.reference_ops import gated_delta_rule

    outs, states = [], []
    for b in range(q.shape[0]):
        o, s = gated_delta_rule(q[b].float(), k[b].float(), v[b].float(), g[b].float(), beta[b].float(), state[b])
        outs.append(o)
        states.append(s)
    return torch.stack(outs), torch.stack(states)
