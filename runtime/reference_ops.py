"""Plain-torch reference operators of the Qwen3.5 decoder; the oracle for every fast kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_1p(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: the stored weight w scales by (1 + w)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm: plain RMSNorm (weight w, not 1+w), then times SiLU(gate)."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * y * F.silu(gate.float())).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, dtype,
                 mrope_section: tuple[int, ...] = (11, 11, 10)) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] (text), or [3, T] (t, h, w) for interleaved MRoPE: frequency pair j follows the
    h axis when j % 3 == 1 and j < 3 * sections[1], the w axis when j % 3 == 2 and j < 3 * sections[2],
    else the t axis. Equal axes reduce to plain RoPE."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim))
    if positions.dim() == 2:
        pairs = torch.arange(rotary_dim // 2, device=positions.device)
        axis = torch.zeros_like(pairs)
        axis[(pairs % 3 == 1) & (pairs < 3 * mrope_section[1])] = 1
        axis[(pairs % 3 == 2) & (pairs < 3 * mrope_section[2])] = 2
        per_axis = positions.float().t()  # [T, 3]
        freqs = per_axis[:, axis] * inv_freq[None, :]
    else:
        freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; rotate the first cos.shape[-1] dims as two halves, pass the rest through."""
    r = cos.shape[-1]
    rot, rest = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([out, rest], dim=-1)


def causal_conv1d(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU. x [T, C], state [W-1, C] (previous inputs), weight [C, W]."""
    width = weight.shape[1]
    full = torch.cat([state.to(x.dtype), x], dim=0)  # [W-1+T, C]
    windows = full.unfold(0, width, 1)  # [T, C, W]
    out = (windows * weight[None]).sum(-1)
    return F.silu(out), full[-(width - 1):].clone()


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(q, k, v, g, beta, state):
    """Recurrent gated delta rule, one token at a time, in float32.

    q, k [T, Hv, Dk] (already l2-normalized, q pre-scaled); v [T, Hv, Dv]; g, beta [T, Hv];
    state [Hv, Dk, Dv]. Returns (out [T, Hv, Dv], new state).
    """
    out = torch.empty_like(v, dtype=torch.float32)
    s = state.float().clone()
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        remembered = torch.einsum("hk,hkv->hv", k[t], s)
        delta = (v[t] - remembered) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], s)
    return out, s


def attention(q, k_cache, v_cache, q_positions, scale: float) -> torch.Tensor:
    """Causal GQA over a cache. q [T, Hq, D]; caches [S, Hkv, D]; q_positions [T] absolute."""
    hq, hkv = q.shape[1], k_cache.shape[1]
    k = k_cache.repeat_interleave(hq // hkv, dim=1)
    v = v_cache.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), k.float()) * scale
    key_pos = torch.arange(k.shape[0], device=q.device)
    mask = key_pos[None, :] > q_positions[:, None]
    scores = scores.masked_fill(mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hts,shd->thd", probs, v.float()).to(q.dtype)


def swiglu_mlp(x, gate_up, down) -> torch.Tensor:
    gu = x @ gate_up.t()
    gate, up = gu.chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down.t()


def moe(x, router, shared_gate, experts_gate_up, experts_down, shared_gate_up, shared_down, top_k: int):
    """Softmax router over all experts, top-k renormalized to 1, plus a sigmoid-gated shared expert."""
    n_exp = router.shape[0]
    hidden = x.shape[-1]
    inter = experts_down.shape[1]
    probs = torch.softmax((x @ router.t()).float(), dim=-1)
    weights, idx = torch.topk(probs, top_k, dim=-1)
    weights = (weights / weights.sum(-1, keepdim=True)).to(x.dtype)
    gu = experts_gate_up.view(n_exp, 2 * inter, hidden)
    dn = experts_down.view(n_exp, hidden, inter)
    out = torch.zeros_like(x)
    for e in idx.unique().tolist():
        rows, slot = (idx == e).nonzero(as_tuple=True)
        h = swiglu_mlp(x[rows], gu[e], dn[e])
        out.index_add_(0, rows, h * weights[rows, slot, None])
    shared = swiglu_mlp(x, shared_gate_up, shared_down) * torch.sigmoid(x @ shared_gate.t())
    return out + shared
