"""What every speculative decoder shares: per-round statistics, one batched verification forward of the
target over [next token, drafts], greedy or sampled acceptance, and rollback of the target's KV (by
length) and GDN state (by snapshot slot). A drafter (MTP head, DFlash2) supplies the drafts and keeps
its own state in step with what the target accepted."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from format.inventory import DRAFT_HEAD, DRAFT_TOKEN_IDS

from .kernels.paged_attention import PAGE
from .kernels.sampling import pick_token
from .transfers import device_ints


@dataclass
class SpecStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # rounds whose draft i was accepted

    def as_dict(self) -> dict:
        rate = [a / self.rounds if self.rounds else 0.0 for a in self.accepted_at]
        return {"rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
                "tokens_per_round": (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0,
                "acceptance_by_position": rate}


class Speculator:
    """Subclasses implement `_draft_block` (K drafts per lane, may be a CUDA graph), `_verify` (the target
    forward; returns logits and what the drafter needs from it), `_commit_drafter`, and the lane hooks
    the engine calls (reset_lane, absorb_prefill, save/restore_checkpoint, mark_stale, is_current,
    assume_context)."""

    def __init__(self, engine):
        self.e = engine
        self.k = engine.opts.draft_tokens
        self.stats = SpecStats(accepted_at=[0] * self.k)
        # benchmarks on random weights: accept exactly this many drafts per round (speed at a given
        # acceptance; the output is then no longer the target's greedy output)
        self.forced_accept: int | None = None
        # benchmarks: a list collects each round's CUDA events (start, drafts done, verify done), so the drafting
        # and the verify forward are timed apart (phase_ms)
        self.phase_events: list | None = None

    def can_speculate(self, lane: int) -> bool:
        """Drafting needs a current drafter state and room for K+1 verified positions in the lane's pages."""
        held = self.e.held_tokens(lane)
        # lanes with images use shifted (MRoPE) positions, which the draft and verify graphs do not take
        return (self.is_current(lane) and not self.e.rope_delta[lane]
                and held + self.k + 1 <= self.e.plan.pages_per_lane * PAGE)

    def round(self, lanes: list[int], next_tokens: list[int], budgets: list[int], stop_ids=(), params=None,
              counts=None, generator=None) -> list[list[int]]:
        """Draft K tokens per lane, verify them in one target forward, keep the longest agreeing prefix
        plus the target's own next token. Returns each lane's new tokens (1..K+1; the last one is not
        yet in the cache, like a sampled token after decode_step). stop_ids, params, counts and
        generator are shared, or lists with one entry per lane. Acceptance samples the target at each
        position and compares with the draft: exact for greedy and, since drafts are point proposals,
        for sampling."""
        e, k = self.e, self.k
        dev = e.device
        held = [e.held_tokens(lane) for lane in lanes]
        lanes_t = device_ints(lanes, dev)
        key = len(lanes)  # graphs are per batch size; the lane indices are a graph input
        # blocks of more than 16 rows take the MoE prefill path: grouped, without host syncs, but not yet
        # captured in a CUDA graph on a GPU, so these steps stay eager
        if e.cfg.is_moe and len(lanes) * (k + 1) > 16:
            e._eager_keys.update({("draft", key), ("verify", key)})
        timed = self.phase_events is not None and dev.type == "cuda"
        if timed:
            marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            marks[0].record()
        drafts = self._draft_block(lanes, lanes_t, held, next_tokens, key)
        if timed:
            marks[1].record()
        # one copy queued behind the drafts, not waiting for them: first tokens, new lengths, block positions
        b = len(lanes)
        ids = device_ints(list(next_tokens) + [L + k + 1 for L in held] + [L + j for L in held for j in range(k + 1)],
                          dev)
        verify_tokens = torch.cat([ids[:b, None], drafts], dim=1)
        positions = ids[2 * b :].view(b, k + 1)
        e._count_on_device(lanes_t, ids[b : 2 * b])
        logits, aux = e.run_step(("verify", key), self._verify, lanes_t, verify_tokens, positions)
        if timed:
            marks[2].record()
            self.phase_events.append(marks)
        draft_rows = drafts.tolist()
        greedy = torch.argmax(logits, dim=-1).tolist()
        results = []
        for b, lane in enumerate(lanes):
            stops, p, cnt, g = (_per_lane(stop_ids, b), _per_lane(params, b), _per_lane(counts, b),
                                _per_lane(generator, b))
            emitted = []
            for i in range(k + 1):
                tok = greedy[b][i] if p is None else pick_token(logits[b, i], p, cnt, g)
                if self.forced_accept is not None and i < k:
                    d = draft_rows[b][i]
                    tok = d if i < self.forced_accept else (d + 1) % e.cfg.vocab_size
                emitted.append(tok)
                if tok in stops or len(emitted) >= budgets[b] or i == k or tok != draft_rows[b][i]:
                    break
            keep = len(emitted)  # verify rows now in the cache: next_token and the agreeing drafts
            self._commit_target(lane, held[b], keep, [next_tokens[b]] + emitted[:-1])
            self._commit_drafter(lane, b, held[b], keep, aux)
            self.stats.rounds += 1
            self.stats.drafted += k
            self.stats.accepted += keep - 1
            for i in range(keep - 1):
                self.stats.accepted_at[i] += 1
            e.stats.decode_tokens += keep
            results.append(emitted)
        return results

    def _commit_target(self, lane: int, held: int, keep: int, tokens: list[int]) -> None:
        e = self.e
        e.ctx_len[lane] = held + keep
        e.lane_tokens[lane].extend(tokens)
        if keep < self.k + 1:  # roll the GDN state back to the snapshot after `keep` tokens
            e.conv_stack[:, lane, 0] = e.conv_stack[:, lane, keep]
            e.rec_stack[:, lane, 0] = e.rec_stack[:, lane, keep]

    def proposal_logits(self, h: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(token id of each logit column or None for the full head, float32 logits [N, columns])."""
        e = self.e
        if e.opts.lm_head_draft:
            return e.vec[DRAFT_TOKEN_IDS], e.lin[DRAFT_HEAD](h.contiguous()).float()
        if e.draft_head is not None:  # the head's first rows: column i is token id i
            return None, e.draft_head(h.contiguous()).float()
        return None, e.head_logits(h.contiguous())

    def propose(self, h: torch.Tensor) -> torch.Tensor:
        """Greedy proposal from drafter hidden rows [N, H]: the full head, or the reduced draft head."""
        ids, logits = self.proposal_logits(h)
        best = torch.argmax(logits, dim=-1)
        return ids[best].long() if ids is not None else best


def phase_ms(events: list) -> tuple[float, float]:
    """Mean (drafting ms, verify-forward ms) of the rounds whose events Speculator.phase_events collected (after a
    synchronize)."""
    if not events:
        return 0.0, 0.0
    draft = sum(a.elapsed_time(b) for a, b, _ in events) / len(events)
    verify = sum(b.elapsed_time(c) for _, b, c in events) / len(events)
    return draft, verify


def _per_lane(value, b: int):
    return value[b] if isinstance(value, list) else value
