"""Gated delta rule for decode / verify with its preparation folded in: reads the conv output and the
raw alpha/beta projections, l2-normalizes q and k of the key head that serves each value head, forms
the decay g = -exp(A_log) * softplus(alpha + dt_bias) and beta = sigmoid(b), then runs the recurrence
(slot stack [lanes, slots, HV, DK, DV]: slot 0 is the committed state, slots 1..T take the state after
each step for speculative rollback). One launch replaces about fifteen small ones per GDN layer, which
matter inside a decode step of 48 such layers. For decode and verify blocks the alpha/beta projections
(two bf16 matrices of HV rows) are folded in too: each program dots its head's two weight rows with the
layer input (`projections`), a launch less per layer. With `gate` (NINFER_GDN_NORM_EPILOGUE=on) the GDN
output norm (gated_norm) is folded in as well: the program that finishes a (row block, value head) last — a
counter per head, taken with an acquire-release atomic — normalizes the head's rows the others left in `o` and
writes them, and the output projection's dp4a words where it reads them (another launch less per layer, with
every value tile still its own program: session 32's norm in a program per head lost more than the launch).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ..switches import setting
from . import interpreted, torch_path, tuning_from_env
from .gated_norm import gated_norm, gated_norm_rows
from .launch import LAUNCH, pdl_wait
from .qgemv_int8 import QuantizedX, producer_words, write_quantized_x

L2_EPS = 1e-6
PROJECT_MAX_ROWS = 16  # decode and verify blocks multiply alpha/beta here; prefill keeps the vendor GEMM
# value columns per program and warps per program. A program's state tile is [DK, BLOCK_V]; every token reduces it
# over DK twice (and q, k and the alpha/beta dots once each), across the warps that split DK — so fewer warps trade
# barriers for registers. Side-by-side runs (bench/gdn_compare.py): NINFER_GDN_TILE=block_v,warps (block_v 0, the
# default: the rule, gdn_block_v; 32,4 the tile of every launch before session 36). The sweep's least summed time
# (64,4 everywhere; session 35, H100) lost end to end (8 lanes 9.91 -> 10.37 ms a step) though it won isolated; the
# rule widens verify blocks only, and won in the engine (H100, session 36, `bash bench/device_frag.sh next36`, MTP3
# rounds, 32,4 -> rule: verify of 4 lanes x 4 tokens 13.01 -> 12.56 ms, of 2 lanes 9.42 -> 9.46).
GDN_BLOCK_V = 32  # the rule's one-token steps and floor
GDN_TUNING = tuning_from_env("NINFER_GDN_TILE", ("block_v", "warps"), {"block_v": 0, "warps": 4})
GDN_BLOCK_PROGRAMS = 192  # wider value tiles for verify blocks while at least this many programs run
INTERPRETER_BLOCK_V = 0  # value columns a program under the interpreter (0: the head; tests set it to split heads)
# NINFER_GDN_NORM_EPILOGUE=on: the output norm in the recurrence's launch (GdnGate; opt-in until timed on a GPU)
NORM_EPILOGUE = setting("NINFER_GDN_NORM_EPILOGUE") == "on"


@dataclass
class GdnGate:
    """The GDN output norm gdn_fused applies in its launch: y = weight * RMSNorm(o) * SiLU(z) per value head
    (gated_norm's contract), written to `out` [rows, HV * DV] and, where it reads them, into the output
    product's words `xq`. `counts`: int32 zeros, one per (row block, value head) of the launch at least, left
    zero after it (the finishing program resets its counter), so one buffer serves every launch and graph."""

    z: torch.Tensor
    weight: torch.Tensor
    eps: float
    out: torch.Tensor
    counts: torch.Tensor
    xq: QuantizedX | None = None

    def rows(self, part: slice) -> "GdnGate":
        """The same norm over rows `part` of z, out and xq (e.g. a riding chunk's rows apart from its riders')."""
        xq = None if self.xq is None else replace(self.xq, words=self.xq.words[part])
        return replace(self, z=self.z[part], out=self.out[part], xq=xq)

    def apply(self, o: torch.Tensor) -> torch.Tensor:
        """The norm in its own launch (gated_norm) over o [rows, ..., DV] that a recurrence left: gate.out."""
        hv = self.out.shape[1] // o.shape[-1]
        return gated_norm(o.reshape(-1, hv, o.shape[-1]), self.z, self.weight, self.eps, self.out.dtype, out=self.out,
                          xq=self.xq)


def gdn_block_v(lanes: int, tokens: int, heads_v: int, dv: int) -> int:
    """Value columns per program of a launch over `lanes` x `tokens` rows: NINFER_GDN_TILE's block_v where given, else
    (block_v 0, the default) this rule. Each program repeats every token's preparation (q/k norms, the alpha/beta
    dots with the layer input) for its columns, token after token, so verify blocks of 4+ tokens take the widest
    tile that keeps GDN_BLOCK_PROGRAMS programs: H100, session 35 (`bench/gdn_compare.py`, one 27B layer, µs): 4
    lanes x 4 tokens 48.99 (32 columns) -> 41.30 (64) -> 35.02 (128); one lane x 4 or 8 tokens (48 programs at 128)
    keeps 32 (13.35 / 24.74 against 17.95 / 33.69); one-token steps keep 32 (1 x 1 4.17 against 4.29; 8 lanes 64
    gained alone, lost in the step)."""
    if GDN_TUNING["block_v"]:
        return min(GDN_TUNING["block_v"], dv)
    block_v = min(GDN_BLOCK_V, dv)
    if tokens < 4:
        return block_v
    while 2 * block_v <= dv and lanes * heads_v * (dv // (2 * block_v)) >= GDN_BLOCK_PROGRAMS:
        block_v *= 2
    return block_v


@triton.jit
def _softplus(x):
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _gdn_fused_kernel(x_ptr, alpha_ptr, beta_ptr, a_log_ptr, dt_bias_ptr, state_ptr, lanes_ptr, o_ptr,
                      h_ptr, wa_ptr, wb_ptr, T, HV, SLOTS, stride_x, stride_ab, stride_h, key_dim, q_scale, eps,
                      z_ptr, norm_w_ptr, y_ptr, xq_ptr, count_ptr, stride_z, norm_eps,
                      RATIO: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr,
                      SNAPSHOT: tl.constexpr, PROJECT: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr,
                      NORM: tl.constexpr = False, ROUND_BF16: tl.constexpr = True, QUANT: tl.constexpr = False,
                      ROW_INTS: tl.constexpr = 0, K_PAD: tl.constexpr = 0, QBITS: tl.constexpr = 4,
                      GROUP: tl.constexpr = 64):
    pdl_wait()
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    hk = h // RATIO
    lane = tl.load(lanes_ptr + b).to(tl.int64)
    dk = tl.arange(0, DK)
    dv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    slot_elems = HV * DK * DV
    tile = (h * DK) * DV + dk[:, None] * DV + dv[None, :]
    base = state_ptr + lane * SLOTS * slot_elems
    s = tl.load(base + tile)
    a_log = tl.load(a_log_ptr + h).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    for t in range(T):
        row = b * T + t
        xr = x_ptr + row * stride_x
        q = tl.load(xr + hk * DK + dk).to(tl.float32)
        k = tl.load(xr + key_dim + hk * DK + dk).to(tl.float32)
        v = tl.load(xr + 2 * key_dim + h * DV + dv).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps) * q_scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
        if PROJECT:  # alpha, beta = this head's rows of the two projections . the layer input row
            acc_a = tl.zeros((BLOCK_K,), tl.float32)
            acc_b = tl.zeros((BLOCK_K,), tl.float32)
            for k0 in tl.static_range(0, K, BLOCK_K):  # unrolled: every block's loads go out together
                ks = k0 + tl.arange(0, BLOCK_K)
                k_ok = ks < K
                hx = tl.load(h_ptr + row * stride_h + ks, mask=k_ok, other=0.0).to(tl.float32)
                acc_a += tl.load(wa_ptr + h * K + ks, mask=k_ok, other=0.0).to(tl.float32) * hx
                acc_b += tl.load(wb_ptr + h * K + ks, mask=k_ok, other=0.0).to(tl.float32) * hx
            # rounded to the activation dtype, as the separate projection stores them
            alpha = tl.sum(acc_a, axis=0).to(h_ptr.dtype.element_ty).to(tl.float32)
            beta_raw = tl.sum(acc_b, axis=0).to(h_ptr.dtype.element_ty).to(tl.float32)
        else:
            alpha = tl.load(alpha_ptr + row * stride_ab + h).to(tl.float32)
            beta_raw = tl.load(beta_ptr + row * stride_ab + h).to(tl.float32)
        g = -tl.exp(a_log) * _softplus(alpha + dt_bias)
        beta = tl.sigmoid(beta_raw)
        s = s * tl.exp(g)
        remembered = tl.sum(s * k[:, None], axis=0)
        delta = (v - remembered) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptr + (row * HV + h) * DV + dv, o.to(o_ptr.dtype.element_ty))
        if SNAPSHOT:
            tl.store(base + (t + 1) * slot_elems + tile, s)
    tl.store(base + tile, s)
    if NORM:  # the last of the head's value tiles to finish normalizes its rows (gated_norm's arithmetic)
        tl.debug_barrier()  # every thread's o stored before the count releases them
        counter = count_ptr + b * HV + h
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(2) - 1:
            tl.store(counter, 0)  # zero again for the next launch (every tile of this head has counted)
            d = tl.arange(0, DV)
            w = tl.load(norm_w_ptr + d).to(tl.float32)
            for t in range(T):
                row = b * T + t
                # .cg: from L2, where the other programs' stores are (not a stale L1 line)
                ov = tl.load(o_ptr + (row * HV + h) * DV + d, cache_modifier=".cg").to(tl.float32)
                zv = tl.load(z_ptr + row * stride_z + h * DV + d).to(tl.float32)
                y = gated_norm_rows(ov[None, :], zv[None, :], w, norm_eps, DV, ROUND_BF16)
                y = tl.reshape(y.to(y_ptr.dtype.element_ty), (DV,))
                tl.store(y_ptr + row * HV * DV + h * DV + d, y)
                if QUANT:
                    write_quantized_x(xq_ptr + row * ROW_INTS, y.to(tl.float32), h * DV, K_PAD, QBITS, GROUP, DV)


def gdn_fused(x, alpha, beta, a_log, dt_bias, state, lanes, heads_k: int, snapshot: bool = False, out=None,
              projections=None, gate: GdnGate | None = None):
    """x: conv output [B, T, 2*HK*DK + HV*DV] (q | k | v); alpha, beta: raw projections [B*T, HV], or
    None with `projections` = (layer input [B*T, K], alpha weight [HV, K], beta weight [HV, K]), which
    the kernel multiplies itself; a_log, dt_bias [HV] fp32; state: slot stack [N, S, HV, DK, DV] fp32
    (slot 0 updated in place, slots 1..T get per-step snapshots with `snapshot`); lanes int [B].
    Returns o [B, T, HV, DV] fp32; with `gate`, the normed output gate.out [B*T, HV*DV] instead (GdnGate)."""
    bsz, t, width = x.shape
    _, slots, hv, dk, dv = state.shape
    key_dim = heads_k * dk
    if width != 2 * key_dim + hv * dv:
        raise ValueError(f"gdn_fused: x has {width} columns, expected {2 * key_dim + hv * dv}")
    if snapshot and slots < t + 1:
        raise ValueError(f"snapshots of {t} steps need {t + 1} slots; the state has {slots}")
    if gate is not None and (gate.out.shape != (bsz * t, hv * dv) or gate.z.shape != gate.out.shape
                             or gate.z.stride(-1) != 1 or gate.weight.shape != (dv,)):
        raise ValueError(f"gdn_fused: the gate's z {tuple(gate.z.shape)}, out {tuple(gate.out.shape)}, weight "
                         f"{tuple(gate.weight.shape)} do not fit {bsz * t} rows of {hv} value heads of {dv}")
    if torch_path(x) or (gate is not None and gate.counts.numel() < bsz * hv):  # the norm in a launch of its own
        if torch_path(x):
            o = _gdn_fused_torch(x, alpha, beta, a_log, dt_bias, state, lanes, heads_k, snapshot, out, projections)
        else:
            o = gdn_fused(x, alpha, beta, a_log, dt_bias, state, lanes, heads_k, snapshot, out, projections)
        return o if gate is None else gate.apply(o)
    x = x.reshape(bsz * t, width)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if projections is not None:
        h, wa, wb = projections
        if h.shape[0] != bsz * t or wa.shape != (hv, h.shape[1]) or wb.shape != wa.shape or h.stride(-1) != 1 \
                or not (wa.is_contiguous() and wb.is_contiguous()):
            raise ValueError(f"gdn_fused: projections {tuple(h.shape)}, {tuple(wa.shape)}, {tuple(wb.shape)} do not "
                             f"fit {bsz * t} rows and {hv} value heads")
        alpha = beta = h  # unread
    else:
        alpha, beta = alpha.reshape(bsz * t, hv).contiguous(), beta.reshape(bsz * t, hv).contiguous()
        h = wa = wb = alpha  # unread
    o = out if out is not None else torch.empty(bsz, t, hv, dv, dtype=torch.float32, device=x.device)
    block_v = (INTERPRETER_BLOCK_V or dv) if interpreted() else gdn_block_v(bsz, t, hv, dv)
    if dv % block_v or block_v & (block_v - 1) or GDN_TUNING["warps"] not in (1, 2, 4, 8):
        raise SystemExit(f"ninfer: NINFER_GDN_TILE={GDN_TUNING['block_v']},{GDN_TUNING['warps']} does not fit value "
                         f"heads of {dv} (block_v a power of two dividing it; 1, 2, 4 or 8 warps); unset it")
    norm: dict = {"NORM": False}
    z = norm_w = y = words = counts = o  # unread without a gate
    stride_z, norm_eps, fused = 0, 0.0, True
    if gate is not None:
        z, norm_w, y, counts, stride_z, norm_eps = gate.z, gate.weight, gate.out, gate.counts, gate.z.stride(0), gate.eps
        fused, words, quant = producer_words(gate.xq, y, bsz * t, hv * dv, dv, hv * dv)
        norm = {"NORM": True, "ROUND_BF16": y.dtype == torch.bfloat16, **quant}
    _gdn_fused_kernel[(bsz, hv, dv // block_v)](
        x, alpha, beta, a_log, dt_bias, state, lanes, o, h, wa, wb, t, hv, slots, x.stride(0), hv, h.stride(0),
        key_dim, dk ** -0.5, L2_EPS, z, norm_w, y, words, counts, stride_z, norm_eps, RATIO=hv // heads_k, DK=dk,
        DV=dv, BLOCK_V=block_v, SNAPSHOT=snapshot, PROJECT=projections is not None,
        K=h.shape[-1] if projections is not None else 0, BLOCK_K=1024, num_warps=GDN_TUNING["warps"], **norm,
        **LAUNCH)
    if gate is None:
        return o
    if gate.xq is not None and not fused:
        gate.xq.fill(y)
    return y


def _gdn_fused_torch(x, alpha, beta, a_log, dt_bias, state, lanes, heads_k, snapshot, out, projections):
    """gdn_fused's contract (slot stack, lanes, snapshots, projections) over gdn_fused_reference."""
    if projections is not None:
        h, wa, wb = projections
        alpha, beta = h.float() @ wa.float().t(), h.float() @ wb.float().t()
    idx = lanes.long()
    o, steps = gdn_fused_reference(x, alpha, beta, a_log, dt_bias, state[idx, 0], heads_k)
    if snapshot:
        state[idx, 1 : x.shape[1] + 1] = steps.to(state.dtype)
    state[idx, 0] = steps[:, -1].to(state.dtype)
    o = o.float()
    return out.copy_(o) if out is not None else o


def gdn_fused_reference(x, alpha, beta, a_log, dt_bias, state, heads_k: int):
    """Plain torch: the separate preparation ops, then the recurrent reference. state [B, HV, DK, DV]."""
    import torch.nn.functional as F

    from runtime.reference_ops import l2_normalize

    bsz, t, _ = x.shape
    hv, dk, dv = state.shape[1:]
    key_dim = heads_k * dk
    q, k, v = x.float().split([key_dim, key_dim, hv * dv], dim=-1)
    q = l2_normalize(q.reshape(bsz, t, heads_k, dk)).repeat_interleave(hv // heads_k, 2) * dk ** -0.5
    k = l2_normalize(k.reshape(bsz, t, heads_k, dk)).repeat_interleave(hv // heads_k, 2)
    g = -a_log.exp() * F.softplus(alpha.float().reshape(bsz, t, hv) + dt_bias)
    b = torch.sigmoid(beta.float().reshape(bsz, t, hv))
    return gdn_recurrent_reference(q, k, v.reshape(bsz, t, hv, dv), g, b, state)


def gdn_recurrent_reference(q, k, v, g, beta, state):
    """The recurrence step by step (runtime.reference_ops.gated_delta_rule): q, k [B, T, HV, DK] already
    normalized and shared, g, beta [B, T, HV], state [B, HV, DK, DV]. Returns the outputs
    [B, T, HV, DV] and the state after every step [B, T, HV, DK, DV]."""
    from runtime.reference_ops import gated_delta_rule

    outs, states = [], []
    for b in range(q.shape[0]):
        s, steps, rows = state[b], [], []
        for i in range(q.shape[1]):
            o, s = gated_delta_rule(q[b, i:i + 1].float(), k[b, i:i + 1].float(), v[b, i:i + 1].float(),
                                    g[b, i:i + 1].float(), beta[b, i:i + 1].float(), s)
            rows.append(o)
            steps.append(s)
        outs.append(torch.cat(rows))
        states.append(torch.stack(steps))
    return torch.stack(outs), torch.stack(states)
