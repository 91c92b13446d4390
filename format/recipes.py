"""Recipes: which tensor format each weight role gets (specs/inventory.md, "Recipes")."""

from __future__ import annotations

from types import MappingProxyType

from .errors import ConvertError
from .inventory import FIXED_ROLE_FORMATS

_Q4, _Q5, _Q6, _W8, _BF = "Q4G64_F16S", "Q5G64_F16S", "Q6G64_F16S", "W8G32_F16S", "BF16"

RECIPES = MappingProxyType({
    "q4": {"embedding": _W8, "head": _Q6, "attn_in": _Q4, "attn_out": _Q5, "gdn_in": _Q4, "gdn_out": _Q5,
           "mlp_up": _Q4, "mlp_down": _Q5, "expert_up": _Q4, "expert_down": _Q5, "shared_up": _W8,
           "shared_down": _W8, "mtp_fc": _W8, "draft_head": _Q4, "companion_matrix": _W8},
    "q5": {"embedding": _W8, "head": _Q6, "attn_in": _Q5, "attn_out": _Q5, "gdn_in": _Q5, "gdn_out": _Q5,
           "mlp_up": _Q5, "mlp_down": _Q5, "expert_up": _Q5, "expert_down": _Q5, "shared_up": _W8,
           "shared_down": _W8, "mtp_fc": _W8, "draft_head": _Q4, "companion_matrix": _W8},
    "q6": {"embedding": _W8, "head": _W8, "attn_in": _Q6, "attn_out": _Q6, "gdn_in": _Q6, "gdn_out": _Q6,
           "mlp_up": _Q6, "mlp_down": _Q6, "expert_up": _Q6, "expert_down": _Q6, "shared_up": _W8,
           "shared_down": _W8, "mtp_fc": _W8, "draft_head": _Q4, "companion_matrix": _W8},
    "w8": {r: _W8 for r in ("embedding", "head", "attn_in", "attn_out", "gdn_in", "gdn_out", "mlp_up", "mlp_down",
                            "expert_up", "expert_down", "shared_up", "shared_down", "mtp_fc", "companion_matrix")}
          | {"draft_head": _Q4},
    "bf16": {r: _BF for r in ("embedding", "head", "attn_in", "attn_out", "gdn_in", "gdn_out", "mlp_up", "mlp_down",
                              "expert_up", "expert_down", "shared_up", "shared_down", "mtp_fc", "draft_head",
                              "companion_matrix")},
})


def format_for(recipe: str, role: str) -> str:
    if role in FIXED_ROLE_FORMATS:
        return FIXED_ROLE_FORMATS[role]
    try:
        return RECIPES[recipe][role]
    except KeyError:
        if recipe not in RECIPES:
            raise ConvertError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}") from None
        raise ConvertError(f"recipe {recipe} has no format for role {role!r}") from None
