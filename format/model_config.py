"""The model description carried in an artifact's config resource (HF config.json), as typed dims."""

from __future__ import annotations

import json
from dataclasses import dataclass

from .errors import ConvertError

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe")
_TEXT_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    conv_kernel: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    intermediate_size: int = 0  # dense MLP
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    mtp_layers: int = 0
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    has_vision: bool = False
    mrope_section: tuple[int, ...] = (11, 11, 10)  # frequency pairs per (t, h, w) axis, interleaved

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_full_attention(self, layer: int) -> bool:
        return self.layer_types[layer] == "full_attention"

    @property
    def q_gate_rows(self) -> int:
        return self.num_heads * self.head_dim * 2

    @property
    def kv_rows(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf_dict(cls, cfg: dict, generation_config: dict | None = None) -> "ModelConfig":
        top_type = cfg.get("model_type")
        text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
        model_type = _TEXT_TYPES.get(text.get("model_type"), top_type)
        if model_type in _TEXT_TYPES:
            model_type = _TEXT_TYPES[model_type]
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConvertError(
                f"config model_type {top_type!r} is not a Qwen3.5-family checkpoint (need qwen3_5 or qwen3_5_moe)"
            )

        def need(key):
            if key not in text:
                raise ConvertError(f"config.json lacks text field {key!r}")
            return text[key]

        n_layers = int(need("num_hidden_layers"))
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
        if len(layer_types) != n_layers or any(t not in ("full_attention", "linear_attention") for t in layer_types):
            raise ConvertError("config layer_types must list full_attention/linear_attention for every layer")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
        prf = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        eos = text.get("eos_token_id", cfg.get("eos_token_id"))
        if generation_config and generation_config.get("eos_token_id") is not None:
            eos = generation_config["eos_token_id"]
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        hidden = int(need("hidden_size"))
        n_heads = int(need("num_attention_heads"))
        common = dict(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            num_layers=n_layers,
            layer_types=tuple(layer_types),
            num_heads=n_heads,
            num_kv_heads=int(need("num_key_value_heads")),
            head_dim=int(text.get("head_dim") or hidden // n_heads),
            linear_num_key_heads=int(need("linear_num_key_heads")),
            linear_num_value_heads=int(need("linear_num_value_heads")),
            linear_key_head_dim=int(need("linear_key_head_dim")),
            linear_value_head_dim=int(need("linear_value_head_dim")),
            conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            partial_rotary_factor=float(prf),
            mtp_layers=int(text.get("mtp_num_hidden_layers", 0) or 0),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            eos_token_ids=eos_ids,
            has_vision=isinstance(cfg.get("vision_config"), dict),
            mrope_section=tuple(int(x) for x in rope.get("mrope_section", (11, 11, 10))),
        )
        if model_type == "qwen3_5_moe":
            return cls(
                **common,
                num_experts=int(need("num_experts")),
                experts_per_token=int(need("num_experts_per_tok")),
                moe_intermediate_size=int(need("moe_intermediate_size")),
                shared_expert_intermediate_size=int(need("shared_expert_intermediate_size")),
            )
        return cls(**common, intermediate_size=int(need("intermediate_size")))

    @classmethod
    def from_json_bytes(cls, data: bytes, generation_config: bytes | None = None) -> "ModelConfig":
        try:
            cfg = json.loads(data)
            gen = json.loads(generation_config) if generation_config else None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConvertError(f"config resource is not valid JSON: {exc}") from None
        if not isinstance(cfg, dict):
            raise ConvertError("config resource must be a JSON object")
        return cls.from_hf_dict(cfg, gen)


DFLASH2_ARCHITECTURE = "DFlash2DraftModel"


@dataclass(frozen=True)
class DFlash2Config:
    """A DFlash2 block-diffusion drafter (HF config.json of e.g. incoai/Qwen3.8-27B-DFlash2): Qwen3-style
    layers with non-causal sliding attention over context K/V projected from target hidden states, two
    dynamic short convolutions per layer, and a bigram candidate selector. Draft-specific fields may sit
    in `dflash_config` or at the top level (`dflash_config` wins)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    sliding_window: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int
    input_embedding_scale: float = 1.0

    @property
    def conv_groups(self) -> int:
        return self.hidden_size // self.conv_group_size

    @property
    def kv_rows(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def tap_width(self) -> int:
        """Columns of the feature projection's input: one hidden row per tapped target layer."""
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "DFlash2Config":
        if not isinstance(cfg, dict):
            raise ConvertError("the DFlash2 drafter config must be a JSON object")
        arch = cfg.get("architectures") or []
        if DFLASH2_ARCHITECTURE not in arch:
            raise ConvertError(f"the drafter config names architectures {arch}, not {DFLASH2_ARCHITECTURE}; "
                               "--dflash2 takes a DFlash2 drafter checkpoint directory")
        draft = cfg.get("dflash_config") if isinstance(cfg.get("dflash_config"), dict) else {}

        def need(key):
            value = draft.get(key, cfg.get(key))
            if value is None:
                raise ConvertError(f"the DFlash2 drafter config lacks {key!r} (in dflash_config or at the top level)")
            return value

        n_layers = int(need("num_hidden_layers"))
        hidden = int(need("hidden_size"))
        n_heads = int(need("num_attention_heads"))
        layer_types = cfg.get("layer_types") or ["full_attention"] * n_layers
        if len(layer_types) != n_layers or any(t != "sliding_attention" for t in layer_types):
            raise ConvertError("this build runs DFlash2 drafters whose layers are all sliding_attention "
                               f"(config layer_types {layer_types})")
        if cfg.get("is_causal"):
            raise ConvertError("the DFlash2 drafter config sets is_causal; DFlash2 blocks are non-causal")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = rope.get("rope_theta", cfg.get("rope_theta"))
        if theta is None:
            raise ConvertError("the DFlash2 drafter config lacks rope_theta")
        if rope.get("rope_type", "default") != "default":
            raise ConvertError(f"the DFlash2 drafter uses rope_type {rope.get('rope_type')!r}; this build runs 'default'")
        out = cls(
            hidden_size=hidden, intermediate_size=int(need("intermediate_size")), num_layers=n_layers,
            num_heads=n_heads, num_kv_heads=int(need("num_key_value_heads")),
            head_dim=int(cfg.get("head_dim") or hidden // n_heads), vocab_size=int(need("vocab_size")),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
            sliding_window=int(need("sliding_window")), block_size=int(need("block_size")),
            mask_token_id=int(need("mask_token_id")),
            target_layer_ids=tuple(int(x) for x in need("target_layer_ids")),
            conv_kernel_size=int(need("conv_kernel_size")), conv_group_size=int(need("conv_group_size")),
            selector_rank=int(need("selector_rank")), selector_top_k=int(need("selector_top_k")),
            input_embedding_scale=float(draft.get("input_embedding_scale", cfg.get("input_embedding_scale", 1.0))),
        )
        if out.hidden_size % out.conv_group_size or out.num_heads % out.num_kv_heads or out.head_dim % 2:
            raise ConvertError("the DFlash2 drafter's widths do not divide (hidden by conv_group_size, "
                               "heads by KV heads, head_dim by 2)")
        if not out.target_layer_ids or out.sliding_window < 2 or out.selector_top_k < 1 or out.conv_kernel_size < 1:
            raise ConvertError("the DFlash2 drafter config needs target_layer_ids, sliding_window >= 2, "
                               "selector_top_k >= 1 and conv_kernel_size >= 1")
        return out

    def to_hf_dict(self) -> dict:
        """The HF config.json layout from_hf_dict reads (draft fields nested in dflash_config)."""
        return {"architectures": [DFLASH2_ARCHITECTURE], "model_type": "qwen3", "is_causal": False, "hidden_act": "silu",
                "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
                "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "vocab_size": self.vocab_size,
                "rms_norm_eps": self.rms_norm_eps, "sliding_window": self.sliding_window,
                "layer_types": ["sliding_attention"] * self.num_layers,
                "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
                "dflash_config": {"block_size": self.block_size, "mask_token_id": self.mask_token_id,
                                  "target_layer_ids": list(self.target_layer_ids),
                                  "conv_kernel_size": self.conv_kernel_size, "conv_group_size": self.conv_group_size,
                                  "selector_rank": self.selector_rank, "selector_top_k": self.selector_top_k,
                                  "input_embedding_scale": self.input_embedding_scale}}

    @classmethod
    def from_json_bytes(cls, data: bytes) -> "DFlash2Config":
        try:
            return cls.from_hf_dict(json.loads(data))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConvertError(f"the DFlash2 drafter config is not valid JSON: {exc}") from None

    def check_target(self, target: ModelConfig) -> None:
        """The drafter shares the target's embedding and head and reads its hidden states."""
        if self.hidden_size != target.hidden_size:
            raise ConvertError(f"the DFlash2 drafter's hidden size {self.hidden_size} differs from the target's "
                               f"{target.hidden_size}: it was trained for another model")
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_layers]
        if bad:
            raise ConvertError(f"the DFlash2 drafter taps target layers {bad}, outside the target's "
                               f"{target.num_layers} layers")
        if not 0 <= self.mask_token_id < target.vocab_size or self.vocab_size > target.vocab_size:
            raise ConvertError(f"the DFlash2 drafter's vocabulary ({self.vocab_size}, mask token "
                               f"{self.mask_token_id}) does not fit the target's {target.vocab_size}")
