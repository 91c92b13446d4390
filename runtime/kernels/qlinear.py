"""y = x @ W^T with W in a row-split grouped format (Q4/Q5/Q6/W8), dequantized on the fly.

Decode (T = 1) runs the dp4a GEMV, verify blocks (T = 2..16) the int8 tensor-core row kernel (both in
qgemv_int8; NINFER_GEMV=float / NINFER_GEMV_ROWS=tensor select the float kernels here); prefill
(T > 16) dequantizes row chunks to dense once per call and hands them to the vendor GEMM. Nibble
formats are consumed as two half-width products, x[:, even] @ lo^T + x[:, odd] @ hi^T, so codes
are never interleaved in registers. Scales and high bits are loaded once per group / byte and
broadcast. When the output has few row blocks, K is split across programs: each writes a float32
partial and one deterministic sum finishes (no atomics, so results are reproducible).
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from format.numeric import GroupedFormat

from ..memory_plan import weight_cache_picks  # the weight cache's choice, as `ninfer fit` reports it
from ..switches import SWITCHES, setting
from . import interpreted, torch_path, tuning_from_env
from .qgemm_rows_bf16 import qgemm_rows_bf16
from .qgemm_fragment_int8 import qgemm_fragment_int8
from .qgemm_fragment_layout import (SWIGLU_FRAGMENT_KS, fragment_order, qgemm_fragment_layout, qgemm_fragment_swiglu,
                                    row_planes, swiglu_pair_supported)
from .qgemm_rows_frag import frag_supported, qgemm_rows_frag
from .qgemv_lanes import qgemv_lanes
from .qgemv_int8 import (INT8_BITS, QuantizedX, SplitPartials, finish_splits, qgemm_rows_int8, qgemm_rows_mma,
                         qgemv_int8, split_partials)
from .launch import LAUNCH, pdl_wait

TARGET_PROGRAMS = 512  # enough row-block x K-split programs to keep every SM streaming
GEMV_TUNING = {"block_n": 64, "block_k": 256, "num_warps": 4}  # tensor-core path, T = 2..16
VEC_TUNING = {"block_n": 8, "block_k": 512, "num_warps": 4}  # FMA path, T = 1 (best of the H200 sweep)
INT8_TUNING = {"block_n": 16, "block_k": 512, "num_warps": 4, "prequant": True}  # dp4a path, T = 1
# Q5 (MLP down 5120 x 17408, GDN out): 32 rows x 256 lanes x 8 warps, 4 K splits: down 30.4 -> 22.8 us (run 23)
INT8_TUNING_BY_BITS = {5: {"block_n": 32, "block_k": 256, "num_warps": 8}}
# Q4 products with many rows need no K split; 32 x 256 tiles stream them faster (MLP gate_up 34816 x
# 5120: 31.4 -> 27.4 us, run 23); fewer rows (GDN qkvz 16384) keep the default
INT8_TUNING_WIDE_Q4 = {"block_n": 32, "block_k": 256}
INT8_WIDE_ROWS = 32768
# dp4a T = 1: few-row, long-K products (MLP down 5120 x 17408, GDN/attention out) need K splits to keep
# enough loads in flight: at 512 programs the Q4 down shape ran at 0.37 of copy, at 1024 at 0.59 (run 23)
INT8_TARGET_PROGRAMS = 1024
PREQUANT_MIN_WEIGHTS = 1 << 22  # smaller matrices quantize x in-kernel: a separate launch would cost more
# NINFER_GEMV=float keeps the float GEMV for every format (side-by-side measurements)
GEMV_PATH = setting("NINFER_GEMV")
# T = 2..16 (verify blocks, several lanes) by code width: Q4/Q5/Q6 on int8 tensor cores (codes become
# bytes with 32-bit logic ops; the run record (`git show 5d8956c:bench/RESULTS.md`) §11), W8 (small shared-expert matrices) through the
# float tensor-core kernel. The dp4a row kernel (bit for bit what decode computes, but its work grows
# with T) stays selectable. NINFER_GEMV_ROWS=tensor|int8|mma forces one path for every format.
ROWS_PATHS = SWITCHES["NINFER_GEMV_ROWS"].choices
ROWS_PATH = setting("NINFER_GEMV_ROWS")
# The bf16 kernel (NINFER_GEMV_ROWS=bf16) is faster on Q5 products alone (MLP down T = 4: 65.8 -> 52.7 us) but
# not end to end (2 lanes 12.34 -> 12.96 ms per step, run 29 call 4, the run record (`git show 5d8956c:bench/RESULTS.md`) §19): int8 stays the default
ROWS_BY_BITS = {4: "mma", 5: "mma", 6: "mma", 8: "tensor"}
ROWS_MAX_BLOCK_T = 8  # dp4a row kernel: rows of x per program
# int8 tensor-core kernel: best of seven tiles (rows, warps, groups per step, stages) in run 21
ROWS_MMA_TUNING = {"block_n": 128, "num_warps": 4, "groups_per_step": 1, "num_stages": 3}
# bf16 tensor-core kernel (exact codes, scales per group after each dot)
# side-by-side runs: NINFER_ROWS_BF16_TILE=rows,warps,stages,programs,prefetch(0/1)
ROWS_BF16_TUNING = tuning_from_env("NINFER_ROWS_BF16_TILE",
                                   ("block_n", "num_warps", "num_stages", "programs", "prefetch"),
                                   {"block_n": 64, "num_warps": 4, "num_stages": 3, "programs": 1024, "prefetch": 0})


# rows of x up to which the lanes kernel (qgemv_lanes: the decode GEMV's arithmetic, each weight word
# unpacked once for every row, each row bit for bit its decode product) beats the tensor-core kernels, whose
# cost hardly grows with T; by code width, from the H200 (`bench/gemv_compare.py OUT lanes`, bench/RESULTS.md
# §2): its dp4a work grows with T, so Q4 (cheap to unpack, dp4a-bound already at T = 1) never gains, while
# Q5/Q6/W8 (costly unpacking, shared by the rows) gain at T = 2 (MLP down Q5: 2.32 -> 1.37 one-row products)
LANES_MAX_T = {4: 1, 5: 3, 6: 2, 8: 4}


def rows_path(bits: int, t: int = 16) -> str:
    """Which kernel multiplies a block of t = 2..16 rows of x with `bits`-wide codes."""
    if ROWS_PATH not in ROWS_PATHS:
        raise ValueError(f"NINFER_GEMV_ROWS={ROWS_PATH!r} is not one of {', '.join(ROWS_PATHS)}; unset it for auto")
    if GEMV_PATH != "int8" or bits not in INT8_BITS:
        return "tensor"
    if ROWS_PATH == "auto":
        return "lanes" if t <= LANES_MAX_T[bits] else ROWS_BY_BITS[bits]
    return ROWS_PATH
# The fragment kernels (code words loaded straight into tensor-core fragments by inline PTX) for Q4/Q5
# products of 1..16 rows. Over the artifact's planes (qgemm_rows_frag): NINFER_GEMV_FRAG=on takes it for every
# product it supports (T = 1 included), rows for 2..16 rows only, off never; auto by code width and rows
# (FRAG_AUTO_T). Over planes permuted at bind into fragment order (qgemm_fragment_layout), which then take every
# product of 1..16 rows: layout always; auto when the engine runs more than one row per step (several lanes or
# speculative verify blocks), where it wins (H200, bench/RESULTS.md §2: 27B 8 lanes 9.5 ms a step against 12.4),
# and for Q5 products always; one plain lane keeps its Q4 products on the artifact's planes and the dp4a GEMV
# (6.6 ms a step against 7.1 with every product in fragment order).
FRAG_MODES = SWITCHES["NINFER_GEMV_FRAG"].choices
FRAG_MODE = setting("NINFER_GEMV_FRAG")
# From the H200 (`bench/gemv_compare.py OUT frag`, bench/RESULTS.md §2): the fragment kernel beats the int8
# tensor-core row kernels at every T >= 2 on Q4 and Q5 (MLP gate_up Q4 T = 8: 74.7 -> 42.1 us), and the lanes
# kernel except for Q5 at T = 2 (MLP down: 34.2 lanes vs 39.5); at T = 1 the dp4a GEMV stays faster (28.3 vs 41.9)
FRAG_AUTO_T: dict[int, range] = {4: range(2, 17), 5: range(3, 17)}


# Products an engine of one plain lane lays out in fragment order too (their one-row products then run on the
# fragment-order kernel; object-name suffixes, comma-separated). Isolated on the H100 (session 34) the one-row GDN
# qkvz and attention qgkv products with x a chunk ahead take 16.1 / 14.7 µs against the dp4a GEMV's 19.4 / 17.1, but
# every product in fragment order was slower end to end (126.8 against 130.1 tok/s, gate_up losing its SwiGLU
# epilogue), and these two alone were level with the default (session 35: 133.0 / 131.1 against 132.6 / 131.3
# tok/s, the step's kernel time 7.51 ms both), so empty: e.g.
# NINFER_FRAGMENT_ONE_LANE=gdn/query_key_value_z,attention/query_gate_key_value
FRAGMENT_ONE_LANE = tuple(n for n in setting("NINFER_FRAGMENT_ONE_LANE").split(",") if n)


def fragment_layout_enabled(rows_per_step: int, bits: int, name: str = "") -> bool:
    """Whether an engine that multiplies up to `rows_per_step` rows of x per decode step (lanes x verify
    block) re-lays out its `bits`-bit layer products (Q4/Q5) in fragment order: under auto, for several rows,
    and for Q5 even at one row (its one-row product beats the dp4a GEMV there: MLP down 23.7 against 24.6 µs,
    GDN out 11.0 against 11.4; Q4's does not: gate_up 30.3 against 28.2); with NINFER_FRAGMENT_INT8=on, Q4 too
    (the int8 fragment kernel is meant for one row as well); object `name` too where it ends with one of
    NINFER_FRAGMENT_ONE_LANE's suffixes."""
    if FRAG_MODE not in FRAG_MODES:
        raise ValueError(f"NINFER_GEMV_FRAG={FRAG_MODE!r} is not one of {', '.join(FRAG_MODES)}; unset it for auto")
    return FRAG_MODE == "layout" or (FRAG_MODE == "auto" and (rows_per_step > 1 or bits == 5
                                                              or fragment_order(bits) == "bytes"
                                                              or bool(name) and name.endswith(FRAGMENT_ONE_LANE)))


def uses_frag(w: "PackedLinear", t: int) -> bool:
    """Whether qlinear multiplies t rows of x with w through the fragment kernel."""
    if FRAG_MODE not in FRAG_MODES:
        raise ValueError(f"NINFER_GEMV_FRAG={FRAG_MODE!r} is not one of {', '.join(FRAG_MODES)}; unset it for auto")
    if FRAG_MODE == "off" or interpreted() or w.base.device.type != "cuda" or not frag_supported(w, t):
        return False
    if FRAG_MODE in ("auto", "layout"):  # a forced NINFER_GEMV_ROWS / NINFER_GEMV path is honoured (side-by-side runs)
        return ROWS_PATH == "auto" and GEMV_PATH == "int8" and t in FRAG_AUTO_T.get(w.fmt.bits, ())
    return FRAG_MODE == "on" or (FRAG_MODE == "rows" and t > 1)


# The CPU interpreter (tests) pays per program and per op, not per byte: few, wide programs.
INTERPRETER_PROGRAMS = 4
INTERPRETER_BLOCK_N = 64


def k_splits(blocks: int, chunks: int, programs: int, min_chunks: int = 2) -> int:
    """How many ways to split K (a power of two dividing `chunks`, each split keeping at least
    `min_chunks` K blocks) so that `blocks` row blocks times the splits stay within `programs`."""
    split = 1
    while blocks * split * 2 <= programs and chunks % (split * 2) == 0 and chunks // (split * 2) >= min_chunks:
        split *= 2
    return split


@triton.jit
def _w8_weights(base_ptr, scale, rows, row_ok, k0, K_PAD: tl.constexpr, GROUP: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FRAGMENT: tl.constexpr = 0):
    """Dequantized W8 tile [BLOCK_N, BLOCK_K] fp32 of lanes [k0, k0 + BLOCK_K); `scale` is [BLOCK_N, groups].
    FRAGMENT: codes in fragment order (byte order; 32 bytes a group a row, as a Q4 group's code bytes)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    if FRAGMENT:
        code_at = _fragment_offsets(rows, ks, 8, 32, K_PAD // GROUP)
    else:
        code_at = rows[:, None] * K_PAD + ks[None, :]
    codes = tl.load(base_ptr + code_at, mask=row_ok[:, None], other=0)
    q = tl.reshape(codes.to(tl.int8, bitcast=True).to(tl.float32), (BLOCK_N, BLOCK_K // GROUP, GROUP))
    return tl.reshape(q * scale[:, :, None], (BLOCK_N, BLOCK_K))


@triton.jit
def _fragment_offsets(rows, idx, UNIT: tl.constexpr, PER_GROUP: tl.constexpr, GPR: tl.constexpr):
    """Byte offsets, in planes permuted into fragment order (qgemm_fragment_layout), of byte `idx` of `rows`
    in a row-split plane of PER_GROUP bytes per group: codes (32 per group, in 8-byte units: lane L = 4g + c
    of a 16-row block holds row g's unit c then row g + 8's) or Q5 high bits (8 per group, 2-byte units:
    lane L holds 4 groups' (row g, row g + 8) units c)."""
    # a row's part plus a byte's part (one add per element, as row-split planes take): the offsets
    # ((block * GPR + gi) * 32 + g * 4 + unit) * 16 + half * 8 + within (8-byte units) and
    # ((block * GPR / 4 + gi / 4) * 32 + g * 4 + unit) * 16 + (gi % 4) * 4 + half * 2 + within (2-byte units) split
    block, g, half = rows // 16, rows % 8, (rows % 16) // 8
    gi = idx // PER_GROUP
    unit, within = (idx % PER_GROUP) // UNIT, idx % UNIT
    if UNIT == 8:
        return (block * (GPR * 512) + g * 64 + half * 8)[:, None] + (gi * 512 + unit * 16 + within)[None, :]
    return ((block * (GPR // 4 * 512) + g * 64 + half * 2)[:, None]
            + ((gi // 4) * 512 + unit * 16 + (gi % 4) * 4 + within)[None, :])


@triton.jit
def _scale_offsets(rows, gidx, GPR: tl.constexpr, FRAGMENT: tl.constexpr):
    """Element offsets of the scales of groups `gidx` of `rows` (row-split, or fragment order: per 16-row block
    and 4 groups, lane g's 4 (row g, row g + 8) pairs)."""
    if FRAGMENT:  # (((r / 16) * GPR / 4 + gi / 4) * 8 + r % 8) * 8 + (gi % 4) * 2 + (r % 16) / 8, a row's part plus a
        # group's
        return (((rows // 16) * (GPR // 4 * 64) + (rows % 8) * 8 + (rows % 16) // 8)[:, None]
                + ((gidx // 4) * 64 + (gidx % 4) * 2)[None, :])
    return rows[:, None] * GPR + gidx[None, :]


@triton.jit
def _register15_code(w0, w1, w2, w3, w4, BIT: tl.constexpr):
    """A fields thread's 16th register code (bit b in word b's bit BIT: 15 the low lane's, 31 the high lane's)."""
    return ((w0 >> BIT) & 1) | (((w1 >> BIT) & 1) << 1) | (((w2 >> BIT) & 1) << 2) | (((w3 >> BIT) & 1) << 3) | \
        (((w4 >> BIT) & 1) << 4)


@triton.jit
def _field_codes(base_ptr, high_ptr, rows, row_ok, k0, GPR: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """Unsigned 5-bit codes (two's complement bits) of lanes 2p and 2p + 1 for p in [k0 / 2, (k0 + BLOCK_K) / 2) of
    `rows` ([BLOCK_N, BLOCK_K / 2] int32 each) from Q5 planes in fields order. Lane pair 8c + q of group gi (a
    16-lane quarter c) is A register i = 2q + (row % 16) / 8 of thread 4 (row % 8) + c, whose five words (four code
    words, its word of the high plane) are loaded once per (row, group, quarter): register i < 15 at bits 5 (i % 3)
    of word i / 3, register 15 bit b in word b's bit 15 (low lane) / 31 (high lane). Five [BLOCK_N, BLOCK_K / 16]
    loads, not seven lane-wide gathers (whose pipeline buffers overflowed sm_90's shared memory at 3 stages)."""
    GQ: tl.constexpr = BLOCK_K // 16  # (group, quarter) pairs of the block
    gq = tl.arange(0, GQ)
    gi = k0 // 64 + gq // 4
    thread = (4 * (rows % 8))[:, None] + (gq % 4)[None, :]
    block = (rows // 16)[:, None]
    codes_at = ((block * GPR + gi[None, :]) * 32 + thread) * 4  # the thread's 4 code words of group gi
    high_at = ((block * (GPR // 4) + (gi // 4)[None, :]) * 32 + thread) * 4 + (gi % 4)[None, :]  # its 5th word
    words = base_ptr.to(tl.pointer_type(tl.int32))
    ok = row_ok[:, None]
    w0 = tl.load(words + codes_at, mask=ok, other=0)
    w1 = tl.load(words + codes_at + 1, mask=ok, other=0)
    w2 = tl.load(words + codes_at + 2, mask=ok, other=0)
    w3 = tl.load(words + codes_at + 3, mask=ok, other=0)
    w4 = tl.load(high_ptr.to(tl.pointer_type(tl.int32)) + high_at, mask=ok, other=0)
    i = 2 * tl.arange(0, 8)[None, None, :] + ((rows % 16) // 8)[:, None, None]  # [BLOCK_N, 1, 8]
    wi = i // 3
    word = tl.where(wi == 0, w0[:, :, None], tl.where(wi == 1, w1[:, :, None], tl.where(
        wi == 2, w2[:, :, None], tl.where(wi == 3, w3[:, :, None], w4[:, :, None]))))  # [BLOCK_N, GQ, 8]
    shift = 5 * (i % 3)
    lo = (word >> shift) & 0x1F
    hi = (word >> (shift + 16)) & 0x1F
    lo = tl.where(i == 15, _register15_code(w0, w1, w2, w3, w4, 15)[:, :, None], lo)
    hi = tl.where(i == 15, _register15_code(w0, w1, w2, w3, w4, 31)[:, :, None], hi)
    return tl.reshape(lo, (BLOCK_N, BLOCK_K // 2)) ^ 16, tl.reshape(hi, (BLOCK_N, BLOCK_K // 2)) ^ 16


@triton.jit
def _nibble_codes(base_ptr, high_ptr, rows, row_ok, k0, K_PAD: tl.constexpr, GPR: tl.constexpr,
                  HIGH_BYTES: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  FRAGMENT: tl.constexpr = False):
    """Signed codes of lanes [k0, k0 + BLOCK_K) of `rows`, split into even and odd lanes
    ([BLOCK_N, BLOCK_K / 2] int32 each) for the 4-, 5- and 6-bit formats; FRAGMENT (Q4/Q5): 1 planes in
    fragment order, 2 in fragment order with code words and high bytes in pair order, 3 in byte order (lane-order
    codes, Q5 high bits as the int8 kernel reads them), 4 Q5 as 5-bit fields (qgemm_fragment_layout)."""
    half = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte index within the row
    if FRAGMENT == 4:  # Q5 as 5-bit fields (qgemm_fragment_layout._fields_of_pairs): lanes 2p and 2p + 1 are the two
        # halves of one A register i of thread (row % 8, lane / 16)'s group; its word i // 3 (4: the high plane's word)
        # at bit 5 (i % 3), register 15 in the top bits of the five words; u = code ^ 16
        lo, hi = _field_codes(base_ptr, high_ptr, rows, row_ok, k0, GPR, BLOCK_N, BLOCK_K)
    elif FRAGMENT == 2:  # lane 2i of a word (8 lanes) in nibble i, lane 2i + 1 in nibble i + 4: each word loaded once
        words_at = _fragment_offsets(rows, k0 // 2 + 4 * tl.arange(0, BLOCK_K // 8), 8, 32, GPR) // 4
        words_at = tl.max_contiguous(tl.multiple_of(words_at, [1, 2]), [1, 2])  # a unit's 2 words: one 8-byte load
        words = tl.load(base_ptr.to(tl.pointer_type(tl.int32)) + words_at, mask=row_ok[:, None], other=0)
        shift = 4 * tl.arange(0, 4)
        lo = tl.reshape((words[:, :, None] >> shift[None, None, :]) & 0xF, (BLOCK_N, BLOCK_K // 2))
        hi = tl.reshape((words[:, :, None] >> (shift[None, None, :] + 16)) & 0xF, (BLOCK_N, BLOCK_K // 2))
    else:
        if FRAGMENT:  # 8-byte runs at multiples of 8: one 8-byte load per run (the compiler cannot see it)
            code_at = tl.max_contiguous(tl.multiple_of(_fragment_offsets(rows, half, 8, 32, GPR), [1, 8]), [1, 8])
        else:
            code_at = rows[:, None] * (K_PAD // 2) + half[None, :]
        packed = tl.load(base_ptr + code_at, mask=row_ok[:, None], other=0).to(tl.int32)
        lo = packed & 0xF
        hi = (packed >> 4) & 0xF
    if BITS == 5 and FRAGMENT != 4:  # one high byte per 8 lanes: even lanes use bits 0,2,4,6; odd lanes 1,3,5,7
        # (pair order: even lanes bits 0-3, odd lanes 4-7)
        hidx = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        if FRAGMENT:  # 2-byte runs at even offsets
            high_at = tl.max_contiguous(tl.multiple_of(_fragment_offsets(rows, hidx, 2, 8, GPR), [1, 2]), [1, 2])
        else:
            high_at = rows[:, None] * (GPR * HIGH_BYTES) + hidx[None, :]
        if FRAGMENT == 3:  # the (thread, group) word holding the bits; lane 2i + p of (row half, word) at bit
            # 8i + 4 half + 2 word + p (qgemm_fragment_layout.high_to_byte_order)
            half_row = ((rows % 16) // 8)[:, None]
            word = (hidx % 2)[None, :]
            hw = tl.load((high_ptr + high_at - 2 * half_row - word).to(tl.pointer_type(tl.int32)),
                         mask=row_ok[:, None], other=0)
            at = 4 * half_row + 2 * word
            sh = 8 * tl.arange(0, 4)
            lo = lo | tl.reshape(((hw[:, :, None] >> (sh[None, None, :] + at[:, :, None])) & 1) << 4,
                                 (BLOCK_N, BLOCK_K // 2))
            hi = hi | tl.reshape(((hw[:, :, None] >> (sh[None, None, :] + at[:, :, None] + 1)) & 1) << 4,
                                 (BLOCK_N, BLOCK_K // 2))
        else:
            hb = tl.load(high_ptr + high_at, mask=row_ok[:, None], other=0).to(tl.int32)
            if FRAGMENT == 2:
                sh_even = tl.arange(0, 4)
                sh_odd = 4 + tl.arange(0, 4)
            else:
                sh_even = 2 * tl.arange(0, 4)
                sh_odd = sh_even + 1
            lo = lo | tl.reshape(((hb[:, :, None] >> sh_even[None, None, :]) & 1) << 4, (BLOCK_N, BLOCK_K // 2))
            hi = hi | tl.reshape(((hb[:, :, None] >> sh_odd[None, None, :]) & 1) << 4, (BLOCK_N, BLOCK_K // 2))
    if BITS == 6:  # one high byte per 4 lanes: even lanes bits 0-1, 4-5; odd lanes 2-3, 6-7
        hidx = k0 // 4 + tl.arange(0, BLOCK_K // 4)
        hb = tl.load(high_ptr + rows[:, None] * (GPR * HIGH_BYTES) + hidx[None, :], mask=row_ok[:, None], other=0).to(tl.int32)
        sh = 4 * tl.arange(0, 2)
        lo = lo | tl.reshape(((hb[:, :, None] >> sh[None, None, :]) & 3) << 4, (BLOCK_N, BLOCK_K // 2))
        hi = hi | tl.reshape(((hb[:, :, None] >> (sh[None, None, :] + 2)) & 3) << 4, (BLOCK_N, BLOCK_K // 2))
    sign: tl.constexpr = 1 << (BITS - 1)
    return (lo ^ sign) - sign, (hi ^ sign) - sign


@triton.jit
def _dequant_block_dot(acc, x_ptr, x_off, tok_ok, base_ptr, high_ptr, scale_ptr, rows, row_ok, k0, K,
                       GPR: tl.constexpr, K_PAD: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                       HIGH_BYTES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       FRAGMENT: tl.constexpr = 0):
    """acc [BLOCK_T, BLOCK_N] + x[:, k0:k0 + BLOCK_K] @ W[rows, k0:k0 + BLOCK_K]^T, W dequantized in
    registers; row t of x starts at x_ptr + x_off[t] (masked by tok_ok). FRAGMENT (Q4/Q5/W8): planes in fragment
    order, as _dequant_kernel's."""
    gpb: tl.constexpr = BLOCK_K // GROUP  # groups per block
    gidx = k0 // GROUP + tl.arange(0, gpb)
    scale = tl.load(scale_ptr + _scale_offsets(rows, gidx, GPR, FRAGMENT), mask=row_ok[:, None],
                    other=0.0).to(tl.float32)
    if BITS == 8:
        ks = k0 + tl.arange(0, BLOCK_K)
        w = _w8_weights(base_ptr, scale, rows, row_ok, k0, K_PAD, GROUP, BLOCK_N, BLOCK_K, FRAGMENT).to(
            x_ptr.dtype.element_ty)
        x = tl.load(x_ptr + x_off[:, None] + ks[None, :], mask=tok_ok[:, None] & (ks[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w))
    else:
        if FRAGMENT == 2:  # pair order read byte by byte as lane order is (each code byte loaded once): byte j of a
            # word holds lanes (0, 2), (4, 6), (1, 3), (5, 7) of its 8 and the Q5 high bits fall in the same places,
            # so x's lanes follow the bytes instead (the dot's sum is taken in another order)
            j = tl.arange(0, BLOCK_K // 2)
            ke = k0 + 8 * (j // 4) + (j % 2) * 4 + (j % 4) // 2
            odd_step = 2
        else:
            ke = k0 + 2 * tl.arange(0, BLOCK_K // 2)  # even lanes
            odd_step = 1
        lo, hi = _nibble_codes(base_ptr, high_ptr, rows, row_ok, k0, K_PAD, GPR, HIGH_BYTES, BITS, BLOCK_N, BLOCK_K,
                               1 if FRAGMENT == 2 else FRAGMENT)
        lo = tl.reshape(lo.to(tl.float32), (BLOCK_N, gpb, GROUP // 2))
        hi = tl.reshape(hi.to(tl.float32), (BLOCK_N, gpb, GROUP // 2))
        w_even = tl.reshape(lo * scale[:, :, None], (BLOCK_N, BLOCK_K // 2)).to(x_ptr.dtype.element_ty)
        w_odd = tl.reshape(hi * scale[:, :, None], (BLOCK_N, BLOCK_K // 2)).to(x_ptr.dtype.element_ty)
        x_even = tl.load(x_ptr + x_off[:, None] + ke[None, :], mask=tok_ok[:, None] & (ke[None, :] < K), other=0.0)
        x_odd = tl.load(x_ptr + x_off[:, None] + ke[None, :] + odd_step,
                        mask=tok_ok[:, None] & (ke[None, :] + odd_step < K), other=0.0)
        acc += tl.dot(x_even, tl.trans(w_even))
        acc += tl.dot(x_odd, tl.trans(w_odd))
    return acc


@triton.jit
def _qlinear_kernel(x_ptr, base_ptr, high_ptr, scale_ptr, y_ptr, T, N, K, stride_xt, K_PER_SPLIT,
                    GPR: tl.constexpr, K_PAD: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                    HIGH_BYTES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pdl_wait()
    pid_n = tl.program_id(0)
    pid_t = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < N
    tok_ok = toks < T
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    k_begin = split * K_PER_SPLIT
    for k0 in range(k_begin, k_begin + K_PER_SPLIT, BLOCK_K):
        acc = _dequant_block_dot(acc, x_ptr, toks * stride_xt, tok_ok, base_ptr, high_ptr, scale_ptr, rows, row_ok, k0,
                                 K, GPR, K_PAD, BITS, GROUP, HIGH_BYTES, BLOCK_N, BLOCK_K)
    out = y_ptr + split * T * N + toks[:, None] * N + rows[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=tok_ok[:, None] & row_ok[None, :])


@triton.jit
def _dequant_kernel(base_ptr, high_ptr, scale_ptr, w_ptr, N, K, row0,
                    GPR: tl.constexpr, K_PAD: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                    HIGH_BYTES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FRAGMENT: tl.constexpr):
    """Rows [row0, row0 + N) of a packed matrix (row-split planes, or FRAGMENT 1 / 2 / 3: Q4/Q5 planes in fragment
    order: 1 lane order, 2 pair order, 3 byte order, W8's too) -> dense [N, K] in w_ptr's dtype (prefill GEMM
    path)."""
    pdl_wait()
    local = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = row0 + local
    row_ok = local < N
    k0 = tl.program_id(1) * BLOCK_K
    gpb: tl.constexpr = BLOCK_K // GROUP
    gidx = k0 // GROUP + tl.arange(0, gpb)
    scale_at = _scale_offsets(rows, gidx, GPR, FRAGMENT)
    scale = tl.load(scale_ptr + scale_at, mask=row_ok[:, None], other=0.0).to(tl.float32)
    if BITS == 8:
        ks = k0 + tl.arange(0, BLOCK_K)
        w = _w8_weights(base_ptr, scale, rows, row_ok, k0, K_PAD, GROUP, BLOCK_N, BLOCK_K, FRAGMENT)
        tl.store(w_ptr + local[:, None] * K + ks[None, :], w.to(w_ptr.dtype.element_ty), mask=row_ok[:, None] & (ks[None, :] < K))
    else:
        lo, hi = _nibble_codes(base_ptr, high_ptr, rows, row_ok, k0, K_PAD, GPR, HIGH_BYTES, BITS, BLOCK_N, BLOCK_K,
                               FRAGMENT)
        lo = tl.reshape(lo.to(tl.float32), (BLOCK_N, gpb, GROUP // 2))
        hi = tl.reshape(hi.to(tl.float32), (BLOCK_N, gpb, GROUP // 2))
        w_even = tl.reshape(lo * scale[:, :, None], (BLOCK_N, BLOCK_K // 2))
        w_odd = tl.reshape(hi * scale[:, :, None], (BLOCK_N, BLOCK_K // 2))
        w = tl.reshape(tl.join(w_even, w_odd), (BLOCK_N, BLOCK_K))
        ks = k0 + tl.arange(0, BLOCK_K)
        tl.store(w_ptr + local[:, None] * K + ks[None, :], w.to(w_ptr.dtype.element_ty), mask=row_ok[:, None] & (ks[None, :] < K))


# dense scratch per GEMM step, at most the 64 MiB the memory plan reserves (side-by-side runs: a smaller one may stay
# in L2)
GEMM_DEQUANT_BYTES = min(64, int(setting("NINFER_GEMM_DEQUANT_MB"))) << 20
GEMV_MAX_T = 16
# Planes in fragment order multiply 17-64 rows (verify blocks of 5+ lanes: 8 lanes of MTP3 rounds are 32 rows) as
# blocks of 16 rows, one read of the codes each (Q4: 2 x 0.56 bytes a weight at 32 rows, ~0.6 of copy at 16 rows),
# instead of the prefill's dequantized bf16 copy (0.56 read + 2 written + 2 read again). H100, session 36 (`bash
# bench/device_frag.sh next36`, 8 lanes of MTP3 rounds, dequantizing GEMM -> 16-row blocks): verify 26.31 -> 23.93
# ms, round 30.03 -> 26.61 ms, 1,065 -> 1,202 tok/s. NINFER_SLICED_ROWS=0 keeps Q4/Q5/W8 on the dequantizing GEMM
# for side-by-side runs; Q6 always slices (its dequantization copies rows back first).
SLICED_MAX_T = 64
SLICED_MAX_T_Q6 = 256  # the head: 16 reads (3.7 ms on an H100) still beat copying its rows back to dequantize them
SLICED_ROWS = setting("NINFER_SLICED_ROWS") == "1"


FRAGMENT_ORDERS = {"lanes": 1, "pairs": 2, "bytes": 3, "fields": 4}  # the dequantizer's FRAGMENT for each order


def dequantize_rows(w: "PackedLinear", row0: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows [row0, row0 + n) dense (the prefill GEMM's scratch, and row blocks of more than 64 rows); Q4/Q5/W8
    planes in fragment order are read in place (Q5 fields too), Q6 ones (the output head) through a copy of those
    rows back in the artifact's planes (row_planes)."""
    dense = torch.empty(n, w.cols, dtype=dtype, device=w.base.device)
    block_n, block_k = 32, 128
    fragment = 0
    base, high, scale = w.base, w.high, w.scale
    if w.fragment is not None and w.fmt.bits == 6:
        base, high, scale = row_planes(w.fragment, row0, n)
        row0 = 0
    elif w.fragment is not None:
        base, high, scale = w.fragment.codes, w.fragment.high, w.fragment.scales
        fragment = FRAGMENT_ORDERS[w.fragment.order]
    _dequant_kernel[(triton.cdiv(n, block_n), w.k_pad // block_k)](
        base, high if high is not None else base, scale, dense, n, w.cols, row0, GPR=w.groups_per_row, K_PAD=w.k_pad,
        BITS=w.fmt.bits, GROUP=w.fmt.group_size, HIGH_BYTES=w.fmt.high_bytes_per_group, BLOCK_N=block_n,
        BLOCK_K=block_k, FRAGMENT=fragment, **LAUNCH)
    return dense


def _gemm(x: torch.Tensor, w: "PackedLinear", y: torch.Tensor) -> torch.Tensor:
    """Prefill: dequantize row chunks to dense once and let the vendor GEMM do the math (or take the matrix's
    resident dense copy, keep_dense_copies)."""
    if w.resident_dense is not None and w.resident_dense.dtype == x.dtype:
        return torch.matmul(x, w.resident_dense.t(), out=y)
    step = max(32, GEMM_DEQUANT_BYTES // (w.cols * x.element_size()) // 32 * 32)
    for r in range(0, w.rows, step):
        n = min(step, w.rows - r)
        torch.matmul(x, dequantize_rows(w, r, n, x.dtype).t(), out=y[:, r : r + n])
    return y


@triton.jit
def _dot_rows(x_ptr, base_ptr, high_ptr, scale_ptr, rows, row_ok, K, k_begin, k_end,
              GPR: tl.constexpr, K_PAD: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
              HIGH_BYTES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum_k W[rows, k] * x[k] over [k_begin, k_end) with FMAs in registers -> [BLOCK_N] float32."""
    if BITS == 8:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
    gpb: tl.constexpr = BLOCK_K // GROUP
    for k0 in range(k_begin, k_end, BLOCK_K):
        gidx = k0 // GROUP + tl.arange(0, gpb)
        scale = tl.load(scale_ptr + rows[:, None] * GPR + gidx[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
        if BITS == 8:
            ks = k0 + tl.arange(0, BLOCK_K)
            w = _w8_weights(base_ptr, scale, rows, row_ok, k0, K_PAD, GROUP, BLOCK_N, BLOCK_K)
            acc += w * tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)[None, :]
        else:
            ke = k0 + 2 * tl.arange(0, BLOCK_K // 2)  # even lanes
            lo, hi = _nibble_codes(base_ptr, high_ptr, rows, row_ok, k0, K_PAD, GPR, HIGH_BYTES, BITS, BLOCK_N, BLOCK_K)
            x_even = tl.load(x_ptr + ke, mask=ke < K, other=0.0).to(tl.float32)
            x_odd = tl.load(x_ptr + ke + 1, mask=ke + 1 < K, other=0.0).to(tl.float32)
            # codes times x, then one scale per group: fewer multiplies than scaling every weight
            prod = lo.to(tl.float32) * x_even[None, :] + hi.to(tl.float32) * x_odd[None, :]
            acc += tl.reshape(tl.reshape(prod, (BLOCK_N, gpb, GROUP // 2)) * scale[:, :, None], (BLOCK_N, BLOCK_K // 2))
    return tl.sum(acc, axis=1)


@triton.jit
def _qgemv_vec_kernel(x_ptr, base_ptr, high_ptr, scale_ptr, y_ptr, N, K, K_PER_SPLIT,
                      GPR: tl.constexpr, K_PAD: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                      HIGH_BYTES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """T = 1: multiply-accumulate in registers and reduce along K (no tensor-core layouts)."""
    pdl_wait()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    row_ok = rows < N
    y = _dot_rows(x_ptr, base_ptr, high_ptr, scale_ptr, rows, row_ok, K, split * K_PER_SPLIT, (split + 1) * K_PER_SPLIT,
                  GPR, K_PAD, BITS, GROUP, HIGH_BYTES, BLOCK_N, BLOCK_K)
    tl.store(y_ptr + split * N + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def _int8_tiles(w: "PackedLinear") -> tuple[int, int, int, int, bool]:
    """(BLOCK_N, BLOCK_K, K splits, warps, prequant) of the dp4a kernels for `w`: one choice for one
    row and for row blocks, so both sum each row's products in the same order."""
    tuning = INT8_TUNING | INT8_TUNING_BY_BITS.get(w.fmt.bits, {})
    if w.fmt.bits == 4 and w.rows >= INT8_WIDE_ROWS:
        tuning |= INT8_TUNING_WIDE_Q4
    block_n, block_k, programs = tuning["block_n"], tuning["block_k"], INT8_TARGET_PROGRAMS
    if interpreted():
        block_n, programs = INTERPRETER_BLOCK_N, INTERPRETER_PROGRAMS
    while w.k_pad % block_k:
        block_k //= 2
    split = k_splits(triton.cdiv(w.rows, block_n), w.k_pad // block_k, programs)
    prequant = tuning["prequant"] and w.rows * w.k_pad >= PREQUANT_MIN_WEIGHTS
    return block_n, block_k, split, tuning["num_warps"], prequant


def _gemv_vec(x: torch.Tensor, w: "PackedLinear", y: torch.Tensor, xq: QuantizedX | None = None,
              defer_sum: bool = False) -> torch.Tensor | SplitPartials:
    if GEMV_PATH == "int8" and w.fmt.bits in INT8_BITS:
        block_n, block_k, split, num_warps, prequant = _int8_tiles(w)
        return qgemv_int8(x, w, y, block_n, block_k, split, num_warps, prequant, xq, defer_sum)
    block_n, block_k, programs = VEC_TUNING["block_n"], VEC_TUNING["block_k"], TARGET_PROGRAMS
    if interpreted():
        block_n, programs = INTERPRETER_BLOCK_N, INTERPRETER_PROGRAMS
    while w.k_pad % block_k:
        block_k //= 2
    blocks = triton.cdiv(w.rows, block_n)
    split = k_splits(blocks, w.k_pad // block_k, programs)
    target = split_partials(y, split)
    high = w.high if w.high is not None else w.base
    _qgemv_vec_kernel[(blocks, split)](x, w.base, high, w.scale, target, w.rows, w.cols, w.k_pad // split,
                                       GPR=w.groups_per_row, K_PAD=w.k_pad, BITS=w.fmt.bits, GROUP=w.fmt.group_size,
                                       HIGH_BYTES=w.fmt.high_bytes_per_group, BLOCK_N=block_n, BLOCK_K=block_k,
                                       num_warps=VEC_TUNING["num_warps"], **LAUNCH)
    return finish_splits(target, y)


def _gemm_rows_int8(x: torch.Tensor, w: "PackedLinear", y: torch.Tensor, xq: QuantizedX | None = None) -> torch.Tensor:
    block_n, block_k, split, num_warps, _ = _int8_tiles(w)
    block_t = min(ROWS_MAX_BLOCK_T, triton.next_power_of_2(x.shape[0]))
    return qgemm_rows_int8(x, w, y, block_t, block_n, block_k, split, num_warps, xq)


def _gemm_rows_mma(x: torch.Tensor, w: "PackedLinear", y: torch.Tensor, xq: QuantizedX | None = None) -> torch.Tensor:
    block_n, programs = ROWS_MMA_TUNING["block_n"], TARGET_PROGRAMS
    if interpreted():
        programs = INTERPRETER_PROGRAMS
    step = ROWS_MMA_TUNING["groups_per_step"]
    while w.groups_per_row % step:
        step //= 2
    blocks = triton.cdiv(w.rows, block_n) * triton.cdiv(x.shape[0], 16)
    split = k_splits(blocks, w.groups_per_row // step, programs)
    return qgemm_rows_mma(x, w, y, block_n, split, ROWS_MMA_TUNING["num_warps"], step, ROWS_MMA_TUNING["num_stages"],
                          xq)


def _gemm_rows_bf16(x: torch.Tensor, w: "PackedLinear", y: torch.Tensor) -> torch.Tensor:
    tuning = ROWS_BF16_TUNING
    block_n, programs = tuning["block_n"], tuning["programs"]
    if interpreted():
        block_n, programs = INTERPRETER_BLOCK_N, INTERPRETER_PROGRAMS
    blocks = triton.cdiv(w.rows, block_n) * triton.cdiv(x.shape[0], 16)
    split = k_splits(blocks, w.groups_per_row, programs)
    return qgemm_rows_bf16(x, w, y, block_n, split, tuning["num_warps"], tuning["num_stages"],
                           bool(tuning["prefetch"]))


# The CPU's torch path keeps dequantized float32 copies of the weights while they fit this budget (a small
# model's whole text stack: milliseconds per token instead of a dequantization per product); past it, a
# matrix is dequantized per call. NINFER_CPU_DENSE_CACHE_MB sets it (0: never keep).
DENSE_CACHE_BYTES = int(setting("NINFER_CPU_DENSE_CACHE_MB")) << 20
_dense_cached_bytes = 0


def _release_dense(size: int) -> None:
    global _dense_cached_bytes
    _dense_cached_bytes -= size


class PackedLinear:
    """A row-split weight resident on the device: its three planes and its geometry."""

    def __init__(self, base: torch.Tensor, high: torch.Tensor | None, scale: torch.Tensor, rows: int, cols: int,
                 fmt: GroupedFormat):
        self.base, self.high, self.scale = base, high, scale.view(torch.float16)
        self.rows, self.cols, self.fmt = rows, cols, fmt
        self.k_pad = -(-cols // 128) * 128
        self.groups_per_row = self.k_pad // fmt.group_size
        self._dense: torch.Tensor | None = None
        self.fragment = None  # FragmentPlanes when the planes were re-laid out in fragment order
        self.resident_dense: torch.Tensor | None = None  # the prefill GEMM's operand kept (keep_dense_copies)

    def dense(self) -> torch.Tensor:
        """The dequantized matrix in float32 (the torch path on a CPU, and the references); on a CPU kept
        after the first call while the process-wide DENSE_CACHE_BYTES allows, else rebuilt per call."""
        global _dense_cached_bytes
        if self._dense is not None:
            return self._dense
        from runtime.dequant import dense_rows

        base, high, scale = self.base, self.high, self.scale
        if self.fragment is not None:
            base, high, scale = row_planes(self.fragment)
        dense = dense_rows(base.reshape(-1).view(torch.uint8), None if high is None else high.reshape(-1).view(torch.uint8),
                           scale.reshape(-1), self.rows, self.cols, self.fmt)
        size = dense.numel() * dense.element_size()
        if dense.device.type == "cpu" and _dense_cached_bytes + size <= DENSE_CACHE_BYTES:
            self._dense = dense
            _dense_cached_bytes += size
            weakref.finalize(self, _release_dense, size)  # the budget comes back with the weight
        return dense


def _config(t: int, n: int, k_pad: int) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_N, BLOCK_K, K splits) of the GEMV path (t <= GEMV_MAX_T)."""
    block_t = 16
    block_n = GEMV_TUNING["block_n"]
    block_k = GEMV_TUNING["block_k"]
    while k_pad % block_k:
        block_k //= 2
    n_blocks = triton.cdiv(n, block_n) * triton.cdiv(t, block_t)
    programs = INTERPRETER_PROGRAMS if interpreted() else TARGET_PROGRAMS
    split = k_splits(n_blocks, k_pad // block_k, programs, min_chunks=4) if t <= 16 else 1
    return block_t, block_n, block_k, split


def takes_quantized_x(w: PackedLinear, t: int) -> bool:
    """Whether qlinear of `t` rows of x with `w` reads x as dp4a words (so the kernel producing x may
    write them: QuantizedX)."""
    if GEMV_PATH != "int8" or w.fmt.bits not in INT8_BITS or t > GEMV_MAX_T or torch_path(w.base):
        return False
    if w.fragment is not None:  # the int8 fragment kernel reads dp4a words; the bf16 one x itself
        return w.fragment.order == "bytes"
    if uses_frag(w, t):
        return False
    return t == 1 or rows_path(w.fmt.bits, t) in ("int8", "mma", "lanes")


def keep_dense_copies(weights: list[PackedLinear], budget_bytes: int, dtype: torch.dtype) -> list[PackedLinear]:
    """Dequantize matrices, in the order given, into resident dense copies while they fit `budget_bytes`:
    their prefill GEMMs (T > GEMV_MAX_T rows) then skip the per-call dequantization (27B on the H200: ~35 ms per
    forward, the floor under a prefill chunk that decoding lanes ride). Decode never reads them. Returns the
    matrices kept."""
    picks = weight_cache_picks([w.rows * w.cols * dtype.itemsize for w in weights], budget_bytes)
    kept = [w for w, keep in zip(weights, picks) if keep]
    for w in kept:
        w.resident_dense = dequantize_rows(w, 0, w.rows, dtype)
    return kept


def qlinear(x: torch.Tensor, w: PackedLinear, out: torch.Tensor | None = None, xq: QuantizedX | None = None,
            defer_sum: bool = False) -> torch.Tensor | SplitPartials:
    """x [T, K] (bf16 on GPU, fp32 allowed under the interpreter) -> [T, N] in x's dtype. `xq`: the same
    rows already in dp4a words (when takes_quantized_x), written by the kernel that produced x.
    `defer_sum`: a decode product split along K may return its partials unsummed (SplitPartials) for
    an rmsnorm to sum."""
    t, k = x.shape
    if k != w.cols:
        raise ValueError(f"qlinear: x has {k} columns, weight expects {w.cols}")
    if torch_path(x):  # the exact product; split partials and quantized x are GPU-kernel matters
        y = (x.float() @ w.dense().t()).to(x.dtype)
        return out.copy_(y) if out is not None else y
    x = x.contiguous()
    y = out if out is not None else torch.empty(t, w.rows, dtype=x.dtype, device=x.device)
    if t > GEMV_MAX_T:
        sliced = SLICED_MAX_T_Q6 if w.fmt.bits == 6 else SLICED_MAX_T if SLICED_ROWS else 0
        if w.fragment is not None and t <= sliced and not interpreted():
            for r0 in range(0, t, GEMV_MAX_T):  # blocks of 16 rows: a read of the codes each
                qlinear(x[r0 : r0 + GEMV_MAX_T], w, out=y[r0 : r0 + GEMV_MAX_T])
            return y
        return _gemm(x, w, y)
    if xq is not None and not takes_quantized_x(w, t):
        xq = None  # this path multiplies x itself
    if w.fragment is not None:  # planes in fragment order: only the fragment-order kernels read them (PTX: no
        if interpreted():  # interpreter path; their PTX is emulated in tests/test_frag_kernel.py)
            return y.copy_((x.float() @ w.dense().t()).to(y.dtype))
        if w.fragment.order == "bytes":
            return qgemm_fragment_int8(x, w, y, xq, defer_sum=defer_sum)
        return qgemm_fragment_layout(x, w.fragment, y, defer_sum=defer_sum)
    if x.dtype == torch.bfloat16 and uses_frag(w, t):
        return qgemm_rows_frag(x, w, y, defer_sum=defer_sum)
    if t == 1:
        return _gemv_vec(x, w, y, xq, defer_sum)
    path = rows_path(w.fmt.bits, t)
    if path == "lanes":  # the one-row product's tiles, so each row's result is its decode product's
        block_n, block_k, split, num_warps, _ = _int8_tiles(w)
        return qgemv_lanes(x, w, y, block_n, block_k, split, num_warps, xq, defer_sum)
    if path == "int8":
        return _gemm_rows_int8(x, w, y, xq)
    if path == "mma":
        return _gemm_rows_mma(x, w, y, xq)
    if path == "bf16":
        return _gemm_rows_bf16(x, w, y)
    block_t, block_n, block_k, split = _config(t, w.rows, w.k_pad)
    target = split_partials(y, split)
    grid = (triton.cdiv(w.rows, block_n), triton.cdiv(t, block_t), split)
    high = w.high if w.high is not None else w.base
    _qlinear_kernel[grid](x, w.base, high, w.scale, target, t, w.rows, k, x.stride(0), w.k_pad // split,
                          GPR=w.groups_per_row, K_PAD=w.k_pad, BITS=w.fmt.bits, GROUP=w.fmt.group_size,
                          HIGH_BYTES=w.fmt.high_bytes_per_group, BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k,
                          num_warps=GEMV_TUNING["num_warps"], **LAUNCH)
    return finish_splits(target, y)


# side-by-side runs: NINFER_SWIGLU_EPILOGUE=0 multiplies the gate/up pair and runs the swiglu kernel after it
SWIGLU_EPILOGUE = setting("NINFER_SWIGLU_EPILOGUE") == "1"
# NINFER_CONV_EPILOGUE=on: a one-lane decode step's GDN conv in the qkvz product's launch (qlinear_conv; a launch less
# per GDN layer: 48 for the 27B, 30 for the 35B-A3B). Opt-in until measured side by side on a GPU.
CONV_EPILOGUE = setting("NINFER_CONV_EPILOGUE") == "on"


def qlinear_swiglu(x: torch.Tensor, w: PackedLinear, xq: QuantizedX | None = None) -> torch.Tensor | None:
    """silu(gate) * up of one row of x times a gate/up pair w [2I, K], in the product's own launch (the dp4a
    GEMV's epilogue; a launch less per MLP in a decode step): [1, I] in x's dtype, the numbers qlinear then
    swiglu give. Over planes in fragment order, 1-16 rows with NINFER_SWIGLU_FRAGMENT (qgemm_fragment_swiglu).
    None where no such kernel takes the product (several rows on the artifact's planes, a K split): the caller
    multiplies and runs swiglu."""
    t = x.shape[0]
    if w.fragment is not None and w.fragment.order != "bytes":  # 1-16 rows in fragment order (opt-in)
        if not SWIGLU_FRAGMENT_KS or torch_path(x) or interpreted() or x.dtype != torch.bfloat16 \
                or not 1 <= t <= 16 or x.shape[1] != w.cols or not swiglu_pair_supported(w.fragment):
            return None  # (interpreted: qlinear's dense fallback, as for every fragment-order product)
        return qgemm_fragment_swiglu(x, w.fragment, torch.empty(t, w.rows // 2, dtype=x.dtype, device=x.device))
    tiles = _one_row_epilogue_tiles(x, w) if SWIGLU_EPILOGUE and not w.rows % 2 else None
    if tiles is None or tiles[0] % 2:
        return None
    block_n, block_k, num_warps, prequant = tiles
    y = torch.empty(1, w.rows // 2, dtype=x.dtype, device=x.device)
    return qgemv_int8(x.contiguous(), w, y, block_n, block_k, 1, num_warps, prequant, xq, swiglu_out=True)


def _one_row_epilogue_tiles(x: torch.Tensor, w: PackedLinear) -> tuple[int, int, int, bool] | None:
    """(BLOCK_N, BLOCK_K, warps, prequant) where one row of x times w runs on the dp4a GEMV in one K split — the
    launch whose epilogue can take the next small op (qlinear_swiglu, qlinear_conv) — else None."""
    if x.shape[0] != 1 or torch_path(x) or x.shape[1] != w.cols or GEMV_PATH != "int8" \
            or w.fmt.bits not in INT8_BITS or w.fragment is not None or (x.dtype == torch.bfloat16 and uses_frag(w, 1)):
        return None
    block_n, block_k, split, num_warps, prequant = _int8_tiles(w)
    return (block_n, block_k, num_warps, prequant) if split == 1 else None


def qlinear_conv(x: torch.Tensor, w: PackedLinear, stack: torch.Tensor, lane: torch.Tensor, weight: torch.Tensor,
                 xq: QuantizedX | None = None) -> torch.Tensor | None:
    """One row of x times w (a GDN layer's qkvz) with the layer's width-4 causal conv + SiLU applied to the first
    stack.shape[-1] columns in the product's own launch (the dp4a GEMV's epilogue), the lane's conv window moved on
    a step: [1, N] in x's dtype, the numbers qlinear then conv1d.causal_conv1d_lanes give (NINFER_CONV_EPILOGUE).
    None where the dp4a GEMV with one split does not take the product: the caller runs the two launches."""
    tiles = _one_row_epilogue_tiles(x, w) if CONV_EPILOGUE else None
    if tiles is None:
        return None
    block_n, block_k, num_warps, prequant = tiles
    y = torch.empty(1, w.rows, dtype=x.dtype, device=x.device)
    return qgemv_int8(x.contiguous(), w, y, block_n, block_k, 1, num_warps, prequant, xq, conv=(stack, lane, weight))


def qlinear_reference(x: torch.Tensor, w: PackedLinear) -> torch.Tensor:
    """Dequantize with the torch unpacker (checked bit-exact against numpy) and multiply in fp32."""
    return (x.float() @ w.dense().t()).to(x.dtype)


def gather_rows(w: PackedLinear, ids: torch.Tensor) -> torch.Tensor:
    """Dequantize only rows `ids` (embedding lookup) -> float32 [len(ids), K]; pure tensor ops."""
    from runtime.dequant import dense_rows

    if w.fragment is not None:
        raise ValueError("gather_rows: the weight's planes are in fragment order (embeddings are never re-laid out)")
    ids = ids.long()
    high = w.high.view(w.rows, -1)[ids] if w.high is not None else None
    return dense_rows(w.base.view(w.rows, -1)[ids], high, w.scale.view(w.rows, -1)[ids], ids.shape[0], w.cols, w.fmt)
