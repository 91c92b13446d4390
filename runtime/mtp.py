"""MTP speculative decoding: chain drafts from the checkpoint's MTP layer, one batched verification
forward of the target, and rollback of KV (by length) and GDN state (by snapshot slot) on rejection.

Per lane the MTP layer has its own paged KV cache. Its input at position p is the target's
final-normed hidden state at p and the token at p+1; it predicts the token at p+2. Rows whose
next token is not yet known wait in a small "hidden tail" (at most draft_tokens + 1 rows) and are
absorbed by the next draft, so each round costs one padded catch-up forward, K-1 single-row chain
forwards and one target forward of K+1 rows. Acceptance samples the target at each position and
compares with the draft: exact for greedy and, since the drafts are point proposals, for sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from format.inventory import DRAFT_HEAD, DRAFT_TOKEN_IDS

from .kernels.paged_attention import PAGE
from .kernels.rmsnorm import rmsnorm
from .kernels.sampling import pick_token


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


class MtpState:
    def __init__(self, engine):
        self.e = engine
        self.k = engine.opts.draft_tokens
        self.stats = SpecStats(accepted_at=[0] * self.k)
        # benchmarks on random weights: accept exactly this many drafts per round (speed at a given
        # acceptance; the output is then no longer the target's greedy output)
        self.forced_accept: int | None = None

    @classmethod
    def bind(cls, engine) -> "MtpState":
        self = cls(engine)
        e, c, mem, plan = engine, engine.cfg, engine.mem, engine.plan
        lanes = engine.lanes
        self.layers = 1 + max(int(n.split("/")[2]) for n in e.art.objects if n.startswith("mtp/layers/"))
        ppl = plan.pages_per_lane
        extra = -(-self.k // PAGE)
        total_pages = plan.pages + lanes * extra
        self.pools = [{p.name: mem.view("kv_pool", f"mtp{j}/{p.name}", p.dtype,
                                        (total_pages, PAGE, c.num_kv_heads, p.width))
                       for p in e.codec.planes(c.head_dim)} for j in range(self.layers)]
        table = [list(range(i * ppl, (i + 1) * ppl)) + list(range(plan.pages + i * extra, plan.pages + (i + 1) * extra))
                 for i in range(lanes)]
        self.block_table = mem.view("kv_pool", "mtp_block_tables", torch.int32, (lanes, ppl + extra))
        self.block_table.copy_(torch.tensor(table, dtype=torch.int32))
        self.ctx = mem.view("sequence_state", "mtp_context_lengths", torch.int32, (lanes,))
        self.ctx.zero_()
        # rows 0..K: hidden rows waiting for the MTP layer; row K+1: the turn checkpoint's pending row
        self.tail = mem.view("sequence_state", "mtp_hidden_tail", torch.bfloat16, (lanes, self.k + 2, c.hidden_size))
        self.tail.zero_()  # padded catch-up rows read it: keep them finite
        # first position whose hidden row still waits for the MTP layer (its rows sit in the tail);
        # None when plain decode steps left the MTP cache behind
        self.start: list[int | None] = [0] * lanes
        self.use_draft_head = engine.opts.lm_head_draft
        return self

    # --- lane bookkeeping --------------------------------------------------------------

    def reset_lane(self, lane: int) -> None:
        self.start[lane] = 0
        self.ctx[lane] = 0

    def save_checkpoint(self, lane: int) -> None:
        """Called when the lane's prefill reaches its turn checkpoint: right after a chunk, exactly one
        hidden row (the chunk's last) waits for its next token."""
        self.tail[lane, self.k + 1] = self.tail[lane, 0]

    def restore_checkpoint(self, lane: int, held: int) -> None:
        self.tail[lane, 0] = self.tail[lane, self.k + 1]
        self.start[lane] = held - 1

    def mark_stale(self, lane: int) -> None:
        self.start[lane] = None

    def is_current(self, lane: int) -> bool:
        return self.start[lane] is not None

    def can_speculate(self, lane: int) -> bool:
        """Drafting needs a current MTP cache and room for K+1 verified positions in the lane's pages."""
        held = self.e.held_tokens(lane)
        # lanes with images use shifted (MRoPE) positions, which the draft and verify graphs do not take
        return (self.is_current(lane) and not self.e.rope_delta[lane]
                and held + self.k + 1 <= self.e.plan.pages_per_lane * PAGE)

    # --- the MTP layer -----------------------------------------------------------------

    def _forward(self, j, lanes_t, tokens, hidden, positions):
        """tokens [B, T], target hidden [B, T, H] at positions [B, T] -> MTP output hidden [B, T, H]."""
        e, c = self.e, self.e.cfg
        b, t = tokens.shape
        eps = c.rms_norm_eps
        emb, _ = rmsnorm(e.embed(tokens.reshape(-1)), e.vec["mtp/embedding_norm"], eps)
        hid, _ = rmsnorm(hidden.reshape(b * t, -1).to(e.act_dtype), e.vec["mtp/hidden_norm"], eps)
        x = e.lin["mtp/input_projection"](torch.cat([emb, hid], dim=-1).contiguous())
        p = f"mtp/layers/{j}/"
        h, _ = rmsnorm(x, e.vec[p + "input_norm"], eps)
        mixed = e._attention(p + "attention/", self.pools[j], self.block_table, self.ctx, h, lanes_t, t,
                             positions.reshape(-1).to(torch.int32))
        h, residual = rmsnorm(mixed, e.vec[p + "post_attention_norm"], eps, residual=x)
        out, _ = rmsnorm(e._ffn(p, h), e.vec["mtp/final_norm"], eps, residual=residual)
        return out.view(b, t, -1)

    def _propose(self, h):
        """Greedy proposal from MTP hidden rows [B, H]: the full head, or the reduced draft head."""
        e = self.e
        if self.use_draft_head:
            best = torch.argmax(e.lin[DRAFT_HEAD](h.contiguous()).float(), dim=-1)
            return e.vec[DRAFT_TOKEN_IDS][best].long()
        return torch.argmax(e.lin["text/output_head"](h.contiguous()).float(), dim=-1)

    def absorb_prefill(self, lane: int, prompt: list[int], start: int, hidden: torch.Tensor) -> None:
        """After a target prefill chunk at [start, start+T): run the MTP layer over every row whose
        next token the prompt already gives; keep the chunk's last row in the tail."""
        e = self.e
        m = self.start[lane]
        end = start + hidden.shape[0]
        rows = torch.cat([self.tail[lane, : start - m].to(hidden.dtype), hidden[:-1]]) if start > m else hidden[:-1]
        if end - 1 > m:
            lanes_t = torch.tensor([lane], device=e.device)
            self.ctx[lane] = end - 1
            toks = torch.tensor([prompt[m + 1 : end]], device=e.device)
            pos = torch.arange(m, end - 1, device=e.device)[None]
            self._forward(0, lanes_t, toks, rows[None], pos)
        self.tail[lane, 0] = hidden[-1].to(self.tail.dtype)
        self.start[lane] = end - 1

    def _draft(self, lanes_t, tail_tokens, first, rows):
        """Catch-up over the tail (padded to K+1 rows) then K-1 chain steps; returns drafts [B, K]."""
        b, t = tail_tokens.shape
        ar = torch.arange(t, device=tail_tokens.device)
        self.ctx[lanes_t] = (first + t).to(torch.int32)
        out = self._forward(0, lanes_t, tail_tokens, self.tail[lanes_t, :t], first[:, None] + ar[None])
        last = out[torch.arange(b, device=out.device), rows - 1]
        drafts = [self._propose(last)]
        for j in range(1, self.k):
            pos = first + rows + (j - 1)
            self.ctx[lanes_t] = (pos + 1).to(torch.int32)
            last = self._forward(j % self.layers, lanes_t, drafts[-1][:, None], last[:, None], pos[:, None])[:, 0]
            drafts.append(self._propose(last))
        return torch.stack(drafts, dim=1)

    def _verify(self, lanes_t, tokens, positions):
        return self.e.forward(lanes_t, tokens, positions, all_logits=True, snapshot=True, with_hidden=True)

    # --- one speculative round ---------------------------------------------------------

    def round(self, lanes: list[int], next_tokens: list[int], budgets: list[int], stop_ids=(), params=None,
              counts=None, generator=None) -> list[list[int]]:
        """Draft K tokens per lane, verify them in one target forward, keep the longest agreeing prefix
        plus the target's own next token. Returns each lane's new tokens (1..K+1; the last one is not
        yet in the cache, like a sampled token after decode_step). stop_ids, params, counts and
        generator are shared, or lists with one entry per lane."""
        e, k = self.e, self.k
        dev = e.device
        held = [e.held_tokens(lane) for lane in lanes]
        first = [self.start[lane] for lane in lanes]
        tail_tokens = []
        for lane, L, m, nxt in zip(lanes, held, first, next_tokens):
            toks = e.lane_tokens[lane][m + 1 : L] + [nxt]
            tail_tokens.append(toks + [0] * (k + 1 - len(toks)))
        lanes_t = torch.tensor(lanes, device=dev)
        first_t = torch.tensor(first, device=dev)
        rows_t = torch.tensor([L - m for L, m in zip(held, first)], device=dev)
        key = len(lanes)  # graphs are per batch size; the lane indices are a graph input
        # blocks of more than 16 rows take the MoE prefill path: grouped, without host syncs, but not yet
        # captured in a CUDA graph on a GPU, so these steps stay eager
        moe_sync = e.cfg.is_moe and len(lanes) * (k + 1) > 16
        if moe_sync:
            e._eager_keys.update({("draft", key), ("verify", key)})
        drafts = e.run_step(("draft", key), self._draft, lanes_t, torch.tensor(tail_tokens, device=dev), first_t, rows_t)
        verify_tokens = torch.cat([torch.tensor(next_tokens, device=dev)[:, None], drafts], dim=1)
        positions = torch.tensor(held, device=dev)[:, None] + torch.arange(k + 1, device=dev)[None]
        e.ctx_len[lanes_t] = torch.tensor([L + k + 1 for L in held], device=dev, dtype=torch.int32)
        logits, hidden = e.run_step(("verify", key), self._verify, lanes_t, verify_tokens, positions)
        draft_rows = drafts.tolist()
        greedy = torch.argmax(logits, dim=-1).tolist()
        results = []
        for b, lane in enumerate(lanes):
            stops, p, cnt, g = (_per_lane(stop_ids, b), _per_lane(params, b), _per_lane(counts, b),
                                _per_lane(generator, b))
            emitted = []
            for i in range(k + 1):
                tok = greedy[b][i] if p is None else pick_token(logits[b, i], p, cnt, g)
                if self.forced_accept is not None:
                    if i < k:
                        d = draft_rows[b][i]
                        tok = d if i < self.forced_accept else (d + 1) % e.cfg.vocab_size
                emitted.append(tok)
                if tok in stops or len(emitted) >= budgets[b] or i == k or tok != draft_rows[b][i]:
                    break
            keep = len(emitted)  # verify rows now in the cache: next_token and the agreeing drafts
            self._commit(lane, held[b], keep, [next_tokens[b]] + emitted[:-1], hidden[b])
            self.stats.rounds += 1
            self.stats.drafted += k
            self.stats.accepted += keep - 1
            for i in range(keep - 1):
                self.stats.accepted_at[i] += 1
            e.stats.decode_tokens += keep
            results.append(emitted)
        return results

    def _commit(self, lane: int, held: int, keep: int, tokens: list[int], hidden: torch.Tensor) -> None:
        e = self.e
        e.ctx_len[lane] = held + keep
        e.lane_tokens[lane].extend(tokens)
        if keep < self.k + 1:  # roll the GDN state back to the snapshot after `keep` tokens
            e.conv_stack[:, lane, 0] = e.conv_stack[:, lane, keep]
            e.rec_stack[:, lane, 0] = e.rec_stack[:, lane, keep]
        self.tail[lane, :keep] = hidden[:keep].to(self.tail.dtype)
        self.start[lane] = held


def _per_lane(value, b: int):
    return value[b] if isinstance(value, list) else value
