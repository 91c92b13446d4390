"""The Qwen3.5 text decoder in plain torch, built from an artifact (dims come from its config)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from format.binding import load_config, require_runnable, token_limit
from format.container import Artifact
from format.model_config import ModelConfig

from . import reference_ops as ops
from .dequant import load_tensor


@dataclass
class LayerState:
    """Per-layer decode state: a growing KV cache (attention) or conv + recurrent state (GDN)."""

    k: torch.Tensor | None = None  # [S, Hkv, D]
    v: torch.Tensor | None = None
    conv: torch.Tensor | None = None  # [W-1, C]
    recurrent: torch.Tensor | None = None  # [Hv, Dk, Dv] float32


class ReferenceModel:
    """Dequantizes every weight at load and runs one sequence; the oracle for the fast runtime."""

    def __init__(self, artifact: Artifact, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
        require_runnable(artifact)
        self.cfg: ModelConfig = load_config(artifact)
        self.token_limit = token_limit(artifact, self.cfg.vocab_size)
        self.device = torch.device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.w: dict[str, torch.Tensor] = {}
        for name, e in artifact.objects.items():
            if e.kind == "tensor" and name.startswith("text/"):
                keep_fp32 = name.endswith(("gdn/a_log", "gdn/dt_bias"))
                self.w[name] = load_tensor(artifact, name, torch.float32 if keep_fp32 else self.dtype, self.device)

    def new_state(self) -> list[LayerState]:
        c = self.cfg
        states = []
        for i in range(c.num_layers):
            if c.is_full_attention(i):
                empty = torch.zeros(0, c.num_kv_heads, c.head_dim, dtype=self.dtype, device=self.device)
                states.append(LayerState(k=empty, v=empty.clone()))
            else:
                states.append(LayerState(
                    conv=torch.zeros(c.conv_kernel - 1, c.gdn_conv_dim, dtype=self.dtype, device=self.device),
                    recurrent=torch.zeros(c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
                                          dtype=torch.float32, device=self.device)))
        return states

    def _attention(self, i: int, x: torch.Tensor, st: LayerState, positions: torch.Tensor,
                   rope_positions: torch.Tensor) -> torch.Tensor:
        c, w, p = self.cfg, self.w, f"text/layers/{i}/attention/"
        t = x.shape[0]
        qgkv = x @ w[p + "query_gate_key_value"].t()
        qg, k, v = qgkv.split([c.q_gate_rows, c.kv_rows, c.kv_rows], dim=-1)
        qg = qg.view(t, c.num_heads, 2 * c.head_dim)
        q, gate = qg[..., : c.head_dim], qg[..., c.head_dim:].reshape(t, -1)
        q = ops.rms_norm_1p(q, w[p + "query_norm"], c.rms_norm_eps)
        k = ops.rms_norm_1p(k.view(t, c.num_kv_heads, c.head_dim), w[p + "key_norm"], c.rms_norm_eps)
        v = v.view(t, c.num_kv_heads, c.head_dim)
        cos, sin = ops.rope_cos_sin(rope_positions, c.rotary_dim, c.rope_theta, x.dtype, c.mrope_section)
        q, k = ops.apply_partial_rope(q, cos, sin), ops.apply_partial_rope(k, cos, sin)
        st.k, st.v = torch.cat([st.k, k]), torch.cat([st.v, v])
        out = ops.attention(q, st.k, st.v, positions, c.head_dim ** -0.5).reshape(t, -1)
        return (out * torch.sigmoid(gate)) @ w[p + "output"].t()

    def _gdn(self, i: int, x: torch.Tensor, st: LayerState) -> torch.Tensor:
        c, w, p = self.cfg, self.w, f"text/layers/{i}/gdn/"
        t = x.shape[0]
        qkvz = x @ w[p + "query_key_value_z"].t()
        qkv, z = qkvz.split([c.gdn_conv_dim, c.gdn_value_dim], dim=-1)
        qkv, st.conv = ops.causal_conv1d(qkv, st.conv, w[p + "convolution"])
        q, k, v = qkv.split([c.gdn_key_dim, c.gdn_key_dim, c.gdn_value_dim], dim=-1)
        hk, hv = c.linear_num_key_heads, c.linear_num_value_heads
        q = q.reshape(t, hk, -1).float().repeat_interleave(hv // hk, dim=1)
        k = k.reshape(t, hk, -1).float().repeat_interleave(hv // hk, dim=1)
        q = ops.l2_normalize(q) * c.linear_key_head_dim ** -0.5
        k = ops.l2_normalize(k)
        beta = torch.sigmoid(x @ w[p + "beta_projection"].t()).float()
        a = (x @ w[p + "alpha_projection"].t()).float()
        g = -w[p + "a_log"].exp() * torch.nn.functional.softplus(a + w[p + "dt_bias"])
        out, st.recurrent = ops.gated_delta_rule(q, k, v.reshape(t, hv, -1).float(), g, beta, st.recurrent)
        out = ops.gated_rms_norm(out.to(x.dtype), z.reshape(t, hv, -1), w[p + "norm"], c.rms_norm_eps)
        return out.reshape(t, -1) @ w[p + "output"].t()

    def _ffn(self, i: int, x: torch.Tensor) -> torch.Tensor:
        c, w, p = self.cfg, self.w, f"text/layers/{i}/"
        if not c.is_moe:
            return ops.swiglu_mlp(x, w[p + "mlp/gate_up"], w[p + "mlp/down"])
        m = p + "moe/"
        return ops.moe(x, w[m + "router"], w[m + "shared_gate"], w[m + "experts_gate_up"], w[m + "experts_down"],
                       w[m + "shared_gate_up"], w[m + "shared_down"], c.experts_per_token)

    @torch.no_grad()
    def forward(self, token_ids: torch.Tensor, state: list[LayerState], start: int,
                image_embeds: torch.Tensor | None = None, image_token: int | None = None,
                rope_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Run tokens at positions start.. through the decoder; returns float32 logits [T, vocab].
        Rows holding `image_token` take `image_embeds` (in order); `rope_positions` ([3, T], MRoPE)
        replace the token positions for rotary embedding only."""
        c, w = self.cfg, self.w
        positions = torch.arange(start, start + token_ids.shape[0], device=self.device)
        token_ids = token_ids.to(self.device)
        x = w["text/token_embedding"][token_ids]
        if image_embeds is not None:
            x = x.clone()
            x[token_ids == image_token] = image_embeds.to(x.dtype)
        rope = positions if rope_positions is None else rope_positions.to(self.device)
        for i in range(c.num_layers):
            p = f"text/layers/{i}/"
            h = ops.rms_norm_1p(x, w[p + "input_norm"], c.rms_norm_eps)
            mixed = self._attention(i, h, state[i], positions, rope) if c.is_full_attention(i) else self._gdn(i, h, state[i])
            x = x + mixed
            x = x + self._ffn(i, ops.rms_norm_1p(x, w[p + "post_attention_norm"], c.rms_norm_eps))
        x = ops.rms_norm_1p(x, w["text/final_norm"], c.rms_norm_eps)
        logits = (x @ w["text/output_head"].t()).float()
        logits[..., self.token_limit :] = float("-inf")  # padded head rows are no tokens
        return logits

    def generate(self, prompt_ids: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] = (),
                 images=None, vision=None) -> list[int]:
        """Greedy decoding; returns only the new tokens. `images` (ImageInput, placeholders already
        expanded in `prompt_ids`) go through `vision` (a runtime.vision.VisionTower)."""
        if not prompt_ids:
            raise ValueError("the prompt is empty; give at least one token")
        state = self.new_state()
        delta, extra = 0, {}
        if images:
            from .vision import mrope_positions

            rope, delta = mrope_positions(prompt_ids, images, vision.ids.image, vision.cfg.spatial_merge_size)
            extra = {"image_embeds": torch.cat([vision.encode(i) for i in images]), "image_token": vision.ids.image,
                     "rope_positions": rope}
        logits = self.forward(torch.tensor(prompt_ids), state, 0, **extra)
        out: list[int] = []
        pos = len(prompt_ids)
        for _ in range(max_new_tokens):
            nxt = int(torch.argmax(logits[-1]))
            out.append(nxt)
            if nxt in stop_ids:
                break
            rope = {"rope_positions": torch.tensor([pos + delta])} if delta else {}
            logits = self.forward(torch.tensor([nxt]), state, pos, **rope)
            pos += 1
        return out
