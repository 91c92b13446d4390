"""E8 lattice helpers for the rk4v4-e8 and rk2v4-e8 key codecs (specs/kv-codecs.md §4).

E8 = D8 ∪ (D8 + ½). Its 240 minimal vectors ("roots") are 112 of type A (±1 on two coordinates)
and 128 of type B (±½ on all eight, an even number of minus signs).
"""

from __future__ import annotations

import functools
import itertools

import torch

ZERO_ROOT_CODE = 240
RADIUS_ZERO_BELOW = 0.08


@functools.lru_cache(maxsize=1)
def root_table() -> torch.Tensor:
    """[256, 8] float: code -> 4 × root (type A entries ±4, type B ±2); codes 240..255 are zero."""
    table = torch.zeros(256, 8)
    for pair, (i, j) in enumerate(itertools.combinations(range(8), 2)):  # lexicographic pairs
        for si in (0, 1):
            for sj in (0, 1):
                code = pair * 4 + (si << 1) + sj
                table[code, i] = -4.0 if si else 4.0
                table[code, j] = -4.0 if sj else 4.0
    for bits in range(128):
        signs = [(bits >> k) & 1 for k in range(7)]
        signs.append(sum(signs) & 1)  # the 8th sign keeps the count of minus signs even
        table[112 + bits] = torch.tensor([-2.0 if s else 2.0 for s in signs])
    return table


@functools.lru_cache(maxsize=8)
def _tables_on(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(4 × root table, candidate vectors [240, 16, 8], unit roots) cached per device (graph-safe)."""
    table = root_table()
    units = table[:240] / table[:240].norm(dim=-1, keepdim=True)
    return table.to(device), _candidates(table).to(device), units.to(device)


def radius_scale(idx: torch.Tensor) -> torch.Tensor:
    """0.5 · 2^((idx − 8) / 3); index 0 means a zero sub-vector."""
    return torch.where(idx > 0, 0.5 * torch.exp2((idx.float() - 8.0) / 3.0), torch.zeros_like(idx, dtype=torch.float32))


def _nearest_d8(x: torch.Tensor) -> torch.Tensor:
    f = torch.round(x)
    odd = (f.sum(-1) % 2) != 0
    err = x - f
    worst = err.abs().argmax(-1, keepdim=True)
    step = torch.where(torch.gather(err, -1, worst) >= 0, 1.0, -1.0)
    fixed = f.scatter_add(-1, worst, step)
    return torch.where(odd[..., None], fixed, f)


def e8_lattice_round(x: torch.Tensor) -> torch.Tensor:
    """Nearest E8 point of each 8-vector (Conway–Sloane), then rounded again to integers.

    The second rounding collapses half-integer coset points onto integers (ties to even): the
    stored codes are plain int4, so no coset bit exists.
    """
    a = _nearest_d8(x)
    b = _nearest_d8(x - 0.5) + 0.5
    pick_b = ((x - b) ** 2).sum(-1) < ((x - a) ** 2).sum(-1)
    return torch.round(torch.where(pick_b[..., None], b, a))


AXIS_WEIGHT = 2.0  # the axis nudge added to 4 × root before scaling
ROOT_CANDIDATES = 4  # nearest roots tried jointly with every axis


def _candidates(table: torch.Tensor) -> torch.Tensor:
    """[240, 16, 8]: every root (4×) with every signed axis nudge."""
    nudges = torch.zeros(16, 8)
    for a in range(16):
        nudges[a, a >> 1] = -AXIS_WEIGHT if a & 1 else AXIS_WEIGHT
    return table[:240, None, :] + nudges[None]


def e8_root_encode(v: torch.Tensor, ks: torch.Tensor) -> torch.Tensor:
    """v [..., 8 sub-vectors, 8] (one 64-group), ks [...] group scale -> codes uint8 [..., 8 * 2].

    Direction: the (root, axis) pair whose decoded vector has the highest cosine with v, searched
    over the ROOT_CANDIDATES nearest roots. Radius: the least-squares gain along that vector,
    quantized on the log grid of `radius_scale`.
    """
    _, cands, units = _tables_on(str(v.device))  # cands [240, 16, 8]
    flat = v.reshape(-1, 8)
    norm = flat.norm(dim=-1).clamp_min(1e-30)
    top = (flat / norm[:, None] @ units.t()).topk(ROOT_CANDIDATES, -1).indices  # [N, C]
    vecs = cands[top]  # [N, C, 16, 8]
    cos = (vecs * flat[:, None, None, :]).sum(-1) / vecs.norm(dim=-1)  # [N, C, 16]
    best = cos.reshape(flat.shape[0], -1).argmax(-1)
    root = torch.gather(top, 1, (best // 16)[:, None])[:, 0]
    axis = best % 16
    chosen = cands[root, axis]  # [N, 8]
    gain = (chosen * flat).sum(-1) / (chosen * chosen).sum(-1)  # least squares, units of v
    ksf = ks.reshape(-1, 1).expand(-1, 8).reshape(-1)
    g_rel = torch.where(ksf > 0, gain / ksf.clamp_min(1e-30), torch.zeros_like(gain))  # = radius_scale target
    zero = (g_rel <= 0) | (norm / (ksf.clamp_min(1e-30) * 8.0 ** 0.5) < RADIUS_ZERO_BELOW) | (ksf == 0)
    rad = torch.round(3.0 * torch.log2((2.0 * g_rel).clamp_min(1e-30)) + 8.0).clamp(1, 15)
    byte0 = torch.where(zero, torch.full_like(root, ZERO_ROOT_CODE), root)
    byte1 = torch.where(zero, torch.zeros_like(root), (rad.long() << 4) | axis)
    return torch.stack([byte0, byte1], -1).to(torch.uint8).reshape(*v.shape[:-2], -1)


def e8_root_decode(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., 8, 2] -> sub-vectors [..., 8, 8] in units of the group scale ks."""
    table = _tables_on(str(codes.device))[0]
    root = codes[..., 0].long()
    rad = (codes[..., 1] >> 4).long()
    axis = (codes[..., 1] & 0xF).long()
    vec = table[root].clone()
    sign = torch.where(axis & 1 == 1, -AXIS_WEIGHT, AXIS_WEIGHT)
    vec.scatter_add_(-1, (axis >> 1)[..., None], sign[..., None])
    vec = torch.where((root >= ZERO_ROOT_CODE)[..., None], torch.zeros_like(vec), vec)
    return vec * radius_scale(rad)[..., None]
