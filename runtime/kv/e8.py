"""E8 lattice helpers for the rk4v4-e8 and rk2v4-e8 key codecs (specs/kv-codecs.md §4).

E8 = D8 ∪ (D8 + ½): the nearest-point rule for int4g64e8, and the e8cube codebook for rk2v4-e8's 2-bit
keys: all 2^16 points of E8 in the cube {±½, ±3/2}^8, shifted by ±¼ (a shifted-E8 codebook in the
spirit of QuIP#'s E8P, restricted so that every element decodes with bit operations: no table), coded
as a magnitude-bit byte and a sign-and-shift byte.
"""

from __future__ import annotations

import torch


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


# --- e8cube: 16-bit codes for 8-vectors, 2 bits per element (specs/kv-codecs.md §4.2) ------------

E8CUBE_SCALE_PER_RMS = 1.0  # group scale = rms × this (Gaussian groups: cosine 0.9490 at 1.0, 0.9482 at 0.9)


def _e8cube_nearest(y: torch.Tensor, shift: float, shift_bit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The nearest codebook point with shift `shift` for rows y [N, 8] (spec §4.2 steps 1-2):
    (squared error [N], codes [N, 2] long)."""
    z = y.float() - shift
    m = z.abs()
    big = m > 1.0
    level = torch.where(big, 1.5, 0.5)
    neg = z < 0
    err = (m - level) ** 2
    flip_cost = 4.0 * m * level
    toggle_cost = (m - (2.0 - level)) ** 2 - err
    cost = torch.minimum(flip_cost, toggle_cost)
    at = cost.argmin(-1, keepdim=True)
    mismatch = (neg.sum(-1, keepdim=True) + big.sum(-1, keepdim=True)) % 2 == 1
    fix = mismatch & torch.zeros_like(neg).scatter_(1, at, True)
    by_flip = fix & (flip_cost <= toggle_cost)
    neg = neg ^ by_flip
    big = big ^ (fix & ~by_flip)
    total = err.sum(-1) + torch.where(mismatch[:, 0], cost.gather(1, at)[:, 0], 0.0)
    bit = 1 << torch.arange(8, device=y.device)
    codes = torch.stack([(big.long() * bit).sum(-1), (neg[:, :7].long() * bit[:7]).sum(-1) | (shift_bit << 7)], -1)
    return total, codes


def e8cube_encode(y: torch.Tensor) -> torch.Tensor:
    """y [N, 8] in units of the group scale -> codes uint8 [N, 2]: the nearest point of the codebook.

    Per shift σ = +¼, −¼ of z = y − σ: each coordinate takes its nearer magnitude (½, or 3/2 above 1)
    and its own sign; when the count of minus signs and 3/2s is odd (off E8), the cheapest single change
    (a sign flip or the other magnitude, on the first coordinate of least extra error; a flip before a
    magnitude change on ties) restores it. The shift with the smaller error wins (+¼ on ties).
    """
    err_up, codes_up = _e8cube_nearest(y, 0.25, 0)
    err_down, codes_down = _e8cube_nearest(y, -0.25, 1)
    return torch.where((err_down < err_up)[:, None], codes_down, codes_up).to(torch.uint8)


def e8cube_decode(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., 2] -> [..., 8] float in units of the group scale."""
    i = torch.arange(8, device=codes.device)
    big = (codes[..., :1].long() >> i) & 1
    signs = codes[..., 1:].long()
    neg = (signs >> i) & 1
    neg[..., 7] = (neg[..., :7].sum(-1) + big.sum(-1)) % 2  # coordinate 7's sign puts the point on E8
    shift = torch.where(signs >= 128, -0.25, 0.25)
    return torch.where(neg == 1, -1.0, 1.0) * (0.5 + big) + shift
