"""E8 lattice helpers for the rk4v4-e8 and rk2v4-e8 key codecs (specs/kv-codecs.md §4).

E8 = D8 ∪ (D8 + ½): the nearest-point rule for int4g64e8, and the e8p codebook for rk2v4-e8's 2-bit
keys: 2^16 points of E8 shifted by ±¼ (the idea of QuIP#'s E8P codebook), coded as a magnitude pattern
byte and a sign-and-shift byte.
"""

from __future__ import annotations

import functools
import itertools

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


# --- e8p: 16-bit codes for 8-vectors, 2 bits per element (specs/kv-codecs.md §4.2) ----------------

E8P_LEVELS = (0.5, 1.5, 2.5)  # magnitudes of a pattern's coordinates (half-integers: the D8 + ½ coset)
# Pattern types (count of 3/2, count of 5/2): every magnitude vector of squared norm <= 10
E8P_TYPES = ((0, 0), (1, 0), (2, 0), (3, 0), (4, 0), (0, 1), (1, 1))
E8P_PATTERNS = 227  # codes 227..255 of the pattern byte are unused (they decode to the bare ±¼ shift)
E8P_SCALE_PER_RMS = 0.95  # group scale = rms × this: key tile cosine on Gaussian groups 0.9505 (0.9475 at 0.8)


@functools.lru_cache(maxsize=1)
def e8p_patterns() -> tuple[torch.Tensor, torch.Tensor]:
    """(table [256, 8] float, lookup [3^8] long).

    table[c] = the magnitudes of pattern c, with coordinate 7 negated when the pattern has an odd count
    of 3/2 (so that decoding coordinate 7's sign from the parity of the seven stored sign bits always
    lands on E8: a half-integer vector is in E8 when its count of minus signs has the parity of its
    count of 3/2 entries). lookup[Σ digit_i·3^i] = the pattern index of a level-digit vector (−1: none).
    """
    digits = [d for d in itertools.product(range(3), repeat=8) if (d.count(1), d.count(2)) in E8P_TYPES]
    digits.sort(key=lambda d: (sum(E8P_LEVELS[x] ** 2 for x in d), d))
    assert len(digits) == E8P_PATTERNS
    table = torch.zeros(256, 8)
    lookup = torch.full((3 ** 8,), -1, dtype=torch.long)
    for code, d in enumerate(digits):
        table[code] = torch.tensor([E8P_LEVELS[x] for x in d])
        if d.count(1) % 2:
            table[code, 7] = -table[code, 7]
        lookup[sum(x * 3 ** i for i, x in enumerate(d))] = code
    return table, lookup


@functools.lru_cache(maxsize=8)
def _e8p_on(device: str) -> tuple[torch.Tensor, ...]:
    """(table, lookup, type digits [7, 8] descending, their levels, odd-3/2 flag per type) on `device`
    (cached: no host copies inside a CUDA-graph capture)."""
    table, lookup = e8p_patterns()
    digits = torch.tensor([[2] * n2 + [1] * n1 + [0] * (8 - n1 - n2) for n1, n2 in E8P_TYPES])
    levels = torch.tensor(E8P_LEVELS)[digits]
    odd = torch.tensor([n1 % 2 for n1, _ in E8P_TYPES])
    return tuple(t.to(device) for t in (table, lookup, digits, levels, odd))


def e8p_encode(y: torch.Tensor) -> torch.Tensor:
    """y [N, 8] in units of the group scale -> codes uint8 [N, 2] (spec §4.2's rule, exactly).

    For each shift σ = +¼, −¼ of z = y − σ: the best magnitudes put the larger levels on the larger |z_i|,
    so only the 7 types are scored (sorted levels against sorted |z|); a sign parity that disagrees with
    the type costs flipping the smallest |z_i|. The shift with the smaller squared error wins.
    """
    _, lookup, type_digits, levels, type_odd = _e8p_on(str(y.device))
    rows = torch.arange(y.shape[0], device=y.device)
    powers = 3 ** torch.arange(8, device=y.device)
    best_score = best_codes = None
    for shift_bit, shift in ((0, 0.25), (1, -0.25)):
        z = y.float() - shift
        neg = z < 0
        mag_sorted, order = z.abs().sort(dim=-1, descending=True, stable=True)
        mismatch = (neg.sum(-1, keepdim=True) + type_odd) % 2 == 1  # [N, 7]
        score = (mag_sorted @ levels.t() - 0.5 * (levels * levels).sum(-1)
                 - mismatch * mag_sorted[:, 7:] - 0.5 * (z * z).sum(-1, keepdim=True))  # = −½ squared error
        kind = score.argmax(-1)
        digits = torch.zeros_like(order).scatter_(1, order, type_digits[kind])
        pattern = lookup[(digits * powers).sum(-1)]
        flip = mismatch[rows, kind]
        neg[rows, order[:, 7]] ^= flip
        sign_bits = (neg[:, :7].long() << torch.arange(7, device=y.device)).sum(-1)
        codes = torch.stack([pattern, sign_bits | (shift_bit << 7)], -1)
        top = score[rows, kind]
        if best_score is None:
            best_score, best_codes = top, codes
        else:
            take = top > best_score  # ties keep +¼
            best_score, best_codes = torch.where(take, top, best_score), torch.where(take[:, None], codes, best_codes)
    return best_codes.to(torch.uint8)


def e8p_decode(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [..., 2] -> [..., 8] float in units of the group scale."""
    table = _e8p_on(str(codes.device))[0]
    mag = table[codes[..., 0].long()]
    meta = codes[..., 1].long()
    bits = (meta[..., None] >> torch.arange(7, device=codes.device)) & 1  # signs of coordinates 0..6
    parity = bits.sum(-1, keepdim=True) % 2  # coordinate 7's stored sign
    neg = torch.cat([bits, parity], -1) == 1
    shift = torch.where(meta >= 128, -0.25, 0.25)[..., None]
    return torch.where(neg, -mag, mag) + shift
