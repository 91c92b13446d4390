"""The DFlash2 candidate selector's greedy walk in one launch: a program per lane walks its K proposal rows.

At row r the lane's previous token p picks its gate g = predecessor[p] * projected[r] (rank-wide), every
candidate c of the row scores unary[r, c] + <successor[candidate[r, c]], g>, and the best becomes the
draft and the next row's p. In torch that is ~10 small launches a row (two codebook gathers, casts, the
product, an einsum, an add, argmax and a gather), K rows one after another; here the walk stays in one
program's registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import torch_path
from .launch import LAUNCH, pdl_wait


@triton.jit
def _selector_walk_kernel(unary_ptr, cand_ptr, proj_ptr, pred_ptr, succ_ptr, anchor_ptr, out_ptr, TOPK, RANK,
                          K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    pdl_wait()
    n = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    rk = tl.arange(0, BLOCK_R)
    c_ok, r_ok = c < TOPK, rk < RANK
    previous = tl.load(anchor_ptr + n).to(tl.int64)
    for r in tl.static_range(K):
        row = n * K + r
        gate = tl.load(pred_ptr + previous * RANK + rk, mask=r_ok, other=0.0).to(tl.float32) \
            * tl.load(proj_ptr + row * RANK + rk, mask=r_ok, other=0.0)
        cand = tl.load(cand_ptr + row * TOPK + c, mask=c_ok, other=0)
        succ = tl.load(succ_ptr + cand[:, None] * RANK + rk[None, :], mask=c_ok[:, None] & r_ok[None, :],
                       other=0.0).to(tl.float32)
        score = tl.load(unary_ptr + row * TOPK + c, mask=c_ok, other=0.0) + tl.sum(succ * gate[None, :], axis=1)
        score = tl.where(c_ok, score, float("-inf"))
        best = tl.argmax(score, axis=0, tie_break_left=True)
        previous = tl.sum(tl.where(c == best, cand, 0), axis=0)
        tl.store(out_ptr + row, previous)


def selector_walk(unary: torch.Tensor, candidates: torch.Tensor, projected: torch.Tensor,
                  predecessors: torch.Tensor, successors: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """unary [N, K, C] float32 (the candidates' logits), candidates [N, K, C] int64 token ids, projected
    [N, K, R] float32, predecessor / successor codebooks [V, R], anchors [N] -> drafts [N, K] int64."""
    n, k, c = unary.shape
    rank = projected.shape[-1]
    if candidates.shape != unary.shape or projected.shape != (n, k, rank) or anchors.shape != (n,) \
            or predecessors.shape[1] != rank or successors.shape != predecessors.shape:
        raise ValueError(f"selector_walk: unary {tuple(unary.shape)}, candidates {tuple(candidates.shape)}, "
                         f"projected {tuple(projected.shape)}, codebooks {tuple(predecessors.shape)} / "
                         f"{tuple(successors.shape)}, anchors {tuple(anchors.shape)} disagree")
    if torch_path(unary):
        return selector_walk_reference(unary, candidates, projected, predecessors, successors, anchors)
    out = torch.empty(n, k, dtype=torch.int64, device=unary.device)
    _selector_walk_kernel[(n,)](unary.float().contiguous(), candidates.long().contiguous(),
                                projected.float().contiguous(), predecessors.contiguous(), successors.contiguous(),
                                anchors.long().contiguous(), out, c, rank, K=k, BLOCK_C=triton.next_power_of_2(c),
                                BLOCK_R=triton.next_power_of_2(rank), **LAUNCH)
    return out


def selector_walk_reference(unary, candidates, projected, predecessors, successors, anchors):
    """The same walk in plain torch, row after row."""
    previous = anchors.long()
    drafts = []
    for r in range(unary.shape[1]):
        gate = predecessors[previous].float() * projected[:, r].float()  # [N, R]
        bigram = torch.einsum("ncr,nr->nc", successors[candidates[:, r]].float(), gate)
        best = torch.argmax(unary[:, r].float() + bigram, dim=-1)
        previous = candidates[:, r].gather(1, best[:, None])[:, 0].long()
        drafts.append(previous)
    return torch.stack(drafts, dim=1)
