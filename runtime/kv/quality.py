"""Codec quality on real-shaped data: key-tile cosine and attention-output cosine vs bf16.

Real-shaped means what decoder K/V look like, not white noise: per-channel scales drawn
log-normally, a few massive key channels, per-token norm variation, queries aligned with the
key distribution, and a causal softmax over many tokens at scale 1/sqrt(D).
"""

from __future__ import annotations

import torch

from .codecs import CODECS


LOGIT_STD = 3.0  # a moderate attention temperature; white-noise keys would give near-uniform attention


def real_shaped_kv(tokens: int, heads: int, head_dim: int, seed: int = 42):
    g = torch.Generator().manual_seed(seed)
    chan = torch.exp(torch.randn(heads, head_dim, generator=g) * 0.5)
    outliers = torch.randperm(head_dim, generator=g)[: max(1, head_dim // 64)]
    chan[:, outliers] *= 6.0
    k = torch.randn(tokens, heads, head_dim, generator=g) * chan
    k = k * (0.6 + 0.8 * torch.rand(tokens, 1, 1, generator=g))
    v = torch.randn(tokens, heads, head_dim, generator=g) * torch.exp(torch.randn(heads, head_dim, generator=g) * 0.3)
    q = torch.randn(32, heads, head_dim, generator=g) * chan
    logits_std = (torch.einsum("qhd,thd->hqt", q, k) / head_dim ** 0.5).std()
    return q * (LOGIT_STD / logits_std), k, v


def _cosine(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=dim)


def _attention(q, k, v):
    scores = torch.einsum("qhd,thd->hqt", q.float(), k.float()) / q.shape[-1] ** 0.5
    return torch.einsum("hqt,thd->qhd", scores.softmax(-1), v.float())


def codec_quality(name: str, tokens: int = 1024, heads: int = 4, head_dim: int = 256, seed: int = 42) -> dict:
    codec = CODECS[name]
    q, k, v = real_shaped_kv(tokens, heads, head_dim, seed)
    k16, v16 = k.bfloat16().float(), v.bfloat16().float()
    reference = _attention(q.bfloat16(), k16, v16)
    planes = codec.encode(k16, v16)
    keys = codec.decode_keys(planes)
    out = codec.finish_output(_attention(codec.prepare_queries(q.bfloat16().float()), keys, codec.decode_values(planes)))
    stored_k = codec.prepare_queries(k16) if codec.rotate_keys else k16
    return {
        "codec": name,
        "bytes_per_token_head": codec.bytes_per_token_head(head_dim),
        "key_tile_cosine": _cosine(keys.flatten(), stored_k.flatten(), dim=0).item(),
        "attention_output_cosine": _cosine(out.flatten(1), reference.flatten(1), dim=-1).mean().item(),
    }


def gaussian_key_cosine(name: str, tokens: int = 4096, head_dim: int = 256, seed: int = 1) -> float:
    """Key tile cosine on i.i.d. Gaussian keys: the data of upstream's codec micro-benchmark."""
    codec = CODECS[name]
    k = torch.randn(tokens, 1, head_dim, generator=torch.Generator().manual_seed(seed))
    stored = codec.prepare_queries(k) if codec.rotate_keys else k
    keys = codec.decode_keys(codec.encode(k, k))
    return _cosine(keys.flatten(), stored.flatten(), dim=0).item()


def main() -> None:
    for name in CODECS:
        r = codec_quality(name)
        print(f"{name:9s} {r['bytes_per_token_head']:5d} B  key tile cos {r['key_tile_cosine']:.5f}  "
              f"attention out cos {r['attention_output_cosine']:.5f}  Gaussian key cos {gaussian_key_cosine(name):.5f}")


if __name__ == "__main__":
    main()
