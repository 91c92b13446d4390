"""One side (keys or values) of a lane's KV positions [first, last), decoded out of the pages into a dense fp16
[HKV, last - first, D] tensor in the storage basis: what the cuDNN prefill route (prefill_attention_vendor) attends
to for compressed codecs. One launch reads the codes once with the paged-attention kernel's decoders; the torch
reference (the codec's decoders over gathered pages) made ~10 passes over float32 temporaries per segment.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kv.codecs import Codec

from . import torch_path
from .launch import LAUNCH, pdl_wait
from .paged_attention import KIND_IDS, PAGE, _code_halves, _decode_rows, _plane_names

BLOCK_N = 32


@triton.jit
def _kv_decode_kernel(p0, p1, out_ptr, pages_ptr, first, count, HKV, KIND: tl.constexpr, D: tl.constexpr,
                      W0: tl.constexpr, W1: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (tile of BLOCK_N positions, kv head): out[head, i] = decoded vector of position first + i."""
    pdl_wait()
    i = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    head = tl.program_id(1)
    ok = i < count
    n = first + i
    page = tl.load(pages_ptr + n // 64, mask=ok, other=0)
    row = (page * 64 + n % 64) * HKV + head
    dst = out_ptr + (head * count + i[:, None]) * D
    HALVES: tl.constexpr = (KIND == 2) or (KIND == 4) or (KIND == 5)
    if HALVES:
        even, odd = _code_halves(p0, p1, row, ok, KIND, D, W0, W1, BLOCK_N, False)
        j = tl.arange(0, D // 2)
        tl.store(dst + 2 * j[None, :], even.to(tl.float16), mask=ok[:, None])
        tl.store(dst + 2 * j[None, :] + 1, odd.to(tl.float16), mask=ok[:, None])
    else:
        d = tl.arange(0, D)
        x = _decode_rows(p0, p1, row, ok, KIND, D, W0, W1, BLOCK_N)
        tl.store(dst + d[None, :], x.to(tl.float16), mask=ok[:, None])


def kv_decode(pool: dict[str, torch.Tensor], codec: Codec, side: str, pages: torch.Tensor, first: int, last: int,
              head_dim: int) -> torch.Tensor:
    """Positions [first, last) of one lane (its block-table row `pages`), side "k" or "v" -> [HKV, last - first, D]
    fp16 in the storage basis."""
    kind = codec.key if side == "k" else codec.value
    names = _plane_names(kind)
    p0, p1 = pool[f"{side}_{names[0]}"], pool[f"{side}_{names[-1]}"]
    hkv = p0.shape[2]
    if torch_path(p0):
        return kv_decode_reference(pool, codec, side, pages, first, last)
    d, count = head_dim, last - first
    out = torch.empty(hkv, count, d, dtype=torch.float16, device=p0.device)
    _kv_decode_kernel[(triton.cdiv(count, BLOCK_N), hkv)](
        p0, p1, out, pages, first, count, hkv, KIND=KIND_IDS[kind], D=d, W0=p0.shape[-1], W1=p1.shape[-1],
        BLOCK_N=BLOCK_N, **LAUNCH)
    return out


def page_span(pages: torch.Tensor, first: int, last: int) -> tuple[torch.Tensor, int]:
    """The pages holding positions [first, last) of a lane (its block-table row `pages`), and where `first` sits
    in the first of them."""
    p0 = first // PAGE
    return pages[p0 : -(-last // PAGE)].long(), first - p0 * PAGE


def kv_decode_reference(pool, codec: Codec, side: str, pages: torch.Tensor, first: int, last: int,
                        dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """The codec's torch decoders (float32) over the gathered pages, in `dtype`."""
    index, skip = page_span(pages, first, last)
    planes = {name: plane.index_select(0, index) for name, plane in pool.items() if name.startswith(side + "_")}
    x = codec.decode_keys(planes) if side == "k" else codec.decode_values(planes)  # [pages, 64, HKV, D]
    x = x.permute(2, 0, 1, 3).reshape(x.shape[2], -1, x.shape[-1])
    return x[:, skip : skip + last - first].to(dtype)
