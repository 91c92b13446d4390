"""Causal GQA attention over a paged KV pool in any codec of specs/kv-codecs.md.

Pool planes are [pages, 64, kv_heads, width]; a lane's block table maps its logical pages to
physical ones. Each program takes a block of query rows of one (lane, kv head) — every query head
of the GQA group at once — and one split of the lane's keys (the grid is sized for the pool's capacity;
a lane's context is spread over all its splits), decodes K and V tiles in registers and keeps an online
softmax; a second kernel merges the splits. Vectors
are handled as even/odd element halves, so packed nibble codecs never interleave in registers.
Rotations (rk codecs) happen outside: queries arrive rotated, outputs leave rotated.

Tensor-core operands are 16-bit: bf16 for the bf16 cache, fp16 for every compressed codec. Integer
codes become fp16 with one logic op (the code's offset-binary bits OR'd into the mantissa of 1024.0)
and one subtraction, and each 64-group's scale is loaded once per token, not once per element —
per-element scale gathers and int-to-float conversions made the compressed codecs slower than bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from runtime.kv.codecs import Codec

from ..switches import setting
from . import interpreted, torch_path
from .hadamard import rotate_group64
from .launch import LAUNCH, pdl_wait
from .qgemv_int8 import write_quantized_x

PAGE = 64
SPLIT_TOKENS = 0  # fixed keys per split when nonzero (tests); 0 = sized by split_size()
MIN_SPLIT = 64  # short splits keep short contexts parallel; the merge reads only splits with keys
# Blocks of COMBINE_ROWS rows of a (lane, kv head) merged side by side per combine program (_combine_rows_kernel)
# where it has COMBINE_MIN_ROWS rows or more, i.e. prefill chunks: a 512-token 27B chunk's combine is 49,152
# one-row programs otherwise. H100, riding chunk with 3 riders: combine 108 -> 24 µs a layer, 32K prefill beside
# 3 decoding lanes in 512-token chunks gap 58.5 / 59.6 -> 56.5 / 56.1 ms (session 43). NINFER_COMBINE_ROWS=0: a row
# a program, as before.
COMBINE_ROWS = int(setting("NINFER_COMBINE_ROWS"))
COMBINE_MIN_ROWS = 256
# Decode and verify blocks (<= 32 query rows): (keys per tile, warps, programs) by key sub-codec. The
# programs split the keys of each (lane, kv head, row block); int4 and nvfp4 keys run as one wave of
# two-warp programs (4 per SM by registers x 132 SMs ~ 512: no cross-warp softmax traffic beyond two warps,
# no second partial wave). H200 sweeps at 200K (the run record (`git show 5d8956c:bench/RESULTS.md`) §10, §14): rk4v4-e8 230.5 -> 171.9 us per
# layer (T = 1) and 393 -> 320 us (T = 4); nvfp4 (was 16 keys x 4 warps) 604 -> 344 and 890 -> 475 us;
# e8cube (run 25) one-warp 16-key programs: 709 -> 416 us (T = 1), 1,100 -> 760 us (T = 4).
ATTENTION_TILES = {"bf16": (32, 4, 1024), "int8g64": (64, 4, 1024), "int4g64": (64, 2, 512), "int4g64e8": (64, 2, 512),
                   "fp8row": (32, 4, 1024), "nvfp4": (32, 2, 512), "e8cube": (16, 1, 1024)}
# Verify blocks (17..32 rows, e.g. MTP3's 24) of int4 codes: 32-key tiles with fp16 operands through ldmatrix
# (run 26, T = 4 at 200K: 310 -> 266 us per layer)
VERIFY_TILES = {"int4g64": (32, 2, 512), "int4g64e8": (32, 2, 512)}
# Prefill row blocks (64 rows) keep four-warp tiles: two warps would hold a 64 x D float32 accumulator.
# Pipeline stages per key sub-codec where measured (session 39, H100, attention_compare.py prefill, a 2,048-row
# chunk at 8K / 128K / 200K): bf16 with 2 stages 309 / 318 / 309 TFLOP/s against 274 / 283 / 304 with triton's default
PREFILL_STAGES = {"bf16": 2}
PREFILL_TILES = {"bf16": (32, 4), "int8g64": (64, 4), "int4g64": (64, 4), "int4g64e8": (64, 4), "fp8row": (32, 4),
                 "nvfp4": (16, 4), "e8cube": (16, 4)}
ATTENTION_TUNING: dict[str, int] = {}  # block_m / block_n / num_warps / programs / num_stages overrides for sweeps


def _tile_overrides(text: str) -> dict[str, tuple[int, int, int]]:
    """NINFER_ATTENTION_TILES="int4g64e8=64x4@1024,nvfp4=16x4": decode/verify tiles (keys per tile x warps
    [@ programs], 1024 programs when left out) per key sub-codec, for side-by-side runs of the engine."""
    tiles = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, _, tile = item.partition("=")
        tile, _, programs = tile.partition("@")
        keys, _, warps = tile.partition("x")
        if kind not in ATTENTION_TILES or not (keys.isdigit() and warps.isdigit() and (programs or "1").isdigit()):
            raise ValueError(f"NINFER_ATTENTION_TILES item {item!r}: write KIND=KEYSxWARPS[@PROGRAMS] with KIND one "
                             f"of {', '.join(ATTENTION_TILES)}, e.g. int4g64e8=64x4@1024")
        tiles[kind] = (int(keys), int(warps), int(programs or 1024))
    return tiles


ATTENTION_TILES.update(_tile_overrides(setting("NINFER_ATTENTION_TILES")))

PREFILL_BLOCK_M = 64
PREFILL_PROGRAMS = 1024  # prefill chunks fill the GPU with row blocks: one split (no combine) from 1,024 up
PREFILL_MIN_ROWS = 256
VERIFY_MAX_BLOCK_M = 32  # 17..255 rows (verify blocks, several lanes' short steps)
KIND_IDS = {"bf16": 0, "int8g64": 1, "int4g64": 2, "int4g64e8": 2, "fp8row": 3, "nvfp4": 4, "e8cube": 5}
HALF_KIND_IDS = (2, 4, 5)  # decoded as even/odd halves (the kernel's K_HALVES / V_HALVES)
_NATIVE = tl.constexpr(not interpreted())  # inline PTX on a GPU; plain ops interpreted


@triton.jit
def _e4m3(byte):
    """Decode E4M3FN bits (int32) to float32 without relying on hardware fp8 support."""
    sign = tl.where((byte & 0x80) != 0, -1.0, 1.0)
    e = (byte >> 3) & 0xF
    m = (byte & 0x7).to(tl.float32)
    normal = (1.0 + m / 8.0) * tl.exp2(e.to(tl.float32) - 7.0)
    sub = m / 8.0 * 0.015625
    return sign * tl.where(e == 0, sub, normal)


@triton.jit
def _e8cube_halves(p0, p1, row, tok_ok, D: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """e8cube codes (specs/kv-codecs.md §4.2) of the vectors at pool rows `row` -> (even, odd) fp16 halves
    [BLOCK_N, D/2], by bit operations: 4·value = q = ±(2 + 4·magnitude bit) ± 1, an odd integer in
    [-7, 7], placed into fp16 like an int4 code, times the group scale / 4."""
    G: tl.constexpr = D // 64
    g = tl.arange(0, G)
    h = tl.arange(0, 32)  # position within a group's half: sub-vector h // 4, element pair h % 4
    m = tok_ok[:, None, None]
    at = p0 + row[:, None, None] * W0 + 2 * (g[None, :, None] * 8 + h[None, None, :] // 4)
    mag = tl.load(at, mask=m, other=0).to(tl.int32)  # [BLOCK_N, G, 32]
    sign = tl.load(at + 1, mask=m, other=0).to(tl.int32)
    parity = (sign & 0x7F) ^ mag
    parity ^= parity >> 4
    parity ^= parity >> 2
    parity ^= parity >> 1
    neg = (sign & 0x7F) | ((parity & 1) << 7)  # coordinate 7's sign puts the point on E8
    # q + 8 = 2w + 1 with w = (not minus, magnitude bit xor minus, not shifted down) as bits 2..0: per
    # sub-vector, bit i of x4 (>> 2) and y8 (>> 3) are element i's bits 2 and 3; base carries bits 0-1
    # and 1024.0's exponent, so one shift and one mask per bit place an element into fp16 as 1032 + q
    x4 = (mag ^ neg) << 2
    y8 = (~neg & 0xFF) << 3
    base = 0x6401 | (((sign >> 6) & 2) ^ 2)
    s = tl.load(p1 + row[:, None] * W1 + g[None, :], mask=tok_ok[:, None], other=0.0).to(tl.float16)[:, :, None] * 0.25
    i = 2 * (h % 4)[None, None, :]
    u_even = base | ((x4 >> i) & 4) | ((y8 >> i) & 8)
    u_odd = base | ((x4 >> (i + 1)) & 4) | ((y8 >> (i + 1)) & 8)
    even = (u_even.to(tl.int16).to(tl.float16, bitcast=True) - 1032.0) * s
    odd = (u_odd.to(tl.int16).to(tl.float16, bitcast=True) - 1032.0) * s
    return tl.reshape(even, (BLOCK_N, D // 2)), tl.reshape(odd, (BLOCK_N, D // 2))


@triton.jit
def _code_halves(p0, p1, row, tok_ok, KIND: tl.constexpr, D: tl.constexpr, W0: tl.constexpr,
                 W1: tl.constexpr, BLOCK_N: tl.constexpr, LDMATRIX: tl.constexpr):
    """Vectors of the half-split codecs (int4 groups, nvfp4, e8cube) at pool rows `row` as (even, odd)
    fp16 halves [BLOCK_N, D/2]."""
    if KIND == 2:
        return _int4_halves(p0, p1, row, tok_ok, D, W0, W1, BLOCK_N, LDMATRIX)
    elif KIND == 4:
        return _nvfp4_halves(p0, p1, row, tok_ok, D, W0, W1, BLOCK_N)
    else:
        return _e8cube_halves(p0, p1, row, tok_ok, D, W0, W1, BLOCK_N)


@triton.jit
def _int4_halves(p0, p1, row, tok_ok, D: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr,
                 BLOCK_N: tl.constexpr, LDMATRIX: tl.constexpr):
    """int4 g64 codes of the vectors at pool rows `row` -> (even, odd) halves [BLOCK_N, D/2] fp16.
    Byte j of a group holds elements 2j (low nibble) and 2j+1; the code byte tile is loaded once."""
    G: tl.constexpr = D // 64
    g = tl.arange(0, G)
    j = tl.arange(0, 32)
    m = tok_ok[:, None, None]
    b = tl.load(p0 + row[:, None, None] * W0 + g[None, :, None] * 32 + j[None, None, :], mask=m, other=0)
    s = tl.load(p1 + row[:, None] * W1 + g[None, :], mask=tok_ok[:, None], other=0.0).to(tl.float16)[:, :, None]
    lo = (_nibble_f16(b, 0, LDMATRIX) - 1032.0) * s
    hi = (_nibble_f16(b, 1, LDMATRIX) - 1032.0) * s
    return tl.reshape(lo, (BLOCK_N, D // 2)), tl.reshape(hi, (BLOCK_N, D // 2))


@triton.jit
def _nvfp4_halves(p0, p1, row, tok_ok, D: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, BLOCK_N: tl.constexpr):
    """nvfp4 codes of the vectors at pool rows `row` -> (even, odd) halves [BLOCK_N, D/2] fp16, exact.
    An E2M1 nibble's bits placed at fp16 bits 9-11 (sign at 15) read as its value x 2^-14; E4M3 bits at
    fp16 bits 7-13 (sign at 15) as its value x 2^-8; both rescale exactly, and their product (at most
    2 x 4 significant bits, 2^-10 .. 2,688) is exact in fp16. One scale decode per 16 elements."""
    G: tl.constexpr = D // 16
    g = tl.arange(0, G)
    j = tl.arange(0, 8)
    b = tl.load(p0 + row[:, None, None] * W0 + g[None, :, None] * 8 + j[None, None, :], mask=tok_ok[:, None, None],
                other=0).to(tl.int32)
    sb = tl.load(p1 + row[:, None] * W1 + g[None, :], mask=tok_ok[:, None], other=0).to(tl.int32)
    s = (((sb & 0x80) << 8) | ((sb & 0x7F) << 7)).to(tl.int16).to(tl.float16, bitcast=True) * 256.0
    lo = (((b & 0x8) << 12) | ((b & 0x7) << 9)).to(tl.int16).to(tl.float16, bitcast=True) * 16384.0
    hi = (((b & 0x80) << 8) | ((b & 0x70) << 5)).to(tl.int16).to(tl.float16, bitcast=True) * 16384.0
    return (tl.reshape(lo * s[:, :, None], (BLOCK_N, D // 2)), tl.reshape(hi * s[:, :, None], (BLOCK_N, D // 2)))


@triton.jit
def _nibble_f16(b, ODD: tl.constexpr, LDMATRIX: tl.constexpr):
    """Code bytes (uint8) -> 1032 + n in fp16 for the low (ODD = 0) or high nibble n (two's complement):
    n ^ 8 = n + 8 in 0..15, OR'd into the mantissa of 1024.0. Natively two bytes per 32-bit op pair:
    one byte permute spreads them into the two fp16 halves of a register, one logic op masks, flips the
    sign bit and sets the exponent (Triton's per-byte integer ops cost ~5 instructions per element).
    With LDMATRIX the asm is marked impure, so Triton keeps the layout change for the dot after it:
    pure, the change is hoisted onto the code bytes, and value tiles (whose operand pairs run along
    keys, not along a byte row) are read from shared memory one byte per instruction. Impure, the fp16
    operands go through ldmatrix (sm_90a loop 2,556 -> 2,086 instructions) but take 2x the shared
    memory: on the H200 faster for 32-row verify blocks (T = 4 at 200K: 310 -> 266 us per layer),
    slower for 16-row decode blocks (166 -> 185 us at best), run 26."""
    if _NATIVE:
        return tl.inline_asm_elementwise(
            f"{{ .reg .b32 t; shr.u32 t, $2, {4 * ODD}; prmt.b32 $0, t, 0, 0x4140; prmt.b32 $1, t, 0, 0x4342; "
            "lop3.b32 $0, $0, 0x000F000F, 0x64086408, 0x6a; lop3.b32 $1, $1, 0x000F000F, 0x64086408, 0x6a; }",
            "=r,=r,r", [b], dtype=tl.float16, is_pure=not LDMATRIX, pack=4)
    else:
        return (((b.to(tl.int32) >> (4 * ODD)) & 0xF) ^ 0x6408).to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def _decode_rows(p0, p1, row, tok_ok, KIND: tl.constexpr, D: tl.constexpr, W0: tl.constexpr,
                 W1: tl.constexpr, BLOCK_N: tl.constexpr):
    """Whole vectors [BLOCK_N, D] (bf16 for the bf16 cache, else fp16) for the byte-per-element codecs.
    Nibble codecs stay as even/odd halves: interleaving them with join + reshape before a dot
    miscompiled on Hopper with triton 3.6 (wrong results, seen on the H200)."""
    m = tok_ok[:, None]
    if KIND == 0:
        d = tl.arange(0, D)
        return tl.load(p0 + row[:, None] * W0 + d[None, :], mask=m, other=0.0).to(tl.bfloat16)
    elif KIND == 1:
        G: tl.constexpr = D // 64
        g = tl.arange(0, G)
        j = tl.arange(0, 64)
        c = tl.load(p0 + row[:, None, None] * W0 + g[None, :, None] * 64 + j[None, None, :], mask=m[:, :, None],
                    other=0).to(tl.int32)
        s = tl.load(p1 + row[:, None] * W1 + g[None, :], mask=m, other=0.0).to(tl.float16)[:, :, None]
        # signed byte c -> c + 128 in 0..255, OR'd into 1024.0's mantissa: 1152 + c exactly
        x = (((c + 128) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1152.0) * s
        return tl.reshape(x, (BLOCK_N, D))
    elif KIND == 3:
        d = tl.arange(0, D)
        b = tl.load(p0 + row[:, None] * W0 + d[None, :], mask=m, other=0).to(tl.int32)
        s = tl.load(p1 + row * W1, mask=tok_ok, other=0.0).to(tl.float32)
        return (_e4m3(b) * s[:, None]).to(tl.float16)
    else:
        tl.static_assert(False, "nibble codecs are decoded as even/odd halves")


@triton.jit
def _paged_attention_kernel(q_ptr, part_o_ptr, part_ml_ptr, k0, k1, v0, v1, block_table_ptr, ctx_len_ptr,
                            T, HQ, HKV, PAGES_PER_LANE, SPLITS, SPLIT_MIN, scale,
                            D: tl.constexpr, KK: tl.constexpr, VK: tl.constexpr,
                            KW0: tl.constexpr, KW1: tl.constexpr, VW0: tl.constexpr, VW1: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr,
                            LDMATRIX: tl.constexpr):
    """One (lane, kv head, row block, key split). Rows are (t, g) pairs of the kv head's query group,
    so each key tile is decoded once for all of its G query heads (GQA packing). DIRECT (one split):
    part_o_ptr is the output [lanes, T, HQ, D] itself and the rows are finished here, no combine.
    LDMATRIX: int4 operands reach the dots as fp16 through ldmatrix (see _nibble_f16)."""
    pdl_wait()
    lane_kvh = tl.program_id(0)
    mblock = tl.program_id(1)
    split = tl.program_id(2)
    lane = lane_kvh // HKV
    kvh = lane_kvh % HKV
    group = HQ // HKV
    dfull = tl.arange(0, D)
    r = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_total = T * group
    r_ok = r < rows_total
    t_of = r // group
    head = kvh * group + r % group
    ctx = tl.load(ctx_len_ptr + lane)
    split_len = _split_len(ctx, SPLITS, SPLIT_MIN, BLOCK_N)
    q_pos = ctx - T + t_of
    q_base = q_ptr + ((lane * T + t_of[:, None]) * HQ + head[:, None]) * D
    K_HALVES: tl.constexpr = (KK == 2) or (KK == 4) or (KK == 5)
    V_HALVES: tl.constexpr = (VK == 2) or (VK == 4) or (VK == 5)
    dh = tl.arange(0, D // 2)
    if K_HALVES:
        q_even = tl.load(q_base + 2 * dh[None, :], mask=r_ok[:, None], other=0.0).to(tl.float16)
        q_odd = tl.load(q_base + 2 * dh[None, :] + 1, mask=r_ok[:, None], other=0.0).to(tl.float16)
    elif KK == 0:
        q = tl.load(q_base + dfull[None, :], mask=r_ok[:, None], other=0.0).to(tl.bfloat16)
    else:
        q = tl.load(q_base + dfull[None, :], mask=r_ok[:, None], other=0.0).to(tl.float16)
    if V_HALVES:
        acc_even = tl.zeros((BLOCK_M, D // 2), tl.float32)
        acc_odd = tl.zeros((BLOCK_M, D // 2), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, D), tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    last_row_t = tl.minimum((mblock * BLOCK_M + BLOCK_M - 1) // group, T - 1)
    visible_end = ctx - T + last_row_t + 1  # keys past the block's last query are never visible
    begin = split * split_len
    end = tl.minimum(begin + split_len, visible_end)
    for n0 in range(begin, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        page = tl.load(block_table_ptr + lane * PAGES_PER_LANE + n // 64, mask=n_ok, other=0)
        row = (page * 64 + n % 64) * HKV + kvh
        if K_HALVES:
            k_even, k_odd = _code_halves(k0, k1, row, n_ok, KK, D, KW0, KW1, BLOCK_N, LDMATRIX)
            s = tl.dot(q_even, tl.trans(k_even)) + tl.dot(q_odd, tl.trans(k_odd))
        else:
            k = _decode_rows(k0, k1, row, n_ok, KK, D, KW0, KW1, BLOCK_N)
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if V_HALVES:
            v_even, v_odd = _code_halves(v0, v1, row, n_ok, VK, D, VW0, VW1, BLOCK_N, LDMATRIX)
            p16 = p.to(tl.float16)
            acc_even = acc_even * alpha[:, None] + tl.dot(p16, v_even)
            acc_odd = acc_odd * alpha[:, None] + tl.dot(p16, v_odd)
        else:
            v = _decode_rows(v0, v1, row, n_ok, VK, D, VW0, VW1, BLOCK_N)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    if DIRECT:  # prefill: one split holds every key, so the rows are final and go to the output itself
        dst = ((lane * T + t_of) * HQ + head) * D
        l_safe = tl.where(l_i > 0, l_i, 1.0)[:, None]  # divided as the combine kernel does: same rounding
        if V_HALVES:
            acc_even, acc_odd = acc_even / l_safe, acc_odd / l_safe
        else:
            acc = acc / l_safe
    else:  # partials: [lane, kvh, split, row, D] and (m, l) as [lane, kvh, split, row, 2]
        part = ((lane_kvh * SPLITS + split) * rows_total + r)
        dst = part * D
        tl.store(part_ml_ptr + part * 2, m_i, mask=r_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=r_ok)
    out_ty = part_o_ptr.dtype.element_ty
    if V_HALVES:
        tl.store(part_o_ptr + dst[:, None] + 2 * dh[None, :], acc_even.to(out_ty), mask=r_ok[:, None])
        tl.store(part_o_ptr + dst[:, None] + 2 * dh[None, :] + 1, acc_odd.to(out_ty), mask=r_ok[:, None])
    else:
        tl.store(part_o_ptr + dst[:, None] + dfull[None, :], acc.to(out_ty), mask=r_ok[:, None])


@triton.jit
def _split_len(ctx, SPLITS, SPLIT_MIN, BLOCK_N: tl.constexpr):
    """Keys per split for a lane holding ctx keys: the lane's keys spread over all SPLITS programs (at
    least SPLIT_MIN each), so a short context under a long capacity still fills the GPU. The grid stays
    the capacity's, so a captured decode graph serves every depth."""
    return tl.maximum(SPLIT_MIN, tl.cdiv(tl.cdiv(ctx, SPLITS), BLOCK_N) * BLOCK_N)


@triton.jit
def _combine_kernel(part_o_ptr, part_ml_ptr, o_ptr, ctx_len_ptr, T, HQ, HKV, SPLITS, SPLIT_MIN,
                    qg_ptr, qg_stride, h_ptr, xq_ptr, ROW0, D: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, GATE: tl.constexpr = False,
                    ROTATE: tl.constexpr = False, QUANT: tl.constexpr = False, ROW_INTS: tl.constexpr = 0,
                    K_PAD: tl.constexpr = 0, QBITS: tl.constexpr = 4, GROUP: tl.constexpr = 64):
    """Merge the splits of one (lane, kv head, row) that hold keys visible to the row, with their
    log-sum-exp weights (splits past the row's last key contribute nothing and are not read). Each
    program takes BLOCK_D of the D lanes, so a long context's many splits are read by several
    programs in few steps rather than by one in a long dependent chain. With GATE (BLOCK_D = 64), the
    attention block's output gate follows as attention_gate computes it: o rounded to its dtype, H64-rotated
    back with ROTATE, times sigmoid(gate), written to o_ptr as rows [tokens, HQ * D] from row ROW0 on, and with
    QUANT also as the output product's dp4a words (a launch less per attention layer)."""
    pdl_wait()
    lane_kvh = tl.program_id(0)
    r = tl.program_id(1)
    lane = lane_kvh // HKV
    kvh = lane_kvh % HKV
    group = HQ // HKV
    rows_total = T * group
    ctx = tl.load(ctx_len_ptr + lane)
    visible_end = ctx - T + r // group + 1
    used = tl.minimum(tl.cdiv(visible_end, _split_len(ctx, SPLITS, SPLIT_MIN, BLOCK_N)), SPLITS)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_all = tl.full((1,), float("-inf"), tl.float32)
    l_all = tl.zeros((1,), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for s0 in range(0, used, BLOCK_S):  # BLOCK_S splits per step: a short dependent chain
        sp = s0 + tl.arange(0, BLOCK_S)
        ok = sp < used
        part = (lane_kvh * SPLITS + sp) * rows_total + r
        m = tl.load(part_ml_ptr + part * 2, mask=ok, other=float("-inf"))
        l = tl.load(part_ml_ptr + part * 2 + 1, mask=ok, other=0.0)
        o = tl.load(part_o_ptr + part[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        m_new = tl.maximum(m_all, tl.max(m, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp(m_all - m_safe)
        b = tl.exp(m - m_safe)
        acc = acc * a + tl.sum(o * b[:, None], axis=0)
        l_all = l_all * a + tl.sum(l * b, axis=0)
        m_all = m_new
    t = r // group
    head = kvh * group + r % group
    out = acc / tl.where(l_all > 0, l_all, 1.0)
    if GATE:
        token = ROW0 + lane * T + t
        o = out.to(o_ptr.dtype.element_ty).to(tl.float32)  # the attention output as the gate kernel reads it
        if ROTATE:
            o = rotate_group64(o, h_ptr)
        g = tl.load(qg_ptr + token * qg_stride + head * (2 * D) + D + d).to(tl.float32)
        y = (o * tl.sigmoid(g)).to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + token * (HQ * D) + head * D + d, y)
        if QUANT:
            write_quantized_x(xq_ptr + token * ROW_INTS, y.to(tl.float32), head * D + tl.program_id(2) * BLOCK_D,
                              K_PAD, QBITS, GROUP, BLOCK_D)
    else:
        tl.store(o_ptr + ((lane * T + t) * HQ + head) * D + d, out.to(o_ptr.dtype.element_ty))


def paged_attention(q: torch.Tensor, pool: dict[str, torch.Tensor], codec: Codec, block_table: torch.Tensor,
                    ctx_len: torch.Tensor, scale: float, out: torch.Tensor | None = None, gate=None,
                    host_ctx=None) -> torch.Tensor:
    """q [lanes, T, HQ, D] (rotated when the codec rotates keys); pool planes of one layer; block_table
    [lanes, pages_per_lane] int32; ctx_len [lanes] int32 = tokens in the cache including the T new ones.
    Returns [lanes, T, HQ, D] in the value storage basis; with `gate` (attention_gate.AttentionGate, a part
    for these rows), the gated rows [lanes * T, HQ * D] instead (gated in the combine launch when there is one).
    `host_ctx`: ctx_len on the host, where the caller knows it (eager prefill chunks): such chunks take cuDNN's
    attention (prefill_attention_vendor)."""
    from .prefill_attention_vendor import VendorFallback, prefill_attention_segments, vendor_prefill

    lanes, t, hq, d = q.shape
    hkv = next(iter(pool.values())).shape[2]
    o = None
    if vendor_prefill(q, host_ctx, codec, hkv):
        try:
            o = prefill_attention_segments(q, pool, codec, block_table, host_ctx, scale)
        except VendorFallback:
            pass
    if o is None and torch_path(q):
        o = paged_attention_reference(q, pool, codec, block_table, ctx_len, scale)
    if o is not None:  # the rows are final (cuDNN segments, the reference), gated apart
        o = out.copy_(o) if out is not None else o
        return gate.apply(o) if gate is not None else o
    from .paged_attention_frag import FRAG_ATTENTION, frag_attention_supported, paged_attention_frag

    fragment = FRAG_ATTENTION["mode"] == "on" or (FRAG_ATTENTION["mode"] == "auto" and not interpreted())
    if fragment and frag_attention_supported(codec, d, t * (hq // hkv)):
        return paged_attention_frag(q, pool, codec, block_table, ctx_len, scale, out, gate=gate)
    k0, k1 = pool["k_" + _plane_names(codec.key)[0]], pool["k_" + _plane_names(codec.key)[-1]]
    v0, v1 = pool["v_" + _plane_names(codec.value)[0]], pool["v_" + _plane_names(codec.value)[-1]]
    o = out if out is not None else torch.empty_like(q)
    group = hq // hkv
    rows = t * group
    block_m = ATTENTION_TUNING.get("block_m", query_block_rows(codec, rows))
    block_n, num_warps, target, ldmatrix = attention_tile(codec, block_m)
    capacity = block_table.shape[1] * PAGE
    split_tokens = split_size(capacity, lanes * hkv * triton.cdiv(rows, block_m), block_n, target)
    splits = triton.cdiv(capacity, split_tokens)
    split_min = split_tokens if SPLIT_TOKENS else -(-MIN_SPLIT // block_n) * block_n  # tests pin the split
    direct = splits == 1  # prefill chunks: enough row blocks to fill the GPU without splitting keys
    part_o = o if direct else torch.empty(lanes * hkv * splits * rows * d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(1 if direct else lanes * hkv * splits * rows * 2, dtype=torch.float32, device=q.device)
    grid = (lanes * hkv, triton.cdiv(rows, block_m), splits)
    _paged_attention_kernel[grid](
        q.contiguous(), part_o, part_ml, k0, k1, v0, v1, block_table, ctx_len,
        t, hq, hkv, block_table.shape[1], splits, split_min, scale,
        D=d, KK=KIND_IDS[codec.key], VK=KIND_IDS[codec.value],
        KW0=k0.shape[-1], KW1=k1.shape[-1], VW0=v0.shape[-1], VW1=v1.shape[-1],
        BLOCK_M=block_m, BLOCK_N=block_n, DIRECT=direct, LDMATRIX=ldmatrix, num_warps=num_warps,
        **_stages(codec, block_m), **LAUNCH)
    if direct:  # one split: the rows are final, gated apart
        return gate.apply(o) if gate is not None else o
    return combine_splits(part_o, part_ml, o, ctx_len, t, hq, hkv, splits, split_min, block_n, gate)


@triton.jit
def _combine_rows_kernel(part_o_ptr, part_ml_ptr, o_ptr, ctx_len_ptr, T, HQ, HKV, SPLITS, SPLIT_MIN,
                         qg_ptr, qg_stride, h_ptr, ROW0, D: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, GATE: tl.constexpr = False,
                         ROTATE: tl.constexpr = False):
    """_combine_kernel's merge for BLOCK_R rows of one (lane, kv head) side by side ([BLOCK_R, BLOCK_D] tiles, the
    splits one after the other, each row stopping at its own last visible split): a prefill chunk's thousands of
    rows in few programs. The output gate as _combine_kernel applies it (BLOCK_D = 64), without dp4a words."""
    pdl_wait()
    lane_kvh = tl.program_id(0)
    lane = lane_kvh // HKV
    kvh = lane_kvh % HKV
    group = HQ // HKV
    rows_total = T * group
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < rows_total
    ctx = tl.load(ctx_len_ptr + lane)
    used = tl.minimum(tl.cdiv(ctx - T + r // group + 1, _split_len(ctx, SPLITS, SPLIT_MIN, BLOCK_N)), SPLITS)
    used = tl.where(r_ok, used, 0)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_all = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    l_all = tl.zeros((BLOCK_R,), tl.float32)
    acc = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    for sp in range(0, tl.max(used, axis=0)):
        ok = sp < used
        part = (lane_kvh * SPLITS + sp) * rows_total + r
        m = tl.load(part_ml_ptr + part * 2, mask=ok, other=float("-inf"))
        l = tl.load(part_ml_ptr + part * 2 + 1, mask=ok, other=0.0)
        o = tl.load(part_o_ptr + part[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        m_new = tl.maximum(m_all, m)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp(m_all - m_safe)
        b = tl.exp(m - m_safe)
        acc = acc * a[:, None] + o * b[:, None]
        l_all = l_all * a + l * b
        m_all = m_new
    out = acc / tl.where(l_all > 0, l_all, 1.0)[:, None]
    t = r // group
    head = kvh * group + r % group
    if GATE:
        token = ROW0 + lane * T + t
        o = out.to(o_ptr.dtype.element_ty).to(tl.float32)  # the attention output as the gate kernel reads it
        if ROTATE:  # x @ H64 per row, in float32 (FMA, not the tensor cores' reduced precision)
            i = tl.arange(0, 64)
            o = tl.dot(o, tl.load(h_ptr + i[:, None] * 64 + i[None, :]), input_precision="ieee")
        g = tl.load(qg_ptr + (token * qg_stride + head * (2 * D) + D)[:, None] + d[None, :], mask=r_ok[:, None],
                    other=0.0).to(tl.float32)
        y = (o * tl.sigmoid(g)).to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + (token * (HQ * D) + head * D)[:, None] + d[None, :], y, mask=r_ok[:, None])
    else:
        tl.store(o_ptr + (((lane * T + t) * HQ + head) * D)[:, None] + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=r_ok[:, None])


def combine_splits(part_o, part_ml, o, ctx_len, t, hq, hkv, splits, split_min, block_n, gate=None):
    """The combine launch over the kernels' split partials; with `gate` (an AttentionGate part) the output gate
    too, into the part's rows of gate.y (and their dp4a words), which are returned in place of o."""
    lanes, d = o.shape[0], o.shape[-1]
    rows = t * (hq // hkv)
    block_d = 64 if d % 64 == 0 else d
    if COMBINE_ROWS and (COMBINE_ROWS < 16 or COMBINE_ROWS & (COMBINE_ROWS - 1)):
        raise ValueError(f"NINFER_COMBINE_ROWS={COMBINE_ROWS} is not a power of two from 16; unset it (0: a row a "
                         "program)")
    if COMBINE_ROWS and rows >= COMBINE_MIN_ROWS and d % 64 == 0 and (gate is None or not gate.quant["QUANT"]):
        grid = (lanes * hkv, triton.cdiv(rows, COMBINE_ROWS), d // 64)
        if gate is None:
            _combine_rows_kernel[grid](part_o, part_ml, o, ctx_len, t, hq, hkv, splits, split_min, o, 0, o, 0, D=d,
                                       BLOCK_R=COMBINE_ROWS, BLOCK_D=64, BLOCK_N=block_n, num_warps=4, **LAUNCH)
            return o
        _combine_rows_kernel[grid](part_o, part_ml, gate.y, ctx_len, t, hq, hkv, splits, split_min, gate.qg,
                                   gate.qg.stride(0), gate.hadamard, gate.row0, D=d, BLOCK_R=COMBINE_ROWS, BLOCK_D=64,
                                   BLOCK_N=block_n, GATE=True, ROTATE=gate.rotate, num_warps=4, **LAUNCH)
        return gate.y[gate.row0 : gate.row0 + lanes * t]
    if gate is None:
        _combine_kernel[(lanes * hkv, rows, d // block_d)](part_o, part_ml, o, ctx_len, t, hq, hkv, splits, split_min,
                                                           o, 0, o, o, 0, D=d, BLOCK_S=64, BLOCK_D=block_d,
                                                           BLOCK_N=block_n, num_warps=4, **LAUNCH)
        return o
    _combine_kernel[(lanes * hkv, rows, d // 64)](part_o, part_ml, gate.y, ctx_len, t, hq, hkv, splits, split_min,
                                                  gate.qg, gate.qg.stride(0), gate.hadamard, gate.words, gate.row0,
                                                  D=d, BLOCK_S=64, BLOCK_D=64, BLOCK_N=block_n, GATE=True,
                                                  ROTATE=gate.rotate, **gate.quant, num_warps=4, **LAUNCH)
    return gate.y[gate.row0 : gate.row0 + lanes * t]


def _stages(codec: Codec, block_m: int) -> dict[str, int]:
    """The launch's num_stages where one is set: a sweep's override, else a prefill block's measured stages."""
    if "num_stages" in ATTENTION_TUNING:
        return {"num_stages": ATTENTION_TUNING["num_stages"]}
    if block_m > VERIFY_MAX_BLOCK_M and codec.key in PREFILL_STAGES:
        return {"num_stages": PREFILL_STAGES[codec.key]}
    return {}


def attention_tile(codec: Codec, block_m: int) -> tuple[int, int, int, bool]:
    """(keys per tile, warps, target programs, int4 operands through ldmatrix) for `block_m`-row query
    blocks: prefill tiles past VERIFY_MAX_BLOCK_M rows, VERIFY_TILES for int4 keys in 17..32-row verify
    blocks, else ATTENTION_TILES; ATTENTION_TUNING overrides (sweeps)."""
    ldmatrix = 16 < block_m <= VERIFY_MAX_BLOCK_M and codec.key in VERIFY_TILES
    if block_m > VERIFY_MAX_BLOCK_M:
        (block_n, num_warps), target = PREFILL_TILES[codec.key], PREFILL_PROGRAMS
    elif ldmatrix:
        block_n, num_warps, target = VERIFY_TILES[codec.key]
    else:
        block_n, num_warps, target = ATTENTION_TILES[codec.key]
    return (ATTENTION_TUNING.get("block_n", block_n), ATTENTION_TUNING.get("num_warps", num_warps),
            ATTENTION_TUNING.get("programs", target), ldmatrix)


def query_block_rows(codec: Codec, rows: int) -> int:
    """Query rows per program. Every row block decodes each key/value tile again, so a verify block
    (T = 4: 24 rows of a 6-head group) takes one 32-row block rather than two of 16; prefill chunks
    take 64 (16-bit operands compile at 64 rows; fp32 ones hit "Illegal shared layout" in triton 3.6).
    Mixed layouts (whole-row keys with nibble-half values: rk8v4, k8v4) gave wrong results at 64 rows
    on the H200 (run 18b), so they keep 16-row blocks."""
    mixed = (KIND_IDS[codec.key] in HALF_KIND_IDS) != (KIND_IDS[codec.value] in HALF_KIND_IDS)
    if mixed or rows <= 16:
        return 16
    if rows >= PREFILL_MIN_ROWS:
        return PREFILL_BLOCK_M
    return min(VERIFY_MAX_BLOCK_M, triton.next_power_of_2(rows))


def split_size(capacity: int, programs: int, block_n: int, target: int) -> int:
    """Keys per split at full capacity: enough splits that ~`target` programs stream the cache, each at
    least MIN_SPLIT keys. This fixes the grid; the kernels spread a shorter context over the same splits
    (`_split_len`), and a split beyond a lane's context exits at once."""
    if SPLIT_TOKENS:
        return max(block_n, min(SPLIT_TOKENS, capacity))
    splits = max(1, target // max(1, programs))
    size = max(MIN_SPLIT, -(-capacity // splits))
    return -(-size // block_n) * block_n


def _plane_names(kind: str) -> list[str]:
    return ["data"] if kind == "bf16" else ["codes", "scales"]


def paged_attention_reference(q, pool, codec: Codec, block_table, ctx_len, scale):
    """Gather each lane's pages, decode with the reference codec, attend causally in float32."""
    lanes, t, hq, d = q.shape
    outs = []
    for lane in range(lanes):
        n = int(ctx_len[lane])
        idx = torch.arange(n)
        pages = block_table[lane, idx // PAGE].long()
        planes = {name: p[pages, idx % PAGE] for name, p in pool.items()}
        k, v = codec.decode_keys(planes), codec.decode_values(planes)  # [n, HKV, D]
        groups = hq // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        s = torch.einsum("thd,nhd->htn", q[lane].float(), k) * scale
        qpos = torch.arange(n - t, n)
        s = s.masked_fill(idx[None, None, :] > qpos[None, :, None], float("-inf"))
        outs.append(torch.einsum("htn,nhd->thd", s.softmax(-1), v))
    return torch.stack(outs).to(q.dtype)
