"""Gated delta rule over a whole prefill chunk with flash-linear-attention's chunked (WY) kernel.

Why: the recurrent kernel walks a prefill chunk token by token (2,048 dependent steps per GDN layer);
fla's chunked form turns it into matrix products over 64-token blocks. It takes the same raw inputs
as `gdn_fused` (conv output, alpha/beta projections, A_log, dt_bias; l2 norm, decay and sigmoid
inside) and the same [HV, DK, DV] float32 state layout. Optional: fla is installed with the `gpu`
extra and runs on CUDA only; without it the engine keeps the recurrent kernel for prefill.
Reference: `gdn_fused_reference` (the recurrence in plain torch).
"""

from __future__ import annotations

import functools

import torch

CHUNKED_MIN_TOKENS = 64  # below one fla block the recurrent kernel is as fast


@functools.cache
def fla_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception:  # not installed, or built for another torch / triton
        return False
    return True


def gdn_chunked(x, alpha, beta, a_log, dt_bias, state, lanes, heads_k: int):
    """x: conv output [B, T, 2*HK*DK + HV*DV] (q | k | v), or its three sections as dense tensors (q, k, v) —
    causal_conv1d_lanes(split_keys=...), which spares the copies fla would make of column slices; alpha, beta:
    raw projections [B*T, HV]; state: slot stack [N, S, HV, DK, DV] float32, slot 0 of `lanes` read and updated.
    Returns o [B, T, HV, DV] in x's dtype."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    _, _, hv, dk, dv = state.shape
    key_dim = heads_k * dk
    if isinstance(x, tuple):
        q, k, v = x
        bsz, t = q.shape[:2]
        widths = (q.shape[-1], k.shape[-1], v.shape[-1])
        if widths != (key_dim, key_dim, hv * dv):
            raise ValueError(f"gdn_chunked: q, k, v have {widths} columns, expected {(key_dim, key_dim, hv * dv)}")
    else:
        bsz, t, width = x.shape
        if width != 2 * key_dim + hv * dv:
            raise ValueError(f"gdn_chunked: x has {width} columns, expected {2 * key_dim + hv * dv}")
        q, k, v = x.split([key_dim, key_dim, hv * dv], dim=-1)
    lanes_l = lanes.long()
    o, final = chunk_gated_delta_rule(
        q.reshape(bsz, t, heads_k, dk).contiguous(), k.reshape(bsz, t, heads_k, dk).contiguous(),
        v.reshape(bsz, t, hv, dv).contiguous(), alpha.reshape(bsz, t, hv).contiguous(),
        beta.reshape(bsz, t, hv).contiguous(), scale=dk ** -0.5, initial_state=state[lanes_l, 0].contiguous(),
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=a_log,
        dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
    state[lanes_l, 0] = final.float()
    return o


def chunked_probe(heads_k: int, heads_v: int, dk: int, dv: int, device) -> str | None:
    """Run the chunked kernel once at the model's head sizes against the recurrent kernel; returns why
    it cannot serve this model (an error or a mismatch), or None when it can."""
    from .gdn_fused import gdn_fused

    g = torch.Generator(device).manual_seed(0)
    t = 2 * CHUNKED_MIN_TOKENS
    x = torch.randn(1, t, 2 * heads_k * dk + heads_v * dv, device=device, generator=g).to(torch.bfloat16)
    alpha = torch.randn(t, heads_v, device=device, generator=g).to(torch.bfloat16)
    beta = torch.randn(t, heads_v, device=device, generator=g).to(torch.bfloat16)
    a_log, dt_bias = torch.zeros(heads_v, device=device), torch.zeros(heads_v, device=device)
    lanes = torch.zeros(1, device=device, dtype=torch.int32)
    state = torch.zeros(1, 2, heads_v, dk, dv, device=device)
    try:
        got = gdn_chunked(x, alpha, beta, a_log, dt_bias, state, lanes, heads_k).float()
    except Exception as exc:  # noqa: BLE001 - any failure means: keep the recurrent kernel
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    state.zero_()
    want = gdn_fused(x, alpha, beta, a_log, dt_bias, state, lanes, heads_k)
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
    return None if err < 5e-2 else f"output differs from the recurrence by {err:.1e} (relative)"
