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
        """Every value typed and bounded (a bad one is one line naming the field), then cross-checked."""
        if not isinstance(cfg, dict):
            raise ConvertError("config must be a JSON object")
        top_type = cfg.get("model_type")
        text = cfg.get("text_config", cfg)
        if not isinstance(text, dict):
            raise ConvertError("config text_config must be a JSON object")
        model_type = _TEXT_TYPES.get(text.get("model_type"), top_type) if isinstance(text.get("model_type"), str) else top_type
        if model_type in _TEXT_TYPES:
            model_type = _TEXT_TYPES[model_type]
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConvertError(
                f"config model_type {top_type!r:.60} is not a Qwen3.5-family checkpoint (need qwen3_5 or qwen3_5_moe)"
            )
        n_layers = _int(text, "num_hidden_layers")
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = _int(text, "full_attention_interval", 4)
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
        if not isinstance(layer_types, list) or len(layer_types) != n_layers \
                or any(t not in ("full_attention", "linear_attention") for t in layer_types):
            raise ConvertError(f"config layer_types must list full_attention/linear_attention for each of the "
                               f"{n_layers} layers")
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConvertError("config rope_parameters must be a JSON object")
        theta = _float({**text, **rope}, "rope_theta", 10000.0, 1e-3, 1e12)
        prf = _float({**text, **rope}, "partial_rotary_factor", 0.25, 1e-3, 1.0)
        eos = text.get("eos_token_id", cfg.get("eos_token_id"))
        if isinstance(generation_config, dict) and generation_config.get("eos_token_id") is not None:
            eos = generation_config["eos_token_id"]
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        hidden = _int(text, "hidden_size")
        n_heads = _int(text, "num_attention_heads")
        if text.get("head_dim") is None and hidden % n_heads:
            raise ConvertError(f"config hidden_size {hidden} is not a multiple of num_attention_heads {n_heads} "
                               "(and no head_dim is given)")
        section = rope.get("mrope_section", [11, 11, 10])
        if not isinstance(section, list) or len(section) != 3 or not all(_is_int(x) and 0 <= x <= 4096 for x in section):
            raise ConvertError("config mrope_section must list three non-negative integers (t, h, w)")
        common = dict(
            model_type=model_type,
            vocab_size=_int(text, "vocab_size"),
            hidden_size=hidden,
            num_layers=n_layers,
            layer_types=tuple(layer_types),
            num_heads=n_heads,
            num_kv_heads=_int(text, "num_key_value_heads"),
            head_dim=_int(text, "head_dim", hidden // n_heads),
            linear_num_key_heads=_int(text, "linear_num_key_heads"),
            linear_num_value_heads=_int(text, "linear_num_value_heads"),
            linear_key_head_dim=_int(text, "linear_key_head_dim"),
            linear_value_head_dim=_int(text, "linear_value_head_dim"),
            conv_kernel=_int(text, "linear_conv_kernel_dim", 4),
            rms_norm_eps=_float(text, "rms_norm_eps", 1e-6, 1e-12, 0.1),
            rope_theta=theta,
            partial_rotary_factor=prf,
            mtp_layers=_int(text, "mtp_num_hidden_layers", 0),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            eos_token_ids=eos_ids,
            has_vision=isinstance(cfg.get("vision_config"), dict),
            mrope_section=tuple(section),
        )
        if model_type == "qwen3_5_moe":
            out = cls(**common, num_experts=_int(text, "num_experts"), experts_per_token=_int(text, "num_experts_per_tok"),
                      moe_intermediate_size=_int(text, "moe_intermediate_size"),
                      shared_expert_intermediate_size=_int(text, "shared_expert_intermediate_size"))
        else:
            out = cls(**common, intermediate_size=_int(text, "intermediate_size"))
        out._cross_check()
        return out

    def _cross_check(self) -> None:
        problems = []
        if self.num_heads % self.num_kv_heads:
            problems.append(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads "
                            f"{self.num_kv_heads}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            problems.append(f"linear_num_value_heads {self.linear_num_value_heads} is not a multiple of "
                            f"linear_num_key_heads {self.linear_num_key_heads}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            problems.append(f"head_dim {self.head_dim} x partial_rotary_factor {self.partial_rotary_factor} gives "
                            f"{self.rotary_dim} rotary dims; it must be a positive even number")
        elif sum(self.mrope_section) * 2 > self.rotary_dim:
            problems.append(f"mrope_section {list(self.mrope_section)} covers {sum(self.mrope_section) * 2} rotary "
                            f"dims, more than the {self.rotary_dim} there are")
        if self.is_moe and self.experts_per_token > self.num_experts:
            problems.append(f"num_experts_per_tok {self.experts_per_token} exceeds num_experts {self.num_experts}")
        bad_eos = [e for e in self.eos_token_ids if not _is_int(e) or not 0 <= e < self.vocab_size]
        if bad_eos:
            problems.append(f"eos_token_id {bad_eos[:3]} is not a token of the {self.vocab_size}-token vocabulary")
        if problems:
            raise ConvertError("config: " + "; ".join(problems))

    @classmethod
    def from_json_bytes(cls, data: bytes, generation_config: bytes | None = None) -> "ModelConfig":
        cfg = load_json(data, "config resource")
        gen = load_json(generation_config, "generation_config resource") if generation_config else None
        if not isinstance(cfg, dict):
            raise ConvertError("config resource must be a JSON object")
        if gen is not None and not isinstance(gen, dict):
            raise ConvertError("generation_config resource must be a JSON object")
        return cls.from_hf_dict(cfg, gen)


# Every integer field: (smallest, largest) accepted. The upper bounds sit far above any Qwen3.5-family
# model and keep a hostile config from planning unbounded memory or loops.
INT_LIMITS = {
    "num_hidden_layers": (1, 1024), "full_attention_interval": (1, 1024), "vocab_size": (16, 1 << 22),
    "hidden_size": (8, 1 << 16), "num_attention_heads": (1, 1024), "num_key_value_heads": (1, 1024),
    "head_dim": (2, 4096), "linear_num_key_heads": (1, 1024), "linear_num_value_heads": (1, 1024),
    "linear_key_head_dim": (2, 4096), "linear_value_head_dim": (2, 4096), "linear_conv_kernel_dim": (1, 64),
    "intermediate_size": (1, 1 << 20), "num_experts": (1, 4096), "num_experts_per_tok": (1, 4096),
    "moe_intermediate_size": (1, 1 << 20), "shared_expert_intermediate_size": (0, 1 << 20),
    "mtp_num_hidden_layers": (0, 16),
}
_MISSING = object()
MAX_JSON_BYTES = 16 << 20  # config, generation config, tokenizer config: far below this
MAX_JSON_DIGITS = 64  # digits in one JSON number


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(d: dict, key: str, default=_MISSING) -> int:
    value = d.get(key, default)
    if value is None and default is not _MISSING:
        value = default
    if value is _MISSING or value is None:
        raise ConvertError(f"config.json lacks text field {key!r}")
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # some exporters write 4.0
    if not _is_int(value):
        raise ConvertError(f"config {key} must be an integer, not {type(value).__name__} {str(value)[:40]!r}")
    lo, hi = INT_LIMITS[key]
    if not lo <= value <= hi:
        raise ConvertError(f"config {key} = {value} is outside {lo}..{hi}")
    return value


def _float(d: dict, key: str, default: float, lo: float, hi: float) -> float:
    value = d.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConvertError(f"config {key} must be a number, not {type(value).__name__} {str(value)[:40]!r}")
    value = float(value)
    if not lo <= value <= hi:  # also refuses NaN
        raise ConvertError(f"config {key} = {value} is outside {lo:g}..{hi:g}")
    return value


def _bounded_number(text: str):
    if len(text) > MAX_JSON_DIGITS:
        raise ConvertError(f"a number written with {len(text)} characters (at most {MAX_JSON_DIGITS} are accepted)")
    return text


def load_json(data: bytes, what: str):
    """JSON from an artifact or checkpoint with limits: size, number length, nesting (one line each)."""
    if len(data) > MAX_JSON_BYTES:
        raise ConvertError(f"{what} is {len(data)} bytes of JSON; at most {MAX_JSON_BYTES} are accepted")
    try:
        return json.loads(data, parse_int=lambda t: int(_bounded_number(t)),
                          parse_float=lambda t: float(_bounded_number(t)))
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise ConvertError(f"{what} is not valid JSON: {str(exc).splitlines()[0][:200]}") from None
    except RecursionError:
        raise ConvertError(f"{what} nests JSON too deeply") from None


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
