"""DFlash2 speculative decoding: a block-diffusion drafter proposes K tokens in one forward pass.

The drafter (`dflash2/*` objects, config in `dflash2/config.json`; format/inventory.py) is a few
Qwen3-style layers over a block of K+1 rows [next token, MASK x K] at positions p..p+K. It never sees
tokens of the context: its attention reads context K/V projected from the *target's* hidden states at
the tapped layers (`target_layer_ids`), concatenated, through `feature_projection` and `context_norm`,
then each layer's own key/value rows (keys normed and rotated at their positions). Attention is
non-causal inside the block and slides over the last `sliding_window` positions. Each layer wraps its
attention and its MLP in a dynamic short convolution along the block: per row, taps = a learned base
kernel plus a per-channel-group delta projected from the sublayer input (one projection, two sides:
the input side before the sublayer, the output side after it). The final-normed rows 1..K go through
the target's head; the candidate selector then takes the top-k tokens per row and walks them greedily,
scoring each candidate by its logit plus a bigram term: <predecessor_codebook[previous] * projected
hidden row, successor_codebook[candidate]>, starting from the block's first token.

State per lane: each drafter layer's context K/V in a cyclic window of `sliding_window` slots plus a
spare slot that takes the writes of rejected rows, and the target position each slot holds (-1 when
empty). Attention masks a slot unless its position is below the lane's committed end and inside the
window, so a stale slot (a longer previous turn, a restored checkpoint) is never read. A round's
verify forward taps the target at all K+1 rows; the accepted rows are projected at the start of the
next draft (inside its CUDA graph), so the host never waits for them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from format.binding import load_dflash2_config

from .kernels.block_conv import block_conv, block_conv_reference
from .kernels.head_norm_rope import head_norm_rope, head_norm_rope_reference
from .kernels.selector_walk import selector_walk, selector_walk_reference
from .reference_ops import rope_cos_sin
from .speculate import Speculator
from .switches import setting
from .transfers import device_ints

# the drafter's small ops: the plain-torch ones, or with NINFER_DFLASH2_KERNELS=fused each dynamic convolution in one
# launch (block_conv, the residual add and the next product's dtype inside; ~9 torch launches a call, four calls a
# layer), each query / key norm + RoPE in one (head_norm_rope; ~8 torch launches a call, two a layer in the block
# and one a layer in the context write) and the candidate selector's walk in one (selector_walk; ~10 a draft row):
# ~370 of a DFlash2 K = 7 round's ~580 torch launches (1.31 ms on an H100, eager). Default since session 37 (H100,
# DFlash2 K = 7, drafts forced accepted, --draft-vocab 32768, torch / fused alternated twice in one warm call): one
# lane 13.09 / 13.31 -> 12.22 / 12.23 ms a round, 611.2 / 601.3 -> 654.7 / 653.9 tok/s (4.72 / 4.61x -> 5.01 /
# 5.00x plain decode); 2 lanes 973 / 1,005 -> 1,043 / 1,051 tok/s. NINFER_DFLASH2_KERNELS=torch restores the ops.
DRAFTER_KERNELS = setting("NINFER_DFLASH2_KERNELS")


class DFlash2State(Speculator):
    @classmethod
    def bind(cls, engine) -> "DFlash2State":
        self = cls(engine)
        e, mem = engine, engine.mem
        d = self.d = load_dflash2_config(e.art)
        lanes, slots = engine.lanes, d.sliding_window + 1
        self.window = d.sliding_window
        self.taps = d.target_layer_ids
        self.keys = mem.view("sequence_state", "dflash2_context_keys", torch.bfloat16,
                             (d.num_layers, lanes, slots, d.num_kv_heads, d.head_dim))
        self.values = mem.view("sequence_state", "dflash2_context_values", torch.bfloat16,
                               (d.num_layers, lanes, slots, d.num_kv_heads, d.head_dim))
        self.slot_positions = mem.view("sequence_state", "dflash2_context_positions", torch.int32, (lanes, slots))
        self.pending = mem.view("sequence_state", "dflash2_pending_taps", torch.bfloat16,
                                (lanes, self.k + 1, d.tap_width))
        # per lane: first position of the pending (verified) rows, how many of them were accepted, and the
        # end of the committed context (positions below it are in the cache or out of the window)
        counters = mem.view("sequence_state", "dflash2_counters", torch.int32, (3, lanes))
        self.pending_start, self.pending_keep, self.context_end = counters[0], counters[1], counters[2]
        for t in (self.keys, self.values, self.pending, counters):
            t.zero_()  # finite values in slots a masked read still multiplies
        self.slot_positions.fill_(-1)
        self.current = [True] * lanes
        self.pending_rows = [0] * lanes  # host copy of pending_keep

        def lin(name):
            return e.lin[f"dflash2/{name}"]

        def f32(name):  # plain RMSNorm weights, conv base kernels: small, kept in float32
            return e.vec[f"dflash2/{name}"].float()

        q_rows = d.num_heads * d.head_dim
        self.layers = []
        for j in range(d.num_layers):
            p = f"layers/{j}/"
            qkv = lin(p + "attention/query_key_value")
            self.layers.append({
                "input_norm": f32(p + "input_norm"), "post_norm": f32(p + "post_attention_norm"),
                "qkv": qkv, "kv": qkv.rows(q_rows, q_rows + 2 * d.kv_rows),
                "q_norm": f32(p + "attention/query_norm"), "k_norm": f32(p + "attention/key_norm"),
                "out": lin(p + "attention/output"), "gate_up": lin(p + "mlp/gate_up"), "down": lin(p + "mlp/down"),
                "attn_conv": (lin(p + "attention_conv/kernel_projection"), f32(p + "attention_conv/base_kernel")),
                "mlp_conv": (lin(p + "mlp_conv/kernel_projection"), f32(p + "mlp_conv/base_kernel")),
            })
        self.feature_projection = lin("feature_projection")
        self.context_norm = f32("context_norm")
        self.final_norm = f32("final_norm")
        self.selector_projection = lin("candidate_selector/hidden_projection")
        self.predecessors = e.vec["dflash2/candidate_selector/predecessor_codebook"]
        self.successors = e.vec["dflash2/candidate_selector/successor_codebook"]
        return self

    # --- lane bookkeeping --------------------------------------------------------------

    def _set_context(self, lane: int, end: int) -> None:
        self.pending_rows[lane] = 0
        self.pending_start[lane] = end
        self.pending_keep[lane] = 0
        self.context_end[lane] = end
        self.current[lane] = True

    def reset_lane(self, lane: int) -> None:
        self.slot_positions[lane] = -1
        self._set_context(lane, 0)

    def save_checkpoint(self, lane: int) -> None:
        """Nothing to save: slots past a restored checkpoint hold positions beyond the committed end,
        which attention masks until the new turn overwrites them."""

    def restore_checkpoint(self, lane: int, held: int) -> None:
        self._set_context(lane, held)

    def mark_stale(self, lane: int) -> None:
        self.current[lane] = False

    def is_current(self, lane: int) -> bool:
        return self.current[lane]

    def assume_context(self, lane: int, depth: int) -> None:
        """Benchmarks: the lane holds `depth` tokens (synthetic); the window's slots count as filled."""
        first = max(0, depth - self.window)
        pos = torch.arange(first, depth, device=self.e.device, dtype=torch.int32)
        self.slot_positions[lane, (pos % self.window).long()] = pos
        self._set_context(lane, depth)

    # --- target side -------------------------------------------------------------------

    def prefill_outputs(self, rows: int) -> dict:
        """What the target forward of a prefill chunk hands back: the tapped rows of its last window."""
        return {"taps": self.taps, "tap_rows": min(rows, self.window)}

    def absorb_prefill(self, lane: int, prompt: list[int], start: int, stop: int, tapped: torch.Tensor) -> None:
        """After a target prefill chunk [start, stop): project its tapped rows (the chunk's last ones, at
        most a window) into the context cache. A continued conversation first commits the rows its last
        round accepted (they precede `start`)."""
        lane_t = device_ints([lane], self.e.device)
        if self.pending_rows[lane]:
            self.commit_pending(lane_t)
        rows = tapped.shape[0]
        pos = torch.arange(stop - rows, stop, device=self.e.device)[None]
        self._write_context(lane_t, tapped, pos, None)
        self._set_context(lane, stop)

    def _verify(self, lanes_t, tokens, positions):
        logits, tapped = self.e.forward(lanes_t, tokens, positions, all_logits=True, snapshot=True, taps=self.taps)
        self.pending[lanes_t] = tapped.to(self.pending.dtype)
        return logits, None

    def _commit_drafter(self, lane: int, b: int, held: int, keep: int, aux) -> None:
        self.pending_start[lane] = held
        self.pending_keep[lane] = keep
        self.pending_rows[lane] = keep

    # --- the drafter -------------------------------------------------------------------

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), weight, self.d.rms_norm_eps)

    def _write_context(self, lanes_t, tapped, positions, valid) -> None:
        """Tapped target rows [N*R, taps*H] of lanes_t at positions [N, R] -> every layer's context K/V;
        rows where `valid` is False land in the spare slot."""
        d, act = self.d, self.e.act_dtype
        n, r = positions.shape
        ctx = self._norm(self.feature_projection(tapped.reshape(n * r, -1).to(act).contiguous()), self.context_norm)
        ctx = ctx.to(act)
        slot = positions % self.window
        if valid is not None:
            slot = torch.where(valid, slot, self.window)
        lane_idx = lanes_t[:, None].expand(n, r)
        tables = rope_cos_sin(positions.reshape(-1), d.head_dim, d.rope_theta, torch.float32)
        for j, layer in enumerate(self.layers):
            kv = layer["kv"](ctx).float()
            k = self._norm_rope(kv[:, : d.kv_rows], d.num_kv_heads, layer["k_norm"], tables)
            self.keys[j][lane_idx, slot] = k.view(n, r, d.num_kv_heads, d.head_dim).to(self.keys.dtype)
            self.values[j][lane_idx, slot] = kv[:, d.kv_rows :].reshape(n, r, d.num_kv_heads, d.head_dim).to(
                self.values.dtype)
        self.slot_positions[lane_idx, slot] = positions.to(torch.int32)

    def _conv(self, x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, residual: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dynamic short convolution along each lane's block, causal inside it (block_conv, one launch): x [N, B, H]
        float32, delta [N, B, taps, groups] (per row and channel group), base [taps, H]; plus `residual`."""
        if DRAFTER_KERNELS == "torch":  # the reference's ~9 launches a call
            return block_conv_reference(x, delta, base, self.d.conv_group_size, residual).to(out_dtype or x.dtype)
        return block_conv(x, delta, base, self.d.conv_group_size, residual, out_dtype)

    def _norm_rope(self, rows: torch.Tensor, heads: int, weight: torch.Tensor, tables) -> torch.Tensor:
        """Heads of `rows` [T, heads * D] (a column range of a projection) RMS-normed, then rotated: [T, heads, D]
        float32."""
        norm_rope = head_norm_rope_reference if DRAFTER_KERNELS == "torch" else head_norm_rope  # ~8 launches / one
        return norm_rope(rows, heads, weight, self.d.rms_norm_eps, *tables)

    def _attention_mask(self, lanes_t, qpos) -> torch.Tensor:
        """Which keys each block row reads, [N, 1, B, W + B]: context slots holding a committed position
        inside the row's window, then every row of its block (non-causal). The same for every layer."""
        n, b = qpos.shape
        w = self.window
        held = self.slot_positions[lanes_t, :w]  # [N, W]
        ok = (held >= 0) & (held < self.context_end[lanes_t][:, None])
        ok = ok[:, None, :] & (qpos[:, :, None] - held[:, None, :] < w)  # [N, B, W]
        return torch.cat([ok, torch.ones(n, b, b, dtype=torch.bool, device=ok.device)], dim=2)[:, None]

    def _attend(self, j: int, lanes_t, q, k, v, mask) -> torch.Tensor:
        """Block queries [N, B, Hq, D] over the lane's context slots and the whole block (non-causal)."""
        d, act = self.d, self.e.act_dtype
        n, b = q.shape[:2]
        w = self.window
        keys = torch.cat([self.keys[j][lanes_t, :w].to(act), k.to(act)], dim=1).transpose(1, 2)  # [N, Hkv, W+B, D]
        values = torch.cat([self.values[j][lanes_t, :w].to(act), v.to(act)], dim=1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.to(act).transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(n * b, d.num_heads * d.head_dim)

    def block_hidden(self, lanes_t, anchors, starts) -> torch.Tensor:
        """The drafter over blocks [anchor, MASK x K] at positions starts..starts+K: final-normed rows
        [N, K+1, H] float32 (row 0, the anchor's, is not a proposal)."""
        d, e, act = self.d, self.e, self.e.act_dtype
        n, b = anchors.shape[0], self.k + 1
        ids = torch.full((n, b), d.mask_token_id, dtype=torch.long, device=anchors.device)
        ids[:, 0] = anchors
        h = e.embed(ids.reshape(-1)).float() * d.input_embedding_scale
        qpos = starts[:, None].long() + torch.arange(b, device=anchors.device)[None]
        tables = rope_cos_sin(qpos.reshape(-1), d.head_dim, d.rope_theta, torch.float32)  # shared by all layers
        mask = self._attention_mask(lanes_t, qpos)
        shape = (n, b, 2, d.conv_kernel_size, d.conv_groups)
        q_rows = d.num_heads * d.head_dim
        for j, layer in enumerate(self.layers):
            projection, base = layer["attn_conv"]
            x = self._norm(h, layer["input_norm"])
            delta = projection(x.to(act)).float().view(shape)
            x = self._conv(x.view(n, b, -1), delta[:, :, 0], base[0], out_dtype=act).view(n * b, -1)
            qkv = layer["qkv"](x).float()
            q = self._norm_rope(qkv[:, :q_rows], d.num_heads, layer["q_norm"], tables)
            k = self._norm_rope(qkv[:, q_rows : q_rows + d.kv_rows], d.num_kv_heads, layer["k_norm"], tables)
            v = qkv[:, q_rows + d.kv_rows :].reshape(n * b, d.num_kv_heads, d.head_dim)
            mixed = self._attend(j, lanes_t, q.view(n, b, d.num_heads, d.head_dim),
                                 k.view(n, b, d.num_kv_heads, d.head_dim), v.view(n, b, d.num_kv_heads, d.head_dim), mask)
            out = layer["out"](mixed.to(act)).float().view(n, b, -1)
            h = self._conv(out, delta[:, :, 1], base[1], residual=h.view(n, b, -1)).view(n * b, -1)
            projection, base = layer["mlp_conv"]
            x = self._norm(h, layer["post_norm"])
            delta = projection(x.to(act)).float().view(shape)
            x = self._conv(x.view(n, b, -1), delta[:, :, 0], base[0], out_dtype=act).view(n * b, -1)
            gate, up = layer["gate_up"](x).float().chunk(2, dim=-1)
            out = layer["down"]((F.silu(gate) * up).to(act)).float().view(n, b, -1)
            h = self._conv(out, delta[:, :, 1], base[1], residual=h.view(n, b, -1)).view(n * b, -1)
        return self._norm(h, self.final_norm).view(n, b, -1)

    def select(self, hidden: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """Candidate selector over proposal rows hidden [N, K, H]: top-k tokens per row from the head,
        then a greedy walk scored by logit + bigram term, starting from each lane's anchor. -> [N, K]."""
        d, act = self.d, self.e.act_dtype
        n, k = hidden.shape[:2]
        rows = hidden.reshape(n * k, -1).to(act)
        ids, logits = self.proposal_logits(rows)
        unary, columns = torch.topk(logits, min(d.selector_top_k, logits.shape[-1]), dim=-1)
        candidates = (ids[columns].long() if ids is not None else columns).view(n, k, -1)
        unary = unary.view(n, k, -1)
        projected = self.selector_projection(rows).float().view(n, k, -1)
        walk = selector_walk_reference if DRAFTER_KERNELS == "torch" else selector_walk  # ~10 launches a row / one
        return walk(unary, candidates, projected, self.predecessors, self.successors, anchors)

    def commit_pending(self, lanes_t) -> None:
        """Project the previous round's accepted verify rows into the context cache (rejected rows go to
        the spare slot) and move the lanes' committed end past them."""
        steps = torch.arange(self.k + 1, device=lanes_t.device)
        positions = self.pending_start[lanes_t][:, None].long() + steps[None]
        valid = steps[None] < self.pending_keep[lanes_t][:, None]
        self._write_context(lanes_t, self.pending[lanes_t], positions, valid)
        self.context_end[lanes_t] = self.pending_start[lanes_t] + self.pending_keep[lanes_t]

    def _draft(self, lanes_t, anchors, starts):
        """One draft step (a CUDA graph per batch size): commit the previous round's accepted rows, then
        run the block and select K drafts [N, K]."""
        self.commit_pending(lanes_t)
        hidden = self.block_hidden(lanes_t, anchors, starts)
        return self.select(hidden[:, 1:], anchors)

    def _draft_block(self, lanes, lanes_t, held, next_tokens, key):
        dev = self.e.device
        ids = device_ints([list(next_tokens), held], dev)
        return self.e.run_step(("draft", key), self._draft, lanes_t, ids[0], ids[1])
