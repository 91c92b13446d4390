"""The Qwen3.5 vision tower (ViT + 2x2 patch merger), image preprocessing, and 3-axis MRoPE positions.

The tower runs once per image at prefill, so it is plain torch (cuBLAS / SDPA do the heavy work on
the GPU) and serves both runtimes. Weights are the artifact's BF16 `vision/*` objects under the
checkpoint's own names. Patches are ordered in 2x2 merge blocks (block row, block col, in-row,
in-col), so four consecutive patch rows merge into one language-model token.
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from format.container import Artifact
from format.errors import BindingError
from format.inventory import RESOURCE_NAMES

IMAGE_MEAN = (0.5, 0.5, 0.5)
IMAGE_STD = (0.5, 0.5, 0.5)
MIN_PIXELS = 56 * 56
MAX_PIXELS = 1024 * 1024  # per image, after resizing; larger images are scaled down to fit


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    num_position_embeddings: int
    out_hidden_size: int
    in_channels: int = 3
    rope_theta: float = 10000.0
    # preprocessing, from the checkpoint's preprocessor_config.json when it has one
    min_pixels: int = MIN_PIXELS
    max_pixels: int = MAX_PIXELS
    image_mean: tuple = IMAGE_MEAN
    image_std: tuple = IMAGE_STD

    @classmethod
    def from_artifact(cls, art: Artifact) -> "VisionConfig":
        cfg = json.loads(art.resource_bytes(RESOURCE_NAMES["config"]))
        v = cfg.get("vision_config")
        if not isinstance(v, dict):
            raise BindingError("the artifact's config has no vision_config; it cannot run images")
        pre = {}
        if art.has(RESOURCE_NAMES["preprocessor_config"]):
            pre = json.loads(art.resource_bytes(RESOURCE_NAMES["preprocessor_config"]))
        size = pre.get("size") if isinstance(pre.get("size"), dict) else {}
        return cls(depth=v["depth"], hidden_size=v["hidden_size"], num_heads=v["num_heads"],
                   patch_size=v["patch_size"], temporal_patch_size=v.get("temporal_patch_size", 2),
                   spatial_merge_size=v.get("spatial_merge_size", 2),
                   num_position_embeddings=v["num_position_embeddings"], out_hidden_size=v["out_hidden_size"],
                   in_channels=v.get("in_channels", 3),
                   rope_theta=(v.get("rope_parameters") or {}).get("rope_theta", 10000.0),
                   min_pixels=int(pre.get("min_pixels") or size.get("shortest_edge") or MIN_PIXELS),
                   max_pixels=int(pre.get("max_pixels") or size.get("longest_edge") or MAX_PIXELS),
                   image_mean=tuple(pre.get("image_mean") or IMAGE_MEAN),
                   image_std=tuple(pre.get("image_std") or IMAGE_STD))


@dataclass(frozen=True)
class TokenIds:
    image: int
    vision_start: int
    vision_end: int

    @classmethod
    def from_artifact(cls, art: Artifact) -> "TokenIds":
        cfg = json.loads(art.resource_bytes(RESOURCE_NAMES["config"]))
        return cls(cfg.get("image_token_id", 248056), cfg.get("vision_start_token_id", 248053),
                   cfg.get("vision_end_token_id", 248054))


@dataclass
class ImageInput:
    pixel_values: torch.Tensor  # [patches, C * T * P * P] float32, merge-block order
    grid_thw: tuple[int, int, int]  # patches along t, h, w

    @property
    def tokens(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w // 4


# --- preprocessing -------------------------------------------------------------------------

def fit_size(height: int, width: int, factor: int, min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS):
    """Round to multiples of `factor` keeping the aspect ratio, then scale into [min, max] pixels."""
    if max(height, width) / max(1, min(height, width)) > 200:
        raise ValueError(f"image aspect ratio {width}x{height} is beyond 200:1")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def preprocess(data: bytes, cfg: VisionConfig) -> ImageInput:
    """Decode (Pillow), resize to the patch grid, normalize, and cut merge-ordered patches."""
    from PIL import Image, UnidentifiedImageError

    try:
        img = Image.open(io.BytesIO(data))
        img.load()
    except Image.DecompressionBombError:
        raise ValueError("the image has too many pixels to decode safely; downscale it first") from None
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"cannot decode the image ({exc}); send PNG, JPEG, GIF or WebP") from None
    img = img.convert("RGB")
    p, m = cfg.patch_size, cfg.spatial_merge_size
    h, w = fit_size(img.height, img.width, p * m, cfg.min_pixels, cfg.max_pixels)
    img = img.resize((w, h), Image.Resampling.BICUBIC)
    x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(h, w, 3).float() / 255.0
    x = (x - torch.tensor(cfg.image_mean)) / torch.tensor(cfg.image_std)
    return patchify(x.permute(2, 0, 1), cfg)


def patchify(image: torch.Tensor, cfg: VisionConfig) -> ImageInput:
    """image [C, H, W] (normalized) -> patches [gh*gw, C*T*P*P] in merge-block order; a still image is
    repeated over the temporal patch."""
    p, m, tp = cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size
    c, h, w = image.shape
    gh, gw = h // p, w // p
    frames = image[None].expand(tp, c, h, w)
    x = frames.reshape(1, tp, c, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, block row, block col, in-row, in-col, C, T, P, P
    return ImageInput(x.reshape(gh * gw, c * tp * p * p).contiguous(), (1, gh, gw))


# --- the tower -----------------------------------------------------------------------------

def _merge_order(grid_h: int, grid_w: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) of every patch in merge-block order."""
    rows = torch.arange(grid_h).view(grid_h // m, m, 1, 1).expand(-1, -1, grid_w // m, m)
    cols = torch.arange(grid_w).view(1, 1, grid_w // m, m).expand(grid_h // m, m, -1, -1)
    return rows.permute(0, 2, 1, 3).reshape(-1), cols.permute(0, 2, 1, 3).reshape(-1)


def _bilinear_taps(coord: torch.Tensor, size: int, side: int):
    """align_corners=True bilinear taps of `side` table cells for `coord` in 0..size-1."""
    src = coord.float() * ((side - 1) / (size - 1)) if size > 1 else torch.zeros_like(coord, dtype=torch.float)
    lo = src.floor().long().clamp(0, side - 1)
    hi = (lo + 1).clamp(max=side - 1)
    frac = src - lo.float()
    return lo, hi, frac


class VisionTower:
    def __init__(self, cfg: VisionConfig, ids: TokenIds, weights: dict[str, torch.Tensor], device, dtype: torch.dtype,
                 packed: dict | None = None):
        """weights: the checkpoint's vision tensors by their names under `vision/`; packed: the matrices
        stored quantized (convert --vision-recipe), as PackedLinear by the same names, multiplied as stored."""
        self.cfg, self.ids, self.w = cfg, ids, weights
        self.packed = packed or {}
        self.device, self.dtype = torch.device(device), dtype

    @classmethod
    def from_artifact(cls, art: Artifact, device, dtype: torch.dtype,
                      resident: dict[str, torch.Tensor] | None = None, resident_packed: dict | None = None) -> "VisionTower":
        """Load the tower's weights (or use `resident` / `resident_packed`: tensors and PackedLinear already on the
        device by object name). Quantized matrices stay quantized."""
        from format.numeric import GroupedFormat, get_format

        from .dequant import load_tensor

        names = [n for n in art.objects if n.startswith("vision/")]
        if not names:
            raise BindingError("this artifact carries no vision tower; re-convert from a checkpoint that has one")
        weights, packed = {}, {}
        for n in names:
            key = n[len("vision/"):]
            if isinstance(get_format(art.entry(n).format), GroupedFormat):
                packed[key] = resident_packed[n] if resident_packed is not None else _load_packed(art, n, device)
            else:
                weights[key] = resident[n].to(dtype) if resident is not None else load_tensor(art, n, dtype, device)
        return cls(VisionConfig.from_artifact(art), TokenIds.from_artifact(art), weights, device, dtype, packed)

    def _linear(self, x: torch.Tensor, key: str) -> torch.Tensor:
        """x @ W^T + b for the matrix `key` (".weight" / ".bias" pair), stored quantized or not."""
        if key + ".weight" in self.packed:
            from .kernels.qlinear import qlinear

            y = qlinear(x.contiguous(), self.packed[key + ".weight"])
        else:
            y = x @ self.w[key + ".weight"].t()
        return y + self.w[key + ".bias"]

    def _rotary(self, rows: torch.Tensor, cols: torch.Tensor):
        head = self.cfg.hidden_size // self.cfg.num_heads
        quarter = head // 2
        inv = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float, device=rows.device) / quarter))
        freqs = torch.cat([rows[:, None].float() * inv, cols[:, None].float() * inv], dim=-1)
        freqs = torch.cat([freqs, freqs], dim=-1)
        return freqs.cos(), freqs.sin()

    @torch.no_grad()
    def encode(self, image: ImageInput) -> torch.Tensor:
        """One image -> language-model embeddings [tokens, out_hidden]."""
        c, w = self.cfg, self.w
        _, gh, gw = image.grid_thw
        x = image.pixel_values.to(self.device, self.dtype)
        kernel = w["patch_embed.proj.weight"]
        x = x @ kernel.reshape(kernel.shape[0], -1).t() + w["patch_embed.proj.bias"]
        # patch coordinates go to the engine's device once; taps and rotary angles follow them there
        rows, cols = (t.to(self.device) for t in _merge_order(gh, gw, c.spatial_merge_size))
        side = int(c.num_position_embeddings ** 0.5)
        r0, r1, fr = _bilinear_taps(rows, gh, side)
        c0, c1, fc = _bilinear_taps(cols, gw, side)
        table = w["pos_embed.weight"].float()
        pos = (table[r0 * side + c0] * ((1 - fr) * (1 - fc))[:, None] + table[r0 * side + c1] * ((1 - fr) * fc)[:, None]
               + table[r1 * side + c0] * (fr * (1 - fc))[:, None] + table[r1 * side + c1] * (fr * fc)[:, None])
        x = x + pos.to(self.device, x.dtype)
        cos, sin = self._rotary(rows, cols)
        heads = c.num_heads
        n = x.shape[0]
        for i in range(c.depth):
            b = f"blocks.{i}."
            h = F.layer_norm(x, (c.hidden_size,), w[b + "norm1.weight"], w[b + "norm1.bias"], 1e-6)
            qkv = self._linear(h, b + "attn.qkv").view(n, 3, heads, -1)
            q, k, v = qkv.unbind(1)
            q, k = _rotate(q.float(), cos, sin).to(x.dtype), _rotate(k.float(), cos, sin).to(x.dtype)
            o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
            o = o.transpose(0, 1).reshape(n, -1)
            x = x + self._linear(o, b + "attn.proj")
            h = F.layer_norm(x, (c.hidden_size,), w[b + "norm2.weight"], w[b + "norm2.bias"], 1e-6)
            h = F.gelu(self._linear(h, b + "mlp.linear_fc1"), approximate="tanh")
            x = x + self._linear(h, b + "mlp.linear_fc2")
        x = F.layer_norm(x, (c.hidden_size,), w["merger.norm.weight"], w["merger.norm.bias"], 1e-6)
        x = x.view(-1, c.hidden_size * c.spatial_merge_size ** 2)
        x = F.gelu(self._linear(x, "merger.linear_fc1"))
        return self._linear(x, "merger.linear_fc2")


def _load_packed(art: Artifact, name: str, device):
    """A quantized vision matrix's planes on `device`, as the engine keeps a product's weights."""
    from .dequant import _u8
    from .kernels.qlinear import PackedLinear

    base, high, scale, geo = art.planes(name)
    return PackedLinear(_u8(base, device), _u8(high, device) if high is not None else None, _u8(scale, device),
                        geo.rows, geo.cols, geo.fmt)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


# --- prompt layout -------------------------------------------------------------------------

def expand_image_tokens(ids: list[int], images: list[ImageInput], image_token: int) -> list[int]:
    """Each single image placeholder becomes as many placeholders as the image has merged tokens."""
    out, it = [], iter(images)
    for t in ids:
        if t == image_token:
            try:
                out += [image_token] * next(it).tokens
            except StopIteration:
                raise ValueError("the prompt has more image placeholders than images") from None
        else:
            out.append(t)
    if next(it, None) is not None:
        raise ValueError("the prompt has fewer image placeholders than images")
    return out


def mrope_positions(ids: list[int], images: list[ImageInput], image_token: int, merge: int = 2):
    """3-axis rotary positions [3, T] and the delta that text after the prompt adds to its index.
    Text advances all axes together; an image's tokens take (t, row, col) offsets from where the image
    starts, and the text after it resumes at start + max(rows, cols)."""
    pos, cur, i, it = [], 0, 0, iter(images)
    n = len(ids)
    while i < n:
        if ids[i] != image_token:
            pos.append((cur, cur, cur))
            cur += 1
            i += 1
            continue
        img = next(it)
        _, gh, gw = img.grid_thw
        lh, lw = gh // merge, gw // merge
        for r in range(lh):
            for c in range(lw):
                pos.append((cur, cur + r, cur + c))
        i += lh * lw
        cur += max(lh, lw)
    t = torch.tensor(pos, dtype=torch.long).t().contiguous() if pos else torch.zeros(3, 0, dtype=torch.long)
    return t, cur - n
