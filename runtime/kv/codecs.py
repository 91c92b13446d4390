"""KV-cache codecs: reference encoders and decoders in plain torch (specs/kv-codecs.md).

A codec turns one head vector pair (k [D], v [D]) per token into fixed-size byte planes and back.
Planes are returned as a dict name -> tensor [..., plane_width] of the plane's storage dtype; the
paged pool stores exactly these planes, so bytes per token follow from the plane widths alone.
Rotated codecs also rotate queries (keys) and un-rotate the attention output (values).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import functools

import torch

from .e8 import E8CUBE_SCALE_PER_RMS, e8_lattice_round, e8cube_decode, e8cube_encode
from .hadamard import rotate_groups

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


@functools.lru_cache(maxsize=8)
def _e2m1_on(device: str) -> torch.Tensor:
    return E2M1_VALUES.to(device)
FP8_MAX = 448.0
NVFP4_SCALE_MIN, NVFP4_SCALE_MAX = 2.0 ** -9, 448.0


@dataclass(frozen=True)
class Plane:
    name: str
    dtype: torch.dtype
    width: int  # elements per (token, head), for head_dim D = 256 given as a function of D below

    @property
    def item_bytes(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Codec:
    name: str
    key: str  # key sub-codec id
    value: str  # value sub-codec id
    rotate_keys: bool
    rotate_values: bool

    def planes(self, head_dim: int) -> list[Plane]:
        return [Plane(f"k_{p.name}", p.dtype, p.width) for p in sub_codec_planes(self.key, head_dim)] + \
               [Plane(f"v_{p.name}", p.dtype, p.width) for p in sub_codec_planes(self.value, head_dim)]

    def bytes_per_token_head(self, head_dim: int) -> int:
        return sum(p.width * p.item_bytes for p in self.planes(head_dim))

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """k, v [..., D] float -> planes."""
        if self.rotate_keys:
            k = rotate_groups(k)
        if self.rotate_values:
            v = rotate_groups(v)
        out = {f"k_{n}": t for n, t in encode_sub_codec(self.key, k).items()}
        out.update({f"v_{n}": t for n, t in encode_sub_codec(self.value, v).items()})
        return out

    def decode_keys(self, planes: dict[str, torch.Tensor]) -> torch.Tensor:
        """Keys in the (possibly rotated) storage basis: pair them with `prepare_queries`."""
        return decode_sub_codec(self.key, {n[2:]: t for n, t in planes.items() if n.startswith("k_")})

    def decode_values(self, planes: dict[str, torch.Tensor]) -> torch.Tensor:
        """Values in the storage basis: attention outputs go through `finish_output`."""
        return decode_sub_codec(self.value, {n[2:]: t for n, t in planes.items() if n.startswith("v_")})

    def prepare_queries(self, q: torch.Tensor) -> torch.Tensor:
        return rotate_groups(q) if self.rotate_keys else q.float()

    def finish_output(self, o: torch.Tensor) -> torch.Tensor:
        return rotate_groups(o) if self.rotate_values else o


CODECS = MappingProxyType({
    "bf16": Codec("bf16", "bf16", "bf16", False, False),
    "int8": Codec("int8", "int8g64", "int8g64", False, False),
    "fp8": Codec("fp8", "fp8row", "fp8row", False, False),
    "nvfp4": Codec("nvfp4", "nvfp4", "nvfp4", False, False),
    "k8v4": Codec("k8v4", "fp8row", "nvfp4", False, False),
    "rk8v4": Codec("rk8v4", "int8g64", "int4g64", True, True),
    "rk4v4": Codec("rk4v4", "int4g64", "int4g64", True, True),
    "rk4v4-e8": Codec("rk4v4-e8", "int4g64e8", "int4g64", True, True),
    "rk2v4-e8": Codec("rk2v4-e8", "e8cube", "int4g64", True, True),
})


def get_codec(name: str) -> Codec:
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"unknown --kv-dtype {name!r}; choose one of {', '.join(CODECS)}") from None


# --- sub-codecs ----------------------------------------------------------------------------


def sub_codec_planes(kind: str, d: int) -> list[Plane]:
    """Planes of one side (keys or values) in sub-codec `kind` for vectors of d elements."""
    if kind == "bf16":
        return [Plane("data", torch.bfloat16, d)]
    if kind == "int8g64":
        return [Plane("codes", torch.int8, d), Plane("scales", torch.float16, d // 64)]
    if kind in ("int4g64", "int4g64e8"):
        return [Plane("codes", torch.uint8, d // 2), Plane("scales", torch.float16, d // 64)]
    if kind == "fp8row":
        return [Plane("codes", torch.uint8, d), Plane("scales", torch.float16, 1)]
    if kind == "nvfp4":
        return [Plane("codes", torch.uint8, d // 2), Plane("scales", torch.uint8, d // 16)]
    if kind == "e8cube":
        return [Plane("codes", torch.uint8, d // 4), Plane("scales", torch.float16, d // 64)]
    raise ValueError(kind)


def _f16_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """f16(amax / qmax) with the 2^-24 rescue for tiny nonzero groups (stored scale is the contract)."""
    s = (amax / qmax).to(torch.float16)
    tiny = (s == 0) & (amax > 0)
    return torch.where(tiny, torch.full_like(s, 2.0 ** -24), s)


def _inverse(s: torch.Tensor) -> torch.Tensor:
    """1 / (stored scale) in float32, 0 for a zero scale: codes are computed with the stored scale."""
    return torch.where(s > 0, 1.0 / s.float(), torch.zeros_like(s, dtype=torch.float32))


def _grouped_int(x: torch.Tensor, group: int, qmax: int):
    g = x.float().reshape(*x.shape[:-1], -1, group)
    s = _f16_scale(g.abs().amax(-1), qmax)
    inv = _inverse(s)
    return g * inv[..., None], s


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    u = (codes.to(torch.int16) & 0xF).to(torch.uint8)
    return u[..., 0::2] | (u[..., 1::2] << 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    lo = (packed & 0xF).to(torch.int16)
    hi = (packed >> 4).to(torch.int16)
    u = torch.stack([lo, hi], -1).reshape(*packed.shape[:-1], -1)
    return (u ^ 8) - 8


def encode_sub_codec(kind: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Reference encoder of one side: x [..., d] (already rotated where the codec rotates) -> planes."""
    if kind == "bf16":
        return {"data": x.to(torch.bfloat16)}
    if kind == "int8g64":
        y, s = _grouped_int(x, 64, 127)
        return {"codes": y.round().clamp(-127, 127).to(torch.int8).reshape(x.shape), "scales": s}
    if kind in ("int4g64", "int4g64e8"):
        y, s = _grouped_int(x, 64, 7)
        if kind == "int4g64e8":
            y = e8_lattice_round(y.reshape(*y.shape[:-1], 8, 8)).reshape(y.shape)
        codes = y.round().clamp(-7, 7).reshape(x.shape)
        return {"codes": _pack_nibbles(codes), "scales": s}
    if kind == "fp8row":
        s = _f16_scale(x.float().abs().amax(-1, keepdim=True), FP8_MAX)
        inv = _inverse(s)
        codes = (x.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return {"codes": codes.view(torch.uint8), "scales": s}
    if kind == "nvfp4":
        g = x.float().reshape(*x.shape[:-1], -1, 16)
        raw = (g.abs().amax(-1) / 6.0).clamp(NVFP4_SCALE_MIN, NVFP4_SCALE_MAX)
        s8 = raw.to(torch.float8_e4m3fn)
        y = (g / s8.float()[..., None]).clamp(-6, 6)
        values = _e2m1_on(str(x.device))
        idx = (y.abs()[..., None] - values).abs().argmin(-1)  # nearest magnitude, ties to the smaller
        codes = (idx | ((y < 0) & (idx > 0)).to(idx.dtype) << 3).reshape(x.shape)
        return {"codes": _pack_nibbles(codes.to(torch.int16)), "scales": s8.view(torch.uint8)}
    if kind == "e8cube":
        g = x.float().reshape(*x.shape[:-1], -1, 64)
        s = _f16_scale(g.pow(2).mean(-1).sqrt(), 1.0 / E8CUBE_SCALE_PER_RMS)
        inv = _inverse(s)
        codes = e8cube_encode((g * inv[..., None]).reshape(-1, 8))
        return {"codes": codes.reshape(*x.shape[:-1], -1), "scales": s}
    raise ValueError(kind)


def decode_sub_codec(kind: str, p: dict[str, torch.Tensor]) -> torch.Tensor:
    """Reference decoder of one side: planes -> float32 [..., d] in the storage basis."""
    if kind == "bf16":
        return p["data"].float()
    if kind == "int8g64":
        c = p["codes"].float()
        return (c.reshape(*c.shape[:-1], -1, 64) * p["scales"].float()[..., None]).reshape(c.shape)
    if kind in ("int4g64", "int4g64e8"):
        c = _unpack_nibbles(p["codes"]).float()
        return (c.reshape(*c.shape[:-1], -1, 64) * p["scales"].float()[..., None]).reshape(c.shape)
    if kind == "fp8row":
        return p["codes"].view(torch.float8_e4m3fn).float() * p["scales"].float()
    if kind == "nvfp4":
        c = _unpack_nibbles(p["codes"]) & 0xF
        mag = _e2m1_on(str(c.device))[(c & 7).long()]
        val = torch.where(c >= 8, -mag, mag)
        s = p["scales"].view(torch.float8_e4m3fn).float()
        return (val.reshape(*val.shape[:-1], -1, 16) * s[..., None]).reshape(val.shape)
    if kind == "e8cube":
        codes = p["codes"]
        lead = codes.shape[:-1]
        groups = codes.shape[-1] // 16
        vec = e8cube_decode(codes.reshape(*lead, groups, 8, 2))  # [..., groups, 8, 8] in units of the scale
        return (vec * p["scales"].float()[..., None, None]).reshape(*lead, groups * 64)
    raise ValueError(kind)
