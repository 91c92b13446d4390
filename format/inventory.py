"""Storage contract of the Qwen3.5 family: object names, shapes, roles and their HF sources.

One function, `text_inventory`, derives every object the text decoder (and the MTP head)
needs from the config alone; convert writes exactly these objects and the runtime binder
checks an artifact against exactly these objects (specs/inventory.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from .model_config import DFlash2Config, ModelConfig

# Roles whose format is fixed regardless of recipe.
FIXED_ROLE_FORMATS = {"norm": "BF16", "conv": "BF16", "router": "BF16", "small": "BF16", "fp32": "FP32", "ids": "I32"}
MATRIX_ROLES = (
    "embedding", "head", "attn_in", "attn_out", "gdn_in", "gdn_out", "mlp_up", "mlp_down",
    "expert_up", "expert_down", "shared_up", "shared_down", "mtp_fc", "draft_head", "companion_matrix",
)


@dataclass(frozen=True)
class SourcePart:
    """Rows taken from one HF tensor: the whole tensor, one expert slice of a 3-D tensor,
    or a [C, 1, W] depthwise conv kernel squeezed to [C, W]."""

    key: str
    index: int | None = None
    squeeze_conv: bool = False


@dataclass(frozen=True)
class ObjectSpec:
    name: str
    shape: tuple[int, ...]
    role: str
    component: str
    parts: tuple[SourcePart, ...]


@dataclass(frozen=True)
class SourceNames:
    """Where the text weights live in a particular HF checkpoint."""

    text_prefix: str  # e.g. "model.language_model."
    head_key: str  # "lm_head.weight", or the embedding key when tied
    fused_experts: bool  # experts stored as 3-D gate_up_proj/down_proj tensors


def _attention(cfg: ModelConfig, obj: str, src: str, comp: str) -> list[ObjectSpec]:
    h, d = cfg.hidden_size, cfg.head_dim
    return [
        ObjectSpec(f"{obj}attention/query_gate_key_value", (cfg.q_gate_rows + 2 * cfg.kv_rows, h), "attn_in", comp,
                   (SourcePart(f"{src}self_attn.q_proj.weight"), SourcePart(f"{src}self_attn.k_proj.weight"),
                    SourcePart(f"{src}self_attn.v_proj.weight"))),
        ObjectSpec(f"{obj}attention/query_norm", (d,), "norm", comp, (SourcePart(f"{src}self_attn.q_norm.weight"),)),
        ObjectSpec(f"{obj}attention/key_norm", (d,), "norm", comp, (SourcePart(f"{src}self_attn.k_norm.weight"),)),
        ObjectSpec(f"{obj}attention/output", (h, cfg.num_heads * d), "attn_out", comp,
                   (SourcePart(f"{src}self_attn.o_proj.weight"),)),
    ]


def _gdn(cfg: ModelConfig, obj: str, src: str) -> list[ObjectSpec]:
    h, hv = cfg.hidden_size, cfg.linear_num_value_heads
    la = f"{src}linear_attn."
    return [
        ObjectSpec(f"{obj}gdn/query_key_value_z", (cfg.gdn_conv_dim + cfg.gdn_value_dim, h), "gdn_in", "text",
                   (SourcePart(f"{la}in_proj_qkv.weight"), SourcePart(f"{la}in_proj_z.weight"))),
        ObjectSpec(f"{obj}gdn/beta_projection", (hv, h), "small", "text", (SourcePart(f"{la}in_proj_b.weight"),)),
        ObjectSpec(f"{obj}gdn/alpha_projection", (hv, h), "small", "text", (SourcePart(f"{la}in_proj_a.weight"),)),
        ObjectSpec(f"{obj}gdn/convolution", (cfg.gdn_conv_dim, cfg.conv_kernel), "conv", "text",
                   (SourcePart(f"{la}conv1d.weight", squeeze_conv=True),)),
        ObjectSpec(f"{obj}gdn/a_log", (hv,), "fp32", "text", (SourcePart(f"{la}A_log"),)),
        ObjectSpec(f"{obj}gdn/dt_bias", (hv,), "fp32", "text", (SourcePart(f"{la}dt_bias"),)),
        ObjectSpec(f"{obj}gdn/norm", (cfg.linear_value_head_dim,), "norm", "text", (SourcePart(f"{la}norm.weight"),)),
        ObjectSpec(f"{obj}gdn/output", (h, cfg.gdn_value_dim), "gdn_out", "text", (SourcePart(f"{la}out_proj.weight"),)),
    ]


def _ffn(cfg: ModelConfig, obj: str, src: str, comp: str, names: SourceNames) -> list[ObjectSpec]:
    h = cfg.hidden_size
    m = f"{src}mlp."
    if not cfg.is_moe:
        i = cfg.intermediate_size
        return [
            ObjectSpec(f"{obj}mlp/gate_up", (2 * i, h), "mlp_up", comp,
                       (SourcePart(f"{m}gate_proj.weight"), SourcePart(f"{m}up_proj.weight"))),
            ObjectSpec(f"{obj}mlp/down", (h, i), "mlp_down", comp, (SourcePart(f"{m}down_proj.weight"),)),
        ]
    e, i, s = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    if names.fused_experts:
        # HF fused form: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]
        up_parts = tuple(SourcePart(f"{m}experts.gate_up_proj", index=x) for x in range(e))
        down_parts = tuple(SourcePart(f"{m}experts.down_proj", index=x) for x in range(e))
    else:
        up_parts = tuple(
            p for x in range(e)
            for p in (SourcePart(f"{m}experts.{x}.gate_proj.weight"), SourcePart(f"{m}experts.{x}.up_proj.weight"))
        )
        down_parts = tuple(SourcePart(f"{m}experts.{x}.down_proj.weight") for x in range(e))
    return [
        ObjectSpec(f"{obj}moe/router", (e, h), "router", comp, (SourcePart(f"{m}gate.weight"),)),
        ObjectSpec(f"{obj}moe/shared_gate", (1, h), "router", comp, (SourcePart(f"{m}shared_expert_gate.weight"),)),
        # row e*2I + p*I + r, p = 0 gate, 1 up
        ObjectSpec(f"{obj}moe/experts_gate_up", (e * 2 * i, h), "expert_up", comp, up_parts),
        # row e*H + h
        ObjectSpec(f"{obj}moe/experts_down", (e * h, i), "expert_down", comp, down_parts),
        ObjectSpec(f"{obj}moe/shared_gate_up", (2 * s, h), "shared_up", comp,
                   (SourcePart(f"{m}shared_expert.gate_proj.weight"), SourcePart(f"{m}shared_expert.up_proj.weight"))),
        ObjectSpec(f"{obj}moe/shared_down", (h, s), "shared_down", comp,
                   (SourcePart(f"{m}shared_expert.down_proj.weight"),)),
    ]


def _layer(cfg: ModelConfig, obj: str, src: str, full: bool, comp: str, names: SourceNames) -> list[ObjectSpec]:
    h = cfg.hidden_size
    specs = [ObjectSpec(f"{obj}input_norm", (h,), "norm", comp, (SourcePart(f"{src}input_layernorm.weight"),))]
    specs += _attention(cfg, obj, src, comp) if full else _gdn(cfg, obj, src)
    specs.append(ObjectSpec(f"{obj}post_attention_norm", (h,), "norm", comp,
                            (SourcePart(f"{src}post_attention_layernorm.weight"),)))
    specs += _ffn(cfg, obj, src, comp, names)
    return specs


def text_inventory(cfg: ModelConfig, names: SourceNames) -> list[ObjectSpec]:
    v, h, p = cfg.vocab_size, cfg.hidden_size, names.text_prefix
    specs = [ObjectSpec("text/token_embedding", (v, h), "embedding", "text", (SourcePart(f"{p}embed_tokens.weight"),))]
    for i in range(cfg.num_layers):
        specs += _layer(cfg, f"text/layers/{i}/", f"{p}layers.{i}.", cfg.is_full_attention(i), "text", names)
    specs.append(ObjectSpec("text/final_norm", (h,), "norm", "text", (SourcePart(f"{p}norm.weight"),)))
    specs.append(ObjectSpec("text/output_head", (v, h), "head", "text", (SourcePart(names.head_key),)))
    return specs


def mtp_inventory(cfg: ModelConfig, names: SourceNames, layers: int) -> list[ObjectSpec]:
    h = cfg.hidden_size
    specs = [
        ObjectSpec("mtp/input_projection", (h, 2 * h), "mtp_fc", "mtp", (SourcePart("mtp.fc.weight"),)),
        ObjectSpec("mtp/embedding_norm", (h,), "norm", "mtp", (SourcePart("mtp.pre_fc_norm_embedding.weight"),)),
        ObjectSpec("mtp/hidden_norm", (h,), "norm", "mtp", (SourcePart("mtp.pre_fc_norm_hidden.weight"),)),
    ]
    for j in range(layers):
        specs += _layer(cfg, f"mtp/layers/{j}/", f"mtp.layers.{j}.", True, "mtp", names)
    specs.append(ObjectSpec("mtp/final_norm", (h,), "norm", "mtp", (SourcePart("mtp.norm.weight"),)))
    return specs


def required_text_names(cfg: ModelConfig) -> dict[str, ObjectSpec]:
    """The text objects an artifact must hold for this config (source names are irrelevant here)."""
    names = SourceNames("", "", False)
    return {s.name: s for s in text_inventory(cfg, names)}


def required_mtp_names(cfg: ModelConfig, layers: int) -> dict[str, ObjectSpec]:
    return {s.name: s for s in mtp_inventory(cfg, SourceNames("", "", False), layers)}


def dflash2_inventory(d: DFlash2Config) -> list[ObjectSpec]:
    """The DFlash2 drafter's objects, from its config; sources are the drafter checkpoint's keys. The
    drafter has no embedding or head of its own: it uses the target's."""
    h, hd, comp = d.hidden_size, d.head_dim, "dflash2"

    def spec(name, shape, role, *keys):
        return ObjectSpec(f"dflash2/{name}", shape, role, comp, tuple(SourcePart(k) for k in keys))

    specs = [spec("feature_projection", (h, d.tap_width), "companion_matrix", "fc.weight"),
             spec("context_norm", (h,), "norm", "hidden_norm.weight")]
    for i in range(d.num_layers):
        o, s = f"layers/{i}/", f"layers.{i}."
        a = f"{s}self_attn."
        specs += [
            spec(o + "input_norm", (h,), "norm", s + "input_layernorm.weight"),
            spec(o + "attention/query_key_value", (d.num_heads * hd + 2 * d.kv_rows, h), "companion_matrix",
                 a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
            spec(o + "attention/query_norm", (hd,), "norm", a + "q_norm.weight"),
            spec(o + "attention/key_norm", (hd,), "norm", a + "k_norm.weight"),
            spec(o + "attention/output", (h, d.num_heads * hd), "companion_matrix", a + "o_proj.weight"),
            spec(o + "post_attention_norm", (h,), "norm", s + "post_attention_layernorm.weight"),
            spec(o + "mlp/gate_up", (2 * d.intermediate_size, h), "companion_matrix",
                 s + "mlp.gate_proj.weight", s + "mlp.up_proj.weight"),
            spec(o + "mlp/down", (h, d.intermediate_size), "companion_matrix", s + "mlp.down_proj.weight"),
        ]
        for conv in ("attention_conv", "mlp_conv"):
            specs += [spec(f"{o}{conv}/base_kernel", (2, d.conv_kernel_size, h), "small", f"{s}{conv}.base_kernel"),
                      spec(f"{o}{conv}/kernel_projection", (2 * d.conv_kernel_size * d.conv_groups, h), "small",
                           f"{s}{conv}.kernel_projection.weight")]
    r, v = d.selector_rank, d.vocab_size
    specs += [spec("final_norm", (h,), "norm", "norm.weight"),
              spec("candidate_selector/hidden_projection", (r, h), "small", "candidate_selector.hidden_projection.weight"),
              spec("candidate_selector/predecessor_codebook", (v, r), "small", "candidate_selector.predecessor_codebook"),
              spec("candidate_selector/successor_codebook", (v, r), "small", "candidate_selector.successor_codebook")]
    return specs


DFLASH2_CONFIG = "dflash2/config.json"
RESOURCE_NAMES = {
    "config": "resource/config.json",
    "generation_config": "resource/generation_config.json",
    "tokenizer": "resource/tokenizer.json",
    "tokenizer_config": "resource/tokenizer_config.json",
    "chat_template": "resource/chat_template.jinja",
    "preprocessor_config": "resource/preprocessor_config.json",
}
DRAFT_HEAD = "lm_head_draft/head"
DRAFT_TOKEN_IDS = "lm_head_draft/token_ids"
