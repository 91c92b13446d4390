"""Full-size Qwen3.5-family shapes for benchmarks without real weights.

`write_shape_artifact` writes a genuine .nfer (same inventory, recipe formats and binder checks
as a converted checkpoint) whose tensor payloads are sparse zero holes: a 27B artifact costs a
few kilobytes of disk. The benchmark fills the resident weights with random values on the GPU.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from .container import ArtifactPlan, ArtifactWriter
from .convert import ConvertError
from .inventory import (
    DFLASH2_CONFIG,
    DRAFT_HEAD,
    DRAFT_TOKEN_IDS,
    MATRIX_ROLES,
    RESOURCE_NAMES,
    SourceNames,
    dflash2_inventory,
    mtp_inventory,
    text_inventory,
)
from .model_config import DFlash2Config, ModelConfig
from .recipes import RECIPES, format_for

_COMMON = {
    "vocab_size": 248320, "num_attention_heads": None, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "hidden_act": "silu",
    "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "mtp_num_hidden_layers": 1, "eos_token_id": [248044, 248046],
}


# the vision tower of the family's checkpoints (460.7M parameters, ~0.9 GB in BF16); out_hidden_size follows the
# text model's hidden size
_VISION = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "patch_size": 16,
           "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 2304, "in_channels": 3,
           "hidden_act": "gelu_pytorch_tanh"}


# The layouts an official upstream artifact binds to (specs/container.md §6), for fit and bench without the file:
# `groupwise-int`: our q4 formats, but the attention input stacked as Q5 (the 27B's Q4 query/key + Q5 gate/value
# parents); `nvfp4`: every product NVFP4 (nvfp4-rows-v1), the embedding and head too.
UPSTREAM_PROFILES = {
    "groupwise-int": ("q4", {"attn_in": "Q5G64_F16S"}),
    "nvfp4": ("q4", {r: "NVFP4" for r in MATRIX_ROLES}),
}


def shape_format(recipe: str, role: str) -> str:
    """A shape artifact's format for `role`: one of our recipes, or an upstream profile as it binds."""
    if recipe in UPSTREAM_PROFILES:
        base, overrides = UPSTREAM_PROFILES[recipe]
        return overrides.get(role) or format_for(base, role)
    return format_for(recipe, role)


def _layers(n: int) -> list[str]:
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


_DENSE_27B = {**_COMMON, "model_type": "qwen3_5_text", "hidden_size": 5120, "num_hidden_layers": 64,
              "layer_types": _layers(64), "num_attention_heads": 24, "num_key_value_heads": 4,
              "linear_num_value_heads": 48, "intermediate_size": 17408}

NAMED_SHAPES: dict[str, dict] = {
    "qwen3.6-27b": _DENSE_27B,
    # Qwen3.8-27B: the 27B text shape (its artifacts differ in companions, e.g. DFlash2, not in the text model)
    "qwen3.8-27b": _DENSE_27B,
    "qwen3.6-35b-a3b": {**_COMMON, "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40,
                        "layer_types": _layers(40), "num_attention_heads": 16, "num_key_value_heads": 2,
                        "linear_num_value_heads": 32, "num_experts": 256, "num_experts_per_tok": 8,
                        "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512},
}


def dflash2_shape_config(text: dict) -> DFlash2Config:
    """The DFlash2 drafter for a named shape: Qwen3.8-27B's (5 sliding-window layers over 5 target taps,
    32 / 8 heads x 128, window 2048, 16 selector candidates of rank 256); a MoE target gets an MLP of
    3 x hidden, as DFlash drafters of MoE models have."""
    n, h = text["num_hidden_layers"], text["hidden_size"]
    return DFlash2Config(hidden_size=h, intermediate_size=text.get("intermediate_size", 3 * h), num_layers=5,
                         num_heads=32, num_kv_heads=8, head_dim=128, vocab_size=text["vocab_size"], rms_norm_eps=1e-6,
                         rope_theta=10000000.0, sliding_window=2048, block_size=8, mask_token_id=248070,
                         target_layer_ids=tuple(round(5 + i * (n - 8) / 4) for i in range(5)), conv_kernel_size=2,
                         conv_group_size=16, selector_rank=256, selector_top_k=16)


def shape_config(name: str) -> dict:
    try:
        return dict(NAMED_SHAPES[name])
    except KeyError:
        raise ConvertError(f"unknown shape {name!r}; choose one of {', '.join(NAMED_SHAPES)}") from None


def vision_inventory(vision: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The vision tower's tensors (names under `vision/`, as the converter keeps a checkpoint's, and their
    shapes) for an HF vision_config: patch embedding, position table, the blocks, the patch merger."""
    h, inter, depth = vision["hidden_size"], vision["intermediate_size"], vision["depth"]
    patch, temporal, merged = vision["patch_size"], vision["temporal_patch_size"], h * vision["spatial_merge_size"] ** 2
    out = [("patch_embed.proj.weight", (h, vision.get("in_channels", 3), temporal, patch, patch)),
           ("patch_embed.proj.bias", (h,)), ("pos_embed.weight", (vision["num_position_embeddings"], h))]
    for i in range(depth):
        b = f"blocks.{i}."
        out += [(b + "norm1.weight", (h,)), (b + "norm1.bias", (h,)), (b + "norm2.weight", (h,)), (b + "norm2.bias", (h,)),
                (b + "attn.qkv.weight", (3 * h, h)), (b + "attn.qkv.bias", (3 * h,)),
                (b + "attn.proj.weight", (h, h)), (b + "attn.proj.bias", (h,)),
                (b + "mlp.linear_fc1.weight", (inter, h)), (b + "mlp.linear_fc1.bias", (inter,)),
                (b + "mlp.linear_fc2.weight", (h, inter)), (b + "mlp.linear_fc2.bias", (h,))]
    out += [("merger.norm.weight", (h,)), ("merger.norm.bias", (h,)),
            ("merger.linear_fc1.weight", (merged, merged)), ("merger.linear_fc1.bias", (merged,)),
            ("merger.linear_fc2.weight", (vision["out_hidden_size"], merged)),
            ("merger.linear_fc2.bias", (vision["out_hidden_size"],))]
    return [(f"vision/{n}", shape) for n, shape in out]


def write_shape_artifact(name: str, out: str | os.PathLike, recipe: str = "q4", mtp: bool = True,
                         lm_head_draft: int = 0, dflash2: bool = False, vision: bool = False,
                         vision_recipe: str = "bf16") -> Path:
    """A v3 artifact of the named shape with zero payloads (see module doc); `vision` adds the family's
    vision tower, its products in `vision_recipe`'s format as the converter writes them."""
    from .convert import vision_format

    vision_format(vision_recipe, "", ())  # an unknown vision recipe is refused before anything is written
    if recipe not in RECIPES and recipe not in UPSTREAM_PROFILES:
        raise ConvertError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}, or an upstream profile "
                           f"({', '.join(UPSTREAM_PROFILES)})")
    text = shape_config(name)
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": text["model_type"].removesuffix("_text"),
              "text_config": text}
    if vision:
        config["vision_config"] = {**_VISION, "out_hidden_size": text["hidden_size"]}
    cfg = ModelConfig.from_hf_dict(config)
    names = SourceNames("", "", False)
    specs = text_inventory(cfg, names) + (mtp_inventory(cfg, names, 1) if mtp else [])
    weights_id = recipe if recipe in RECIPES else UPSTREAM_PROFILES[recipe][0]
    plan = ArtifactPlan(3, cfg.model_type, weights_id, metadata={"converter": "ninfer", "recipe": recipe,
                                                              "source": f"shape:{name} (zero payload)"})
    from .tiny import build_tokenizer  # a small stand-in: benchmarks feed token ids, never text

    resources = {RESOURCE_NAMES["config"]: json.dumps(config).encode(),
                 RESOURCE_NAMES["tokenizer"]: build_tokenizer(512).to_str().encode()}
    for rname, data in resources.items():
        plan.add_resource(rname, len(data), "text")
    if dflash2:
        drafter = dflash2_shape_config(text)
        specs += dflash2_inventory(drafter)
        resources[DFLASH2_CONFIG] = json.dumps(drafter.to_hf_dict()).encode()
        plan.add_resource(DFLASH2_CONFIG, len(resources[DFLASH2_CONFIG]), "dflash2")
    tensors = [(s.name, s.shape, shape_format(recipe, s.role), s.component) for s in specs]
    if lm_head_draft:
        tensors.append((DRAFT_HEAD, (lm_head_draft, cfg.hidden_size), shape_format(recipe, "draft_head"), "lm_head_draft"))
        tensors.append((DRAFT_TOKEN_IDS, (lm_head_draft,), "I32", "lm_head_draft"))
    if vision:
        tensors += [(vname, shape, vision_format(vision_recipe, vname, shape), "vision")
                    for vname, shape in vision_inventory(config["vision_config"])]
    for tname, shape, fmt, comp in tensors:
        plan.add_tensor(tname, shape, fmt, comp)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with ArtifactWriter(out, plan, checksums=False) as writer:
        for rname, data in resources.items():
            writer.write_resource(rname, data)
        for tname, *_ in tensors:
            if tname == DRAFT_TOKEN_IDS:
                writer.write_direct(tname, np.arange(lm_head_draft, dtype="<i4"))
            else:
                writer.leave_zero(tname)
    return out
