"""Token sampling on the device: penalties, temperature, min-p, top-k, top-p, then a Gumbel-max draw.

One program per row streams the vocabulary in blocks. Top-k and top-p thresholds are found by
bisection on the probability value (no sort), so the kernel needs no scratch beyond the row. The
uniform noise comes from the caller (torch's generator: seeded and CUDA-graph safe). With
temperature 0 the row is greedy (argmax, lowest id on ties).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from . import torch_path
from .launch import LAUNCH, pdl_wait

BISECT_STEPS = 30


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # divide positive logits / multiply negative ones of seen tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


@triton.jit
def _adjusted(logits_ptr, counts_ptr, row, v, ok, V, inv_temp, rep, presence, frequency, HAS_PENALTY: tl.constexpr):
    x = tl.load(logits_ptr + row * V + v, mask=ok, other=float("-inf")).to(tl.float32)
    if HAS_PENALTY:
        c = tl.load(counts_ptr + row * V + v, mask=ok, other=0).to(tl.float32)
        seen = c > 0
        x = tl.where(seen, tl.where(x > 0, x / rep, x * rep), x)
        x = x - tl.where(seen, presence, 0.0) - frequency * c
    return tl.where(ok, x * inv_temp, float("-inf"))


@triton.jit
def _bisect(logits_ptr, counts_ptr, row, V, m, z, lo, target, inv_temp, rep, presence, frequency,
            HAS_PENALTY: tl.constexpr, MASS: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """The largest probability threshold t in [lo, 1/z] whose kept tokens (p >= t) still number
    (MASS false) or weigh (MASS true) at least `target`."""
    hi = 1.0 / z
    for _ in range(STEPS):
        mid = (lo + hi) * 0.5
        kept = tl.zeros((BLOCK,), tl.float32)
        for v0 in range(0, V, BLOCK):
            v = v0 + tl.arange(0, BLOCK)
            x = _adjusted(logits_ptr, counts_ptr, row, v, v < V, V, inv_temp, rep, presence, frequency, HAS_PENALTY)
            p = tl.exp(x - m) / z
            if MASS:
                kept += tl.where(p >= mid, p, 0.0)
            else:
                kept += (p >= mid).to(tl.float32)  # counts stay exact in float32 below 2^24
        enough = tl.sum(kept, axis=0) >= target
        lo = tl.where(enough, mid, lo)
        hi = tl.where(enough, hi, mid)
    return lo


@triton.jit
def _sample_kernel(logits_ptr, counts_ptr, noise_ptr, out_ptr, V, inv_temp, top_k, top_p, min_p, rep, presence,
                   frequency, GREEDY: tl.constexpr, HAS_PENALTY: tl.constexpr, HAS_TOPK: tl.constexpr,
                   HAS_TOPP: tl.constexpr, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    pdl_wait()
    row = tl.program_id(0)
    # pass 1: max and arg-max
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_id = tl.zeros((BLOCK,), tl.int32)
    for v0 in range(0, V, BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        x = _adjusted(logits_ptr, counts_ptr, row, v, v < V, V, inv_temp, rep, presence, frequency, HAS_PENALTY)
        take = x > best
        best_id = tl.where(take, v, best_id)
        best = tl.where(take, x, best)
    m = tl.max(best, axis=0)
    if GREEDY:
        tl.store(out_ptr + row, tl.min(tl.where(best == m, best_id, V), axis=0))
        return
    # pass 2: softmax normalizer
    total = tl.zeros((BLOCK,), tl.float32)
    for v0 in range(0, V, BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        x = _adjusted(logits_ptr, counts_ptr, row, v, v < V, V, inv_temp, rep, presence, frequency, HAS_PENALTY)
        total += tl.exp(x - m)
    z = tl.sum(total, axis=0)
    # keep p >= threshold; min-p gives the first threshold (relative to the top probability 1/z)
    threshold = min_p / z
    if HAS_TOPK:  # the largest t with count(p >= t) >= top_k
        threshold = tl.maximum(threshold, _bisect(logits_ptr, counts_ptr, row, V, m, z, threshold, top_k, inv_temp, rep,
                                                  presence, frequency, HAS_PENALTY, False, BLOCK, STEPS))
    if HAS_TOPP:  # the largest t whose kept mass is still >= top_p
        threshold = tl.maximum(threshold, _bisect(logits_ptr, counts_ptr, row, V, m, z, threshold, top_p, inv_temp, rep,
                                                  presence, frequency, HAS_PENALTY, True, BLOCK, STEPS))
    # pass 3: Gumbel-max over the kept tokens
    g_best = tl.full((BLOCK,), float("-inf"), tl.float32)
    g_id = tl.zeros((BLOCK,), tl.int32)
    for v0 in range(0, V, BLOCK):
        v = v0 + tl.arange(0, BLOCK)
        ok = v < V
        x = _adjusted(logits_ptr, counts_ptr, row, v, ok, V, inv_temp, rep, presence, frequency, HAS_PENALTY)
        p = tl.exp(x - m) / z
        u = tl.load(noise_ptr + row * V + v, mask=ok, other=0.5)
        score = tl.where(ok & (p >= threshold), x - tl.log(-tl.log(u)), float("-inf"))
        take = score > g_best
        g_id = tl.where(take, v, g_id)
        g_best = tl.where(take, score, g_best)
    gm = tl.max(g_best, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(g_best == gm, g_id, V), axis=0))


def sample(logits: torch.Tensor, params: SamplingParams, counts: torch.Tensor | None = None,
           generator: torch.Generator | None = None, noise: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] -> token ids [B] int32. `counts` [B, V] int32 = how often each token was already
    produced (penalties); `noise` [B, V] uniform (0, 1) overrides the generator (tests)."""
    b, v = logits.shape
    greedy = params.temperature <= 0
    has_penalty = counts is not None and (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
                                          or params.frequency_penalty != 0.0)
    if noise is None and not greedy:
        noise = torch.rand(b, v, device=logits.device, generator=generator).clamp_(1e-20, 1.0 - 1e-7)
    if torch_path(logits):
        return sample_reference(logits, params, counts if has_penalty else None, noise)
    out = torch.empty(b, dtype=torch.int32, device=logits.device)
    has_topk = 0 < params.top_k < v
    _sample_kernel[(b,)](logits.contiguous(), counts if has_penalty else logits, noise if noise is not None else logits,
                         out, v, 1.0 if greedy else 1.0 / params.temperature, params.top_k, params.top_p, params.min_p,
                         params.repetition_penalty, params.presence_penalty, params.frequency_penalty,
                         GREEDY=greedy, HAS_PENALTY=has_penalty, HAS_TOPK=has_topk, HAS_TOPP=params.top_p < 1.0,
                         BLOCK=1024, STEPS=BISECT_STEPS, **LAUNCH)
    return out


def compile_every_variant(vocab: int, device: torch.device | str) -> int:
    """Run the kernel once in each of its compiled variants (greedy or not, with penalties, top-k, top-p), so that no
    request's first use of one compiles it while the other lanes wait (a server's warm-up); returns the launches."""
    logits = torch.zeros(1, vocab, device=device)
    counts = torch.zeros(1, vocab, dtype=torch.int32, device=device)
    launches = 0
    for greedy, penalty, top_k, top_p in itertools.product((True, False), repeat=4):
        params = SamplingParams(temperature=0.0 if greedy else 1.0, top_k=min(40, vocab - 1) if top_k else 0,
                                top_p=0.9 if top_p else 1.0, repetition_penalty=1.1 if penalty else 1.0)
        sample(logits, params, counts if penalty else None)
        launches += 1
    return launches


def pick_token_on_device(logits: torch.Tensor, params: SamplingParams | None, counts: torch.Tensor | None = None,
                         generator: torch.Generator | None = None) -> torch.Tensor:
    """pick_token without the host: the token as a 0-d tensor on the logits' device (counted there too)."""
    if params is None:
        return torch.argmax(logits)
    token = sample(logits[None].float(), params, counts, generator)[0]
    if counts is not None:
        counts[0].index_put_((token.reshape(1).long(),), torch.ones(1, dtype=counts.dtype, device=counts.device),
                             accumulate=True)
    return token


def pick_token(logits: torch.Tensor, params: SamplingParams | None, counts: torch.Tensor | None = None,
               generator: torch.Generator | None = None) -> int:
    """One token from one row of logits [V]: argmax without params, else the sampler; counts the pick."""
    return int(pick_token_on_device(logits, params, counts, generator))


def sample_reference(logits, params: SamplingParams, counts=None, noise=None):
    """Sort-based reference with the same Gumbel noise: returns token ids [B]."""
    x = logits.float().clone()
    if counts is not None:
        seen = counts > 0
        x = torch.where(seen, torch.where(x > 0, x / params.repetition_penalty, x * params.repetition_penalty), x)
        x = x - seen.float() * params.presence_penalty - params.frequency_penalty * counts.float()
    if params.temperature <= 0:
        return x.argmax(-1).int()
    x = x / params.temperature
    p = torch.softmax(x, -1)
    keep = p >= params.min_p * p.max(-1, keepdim=True).values
    if 0 < params.top_k < x.shape[-1]:
        kth = p.topk(params.top_k, -1).values[:, -1:]
        keep &= p >= kth
    if params.top_p < 1.0:
        sp, order = p.sort(-1, descending=True)
        csum = sp.cumsum(-1)
        cut = (csum - sp) < params.top_p  # keep tokens until the mass reaches top_p
        mask = torch.zeros_like(keep).scatter(-1, order, cut)
        keep &= mask
    score = torch.where(keep, x - torch.log(-torch.log(noise)), torch.tensor(float("-inf")))
    return score.argmax(-1).int()
