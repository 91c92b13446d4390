"""A prefill chunk's attention through cuDNN's fused attention (torch's SDPA cuDNN backend), key segment by
key segment.

Measured on an H100 (bench/attention_compare.py prefill, 2,048-row chunk, 27B heads): at 8K-200K depth the
cuDNN kernel runs at 634-708 TFLOP/s against 274-318 for the paged Triton kernel, and gathering the keys out of
the pages costs ~6 % of it. End to end (bench/prefill_ab.py, H100, session 40), the 27B's cold prefill to 200K:
7,222 against 5,005 tok/s with bf16 KV, 6,933 against 4,093 with rk4v4-e8. The chunk's keys are taken in
segments of SEGMENT_KEYS: the keys before the chunk unmasked, then the chunk's own keys as a square causal block;
each segment returns its outputs and log-sum-exps, and the segments merge exactly (o = sum_i o_i exp(lse_i - lse),
lse = logaddexp over i). Segments bound the gathered copy (memory_plan counts it) whatever the depth. Compressed
codecs decode their segment to fp16 first (kv_decode: one launch per side; the keys' rotated basis, as the queries
arrive).

Host-side lengths are needed (each segment is a shape): the engine passes them for its eager prefill chunks;
CUDA-graph pieces keep the paged kernel, and so (under `auto`) do chunks ending before MIN_CONTEXT keys and odd
pieces ending before DEEP_CONTEXT (route_wanted); NINFER_PREFILL_ATTENTION=cudnn takes every eager chunk of
MIN_ROWS rows or more. On the CPU the same segments
run through plain-torch attention.
"""

from __future__ import annotations

import sys

import torch

from runtime.kv.codecs import Codec

from ..switches import setting
from .kv_decode import kv_decode, kv_decode_reference, page_span

SEGMENT_KEYS = 32_768  # keys gathered at once: 128 MiB of bf16 K + V at 4 KV heads x 256
# every shape cuDNN sees is a multiple of this many rows and keys (cuDNN builds an execution plan per new shape, and
# a server's tail chunks and reused prefixes come in any length): query rows padded with zero rows (dropped), the
# prefix's last keys short of a multiple moved into the causal block, which is padded at both ends (see _pad_rows)
SHAPE_STEP = 256
MIN_ROWS = 256  # shorter chunks (verify blocks, riders) keep the paged kernel
# chunks ending before this many keys keep the paged kernel too: there attention is a small part of a chunk, and
# cuDNN builds an execution plan for every new shape (a prompt's tail chunk is one). From 8K keys it pays (27B bf16,
# H100, cold prefill with cuDNN at every depth against the paged kernel: 8K 12,556 / 12,487 tok/s, 16K 11,917 /
# 11,623, 32K 11,397 / 10,486, where the old bound of 32K keys gave 10,865 at 32K)
MIN_CONTEXT = 8_192
# Below DEEP_CONTEXT keys only whole chunks take it (rows and start multiples of REGULAR_ROWS: the few shapes of
# chunked long prompts, built once), so a server's odd tails at shallow depth do not each pay for a new plan where
# the gain is a few percent; from DEEP_CONTEXT on every eager chunk of MIN_ROWS+ rows does (1.3-1.7x at 128K-200K)
DEEP_CONTEXT = 32_768
REGULAR_ROWS = 2_048
MODE = setting("NINFER_PREFILL_ATTENTION")
_BROKEN: list[str] = []  # the first failure of the cuDNN call, after which the paged kernel takes over


_OPERANDS = {"contiguous": False}  # copies made contiguous first, where the probe found strided ones refused
_CHECKED: set[tuple] = set()  # (device, heads, kv heads, head dim, dtype) the probe passed for


def route_wanted(rows: int, host_ctx) -> bool:
    """The rule alone: a chunk of >= MIN_ROWS rows whose lengths are known; under `auto` ending at >= DEEP_CONTEXT
    keys, or at >= MIN_CONTEXT keys as a whole chunk (rows and start multiples of REGULAR_ROWS); at any depth under
    `cudnn`, never under `triton`."""
    if MODE == "triton" or host_ctx is None or rows < MIN_ROWS:
        return False
    deepest = max(host_ctx)
    if MODE == "cudnn" or deepest >= DEEP_CONTEXT:
        return True
    return deepest >= MIN_CONTEXT and rows % REGULAR_ROWS == 0 and all((n - rows) % REGULAR_ROWS == 0 for n in host_ctx)


def segment_dtype(codec: Codec, device: torch.device) -> torch.dtype:
    """The attention operands' dtype: the bf16 cache's own, fp16 for decoded compressed codecs (as the paged kernel's
    tensor-core operands), float32 for the CPU's plain-torch segments."""
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if codec.key == codec.value == "bf16" else torch.float16


def vendor_prefill(q: torch.Tensor, host_ctx, codec: Codec, kv_heads: int) -> bool:
    """Whether this chunk's attention takes the cuDNN route: a GPU chunk of >= MIN_ROWS rows whose lanes'
    lengths the caller knows on the host, cuDNN attention present, not turned off, not failed before, and
    its outputs and log-sum-exps checked once against plain torch at these head counts (_probe)."""
    if not route_wanted(q.shape[1], host_ctx) or _BROKEN or q.device.type != "cuda":
        return False
    dtype = segment_dtype(codec, q.device)
    if torch.cuda.is_current_stream_capturing():
        return False
    if not (torch.backends.cudnn.is_available() and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention")):
        return False
    key = (q.device, q.shape[2], kv_heads, q.shape[3], dtype)
    if key not in _CHECKED:
        _probe(q.device, q.shape[2], kv_heads, q.shape[3], dtype)
        if _BROKEN:
            return False
        _CHECKED.add(key)
    return True


def _probe(device, heads: int, kv_heads: int, head_dim: int, dtype) -> None:
    """One small chunk through cuDNN and through plain torch, unmasked and causal, laid out as the chunks come
    (queries a transposed [T, HQ, D] view, keys a slice of a gathered [HKV, S, D] copy): the merge relies on
    the kernel's GQA grouping, its causal alignment and its log-sum-exps in natural log, none of which a wrong
    answer would announce. Where the strided operands fail, contiguous copies are tried; a mismatch or an error
    either way sends every chunk to the paged kernel."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(96, heads, head_dim, device=device, generator=g).to(dtype).transpose(0, 1)[None]
    k = torch.randn(kv_heads, 128, head_dim, device=device, generator=g).to(dtype)[None, :, 16:112]
    v = torch.randn(kv_heads, 128, head_dim, device=device, generator=g).to(dtype)[None, :, 16:112]
    failure = None
    for contiguous in (False, True):
        _OPERANDS["contiguous"] = contiguous
        try:
            for causal in (False, True):
                o, lse = _segment_cudnn(q, k, v, causal, head_dim ** -0.5)
                o_ref, lse_ref = _segment_reference(q, k, v, causal, head_dim ** -0.5)
                o_err = (o.float() - o_ref.float()).abs().max().item()
                lse_err = (lse.float().reshape(lse_ref.shape) - lse_ref).abs().max().item()
                if not (o_err < 2e-2 and lse_err < 2e-2):
                    raise RuntimeError(f"cuDNN attention differs from torch (causal={causal}: output {o_err:.3g}, "
                                       f"log-sum-exp {lse_err:.3g})")
            return
        except RuntimeError as exc:
            failure = failure or exc
    _fail(failure)


def _fail(exc: Exception) -> None:
    _BROKEN.append(f"{type(exc).__name__}: {exc}"[:300])
    print(f"ninfer: cuDNN prefill attention is off, the paged kernel takes over ({_BROKEN[0]})", file=sys.stderr)


def _segment_cudnn(q, k, v, causal: bool, scale: float):
    """cuDNN attention of q [1, HQ, T, D] over k, v [1, HKV, S, D] (GQA: HQ a multiple of HKV): (o, lse [1, HQ, T])."""
    if _OPERANDS["contiguous"]:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out[0], out[1]


def _segment_reference(q, k, v, causal: bool, scale: float):
    """The same in float32 torch (CPU runs and tests)."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    s = torch.einsum("bhtd,bhsd->bhts", q.float(), kk) * scale
    if causal:
        t, n = s.shape[-2:]
        s = s.masked_fill(torch.ones(t, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.einsum("bhts,bhsd->bhtd", torch.softmax(s, -1), vv).to(q.dtype), lse


def _keys(pool, codec: Codec, pages: torch.Tensor, first: int, last: int, dtype,
          head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions [first, last) of one lane, [1, HKV, last - first, D] in `dtype`, each head's
    rows contiguous (one gathering copy out of the pages, or one decoding launch per side)."""
    if codec.key == "bf16" and codec.value == "bf16":  # [pages, 64, HKV, D] -> [HKV, pages, 64, D]
        index, skip = page_span(pages, first, last)
        k = pool["k_data"].permute(2, 0, 1, 3).index_select(1, index).flatten(1, 2)[:, skip : skip + last - first]
        v = pool["v_data"].permute(2, 0, 1, 3).index_select(1, index).flatten(1, 2)[:, skip : skip + last - first]
        return k[None], v[None]
    if pages.device.type == "cuda":  # straight to fp16 [HKV, last - first, D]
        return (kv_decode(pool, codec, "k", pages, first, last, head_dim)[None],
                kv_decode(pool, codec, "v", pages, first, last, head_dim)[None])
    # the CPU: the codecs' float32 decoders
    return (kv_decode_reference(pool, codec, "k", pages, first, last, dtype)[None],
            kv_decode_reference(pool, codec, "v", pages, first, last, dtype)[None])


def prefill_attention_segments(q: torch.Tensor, pool: dict[str, torch.Tensor], codec: Codec, block_table: torch.Tensor,
                               host_ctx, scale: float, segment_keys: int = SEGMENT_KEYS) -> torch.Tensor:
    """q [lanes, T, HQ, D] (rotated when the codec rotates keys) of chunks ending at host_ctx[lane] tokens ->
    [lanes, T, HQ, D] in the value storage basis, like paged_attention."""
    lanes, t = q.shape[:2]
    segment = _segment_cudnn if q.device.type == "cuda" else _segment_reference
    dtype = segment_dtype(codec, q.device)
    out = torch.empty_like(q)
    for lane in range(lanes):
        n = int(host_ctx[lane])
        before = n - t
        qt = q[lane].transpose(0, 1)[None].to(dtype)  # [1, HQ, T, D], a view of the bf16 rows
        q_prefix = _pad_rows(qt, 0, _step_up(t))
        acc = lse = None
        # the prefix in whole segments, the last one cut to a multiple of SHAPE_STEP; its remainder joins the chunk's
        # own keys in the causal block
        aligned = before - (before % segment_keys) % SHAPE_STEP
        bounds = [(s, min(s + segment_keys, aligned), False) for s in range(0, aligned, segment_keys)]
        for first, last, causal in bounds + [(aligned, n, True)]:
            k, v = _keys(pool, codec, block_table[lane], first, last, dtype, q.shape[-1])
            skip = last - first - t if causal else 0  # the causal block's leading rows: the prefix's remainder keys
            if causal:
                size = _step_up(last - first)
                q_i, k, v = _pad_rows(qt, skip, size), _pad_rows(k, 0, size), _pad_rows(v, 0, size)
            else:
                q_i = q_prefix
            try:
                o_i, lse_i = segment(q_i, k, v, causal, scale)
            except RuntimeError as exc:
                if segment is _segment_reference:
                    raise
                _fail(exc)
                raise VendorFallback from exc
            o_i = o_i[:, :, skip : skip + t]
            lse_i = lse_i.float().reshape(1, q.shape[2], -1)[:, :, skip : skip + t]
            if acc is None:
                acc, lse = o_i.float(), lse_i
                continue
            merged = torch.logaddexp(lse, lse_i)
            acc.mul_(torch.exp(lse - merged)[..., None]).addcmul_(o_i, torch.exp(lse_i - merged)[..., None])
            lse = merged
        out[lane] = acc[0].transpose(0, 1).to(q.dtype)
    return out


def _step_up(rows: int) -> int:
    return -(-rows // SHAPE_STEP) * SHAPE_STEP


def _pad_rows(x: torch.Tensor, before: int, size: int) -> torch.Tensor:
    """x [1, H, R, D] with `before` zero rows ahead of it and zero rows after, `size` rows in all (x itself when
    nothing is added). In the causal block (top-left aligned) a query row sees the keys up to its own index: rows
    ahead of the chunk's queries stand for the prefix keys' remainder, and the zero keys after the last real key are
    seen only by the zero rows after the last real query, so every real row's result is unchanged."""
    rows = x.shape[2]
    if before == 0 and rows == size:
        return x
    padded = x.new_zeros(x.shape[0], x.shape[1], size, x.shape[3])
    padded[:, :, before : before + rows] = x
    return padded


class VendorFallback(RuntimeError):
    """The cuDNN call failed once: the caller runs the paged kernel instead (and every later chunk does)."""
