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

import torch

from format.binding import mtp_layer_count

from .kernels.paged_attention import PAGE
from .kernels.rmsnorm import rmsnorm
from .speculate import Speculator
from .transfers import device_ints


class MtpState(Speculator):
    @classmethod
    def bind(cls, engine) -> "MtpState":
        self = cls(engine)
        e, c, mem, plan = engine, engine.cfg, engine.mem, engine.plan
        lanes = engine.lanes
        self.layers = mtp_layer_count(e.art.objects)
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

    def assume_context(self, lane: int, depth: int) -> None:
        """Benchmarks: the lane holds `depth` tokens (synthetic) and the MTP cache all but the last."""
        self.start[lane] = depth - 1
        self.ctx[lane] = depth - 1

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

    def prefill_outputs(self, rows: int) -> dict:
        """What the target forward of a prefill chunk hands back: its final-normed hidden rows."""
        return {"with_hidden": True}

    def absorb_prefill(self, lane: int, prompt: list[int], start: int, end: int, hidden: torch.Tensor) -> None:
        """After a target prefill chunk at [start, end): run the MTP layer over every row whose next
        token the prompt already gives; keep the chunk's last row in the tail."""
        e = self.e
        m = self.start[lane]
        rows = torch.cat([self.tail[lane, : start - m].to(hidden.dtype), hidden[:-1]]) if start > m else hidden[:-1]
        if end - 1 > m:
            lanes_t = device_ints([lane], e.device)
            self.ctx[lane] = end - 1
            toks = device_ints([prompt[m + 1 : end]], e.device)
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
        drafts = [self.propose(last)]
        for j in range(1, self.k):
            pos = first + rows + (j - 1)
            self.ctx[lanes_t] = (pos + 1).to(torch.int32)
            last = self._forward(j % self.layers, lanes_t, drafts[-1][:, None], last[:, None], pos[:, None])[:, 0]
            drafts.append(self.propose(last))
        return torch.stack(drafts, dim=1)

    def _verify(self, lanes_t, tokens, positions):
        return self.e.forward(lanes_t, tokens, positions, all_logits=True, snapshot=True, with_hidden=True)

    # --- one speculative round (Speculator.round) -------------------------------------------

    def _draft_block(self, lanes, lanes_t, held, next_tokens, key):
        e, k = self.e, self.k
        first = [self.start[lane] for lane in lanes]
        tail_tokens = []
        for lane, L, m, nxt in zip(lanes, held, first, next_tokens):
            toks = e.lane_tokens[lane][m + 1 : L] + [nxt]
            tail_tokens.append(toks + [0] * (k + 1 - len(toks)))
        b = len(lanes)
        rows = [L - m for L, m in zip(held, first)]
        ids = device_ints(rows + first + [t for row in tail_tokens for t in row], e.device)  # one copy, queued
        return e.run_step(("draft", key), self._draft, lanes_t, ids[2 * b :].view(b, k + 1), ids[b : 2 * b], ids[:b])

    def _commit_drafter(self, lane: int, b: int, held: int, keep: int, hidden: torch.Tensor) -> None:
        self.tail[lane, :keep] = hidden[b, :keep].to(self.tail.dtype)
        self.start[lane] = held
