"""A few rows of x (T = 2..8: several lanes, short verify blocks) through the decode GEMV's own arithmetic,
each weight word loaded and unpacked once.

Why: the tensor-core row kernels spend ~5 thread-instructions per weight re-packing bytes between
Triton's dot-operand layouts and the conversion's 32-bit operands (the run record, `git show
5d8956c:bench/RESULTS.md` §19), so a 2-row block cost as much as a 16-row one: about two one-row
products. The older dp4a row kernel (qgemv_int8) broadcasts [rows of x, weight rows, words], which
spreads x's rows over threads: every thread then loads and unpacks code words for its own row of x.
Here every op keeps the one-row kernel's 2-D layout [weight rows, words]: the tile is unpacked once,
then each row of x meets it in dp4a with its own accumulator (up to eight, unrolled at compile time).
The work per weight grows by the dp4a of one more row (~0.6 instructions per weight and row) instead of
by the unpacking and the layout changes, so two rows cost about one at memory speed.

Numerics: x's rows are the one-row kernel's 14-bit words (QuantizedX), integer group sums are exact,
and each row's float sums run in the one-row kernel's order over the same tiles and K-splits, so a
row's result is the decode product's.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launch import LAUNCH, pdl_wait
from .qgemv_int8 import (QuantizedX, _block_words, _unpack_codes, _weight_tile, code_words, finish_splits,
                         group_products, high_plane, native_dp4a, quantize_x, split_partials)

MAX_ROWS = 8  # accumulators a program carries; more rows of x take more programs along T


@triton.jit
def _row_sums(xq_ptr, t, T, even, odd, w_scale, k0, ROW_INTS: tl.constexpr, GPR: tl.constexpr, K_PAD: tl.constexpr,
              BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              USE_ASM: tl.constexpr):
    """Row t of x (its dp4a words) against the unpacked tile of lanes [k0, k0 + BLOCK_K): the float
    contribution [BLOCK_N, groups] (the decode GEMV's group_products), zero when t >= T."""
    LANES: tl.constexpr = 4 if BITS == 8 else 8
    gpb: tl.constexpr = BLOCK_K // GROUP
    wpb: tl.constexpr = BLOCK_K // LANES
    row_words: tl.constexpr = K_PAD // LANES
    widx = _block_words(k0 // LANES, wpb)
    gq = k0 // GROUP + tl.arange(0, gpb)
    live = tl.full((wpb,), t, tl.int32) < T  # block-shaped: the interpreter rejects scalar masks
    live_g = tl.full((gpb,), t, tl.int32) < T
    x_row = xq_ptr + t * ROW_INTS
    hi_a = tl.load(x_row + widx, mask=live, other=0)
    lo_a = tl.load(x_row + row_words + widx, mask=live, other=0)
    x_scale = tl.load(x_row + 4 * row_words + gq, mask=live_g, other=0).to(tl.float32, bitcast=True)
    x_sum = tl.load(x_row + 4 * row_words + GPR + gq, mask=live_g, other=0)
    if BITS == 8:  # whole-byte codes: one plane of x words
        hi_b, lo_b = hi_a, lo_a
    else:
        hi_b = tl.load(x_row + 2 * row_words + widx, mask=live, other=0)
        lo_b = tl.load(x_row + 3 * row_words + widx, mask=live, other=0)
    return group_products(even, odd, hi_a, lo_a, hi_b, lo_b, x_scale, x_sum, w_scale, BITS, GROUP, BLOCK_N, BLOCK_K,
                          USE_ASM)


@triton.jit
def _store_row(y_ptr, acc, t, T, N, split, rows, row_ok):
    ok = row_ok & (tl.full(rows.shape, t, tl.int32) < T)
    tl.store(y_ptr + split * T * N + t * N + rows, tl.sum(acc, axis=1).to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _qgemv_lanes_kernel(xq_ptr, base_ptr, high_ptr, scale_ptr, y_ptr, T, N, K_PER_SPLIT, ROW_INTS: tl.constexpr,
                        GPR: tl.constexpr, K_PAD: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                        HIGH_BYTES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr):
    """Rows [t0, t0 + BLOCK_T) of x (dp4a words) times weight rows of this program, one K-split: each
    weight tile loaded (one tile ahead) and unpacked once, then met by every row of x."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    t0 = tl.program_id(2) * BLOCK_T
    row_ok = rows < N
    gpb: tl.constexpr = BLOCK_K // GROUP
    k_begin = split * K_PER_SPLIT
    k_end = k_begin + K_PER_SPLIT
    # weights are never written while a model runs: the first tile streams in before the wait
    words, high, w_scale = _weight_tile(base_ptr, high_ptr, scale_ptr, rows, row_ok[:, None], k_begin, GPR, K_PAD,
                                        BITS, GROUP, HIGH_BYTES, BLOCK_K)
    pdl_wait()
    acc0 = tl.zeros((BLOCK_N, gpb), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, gpb), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, gpb), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, gpb), dtype=tl.float32)
    acc4 = tl.zeros((BLOCK_N, gpb), dtype=tl.float32)
    acc5 = tl.zeros((BLOCK_N, gpb), dtype=tl.float32)
    acc6 = tl.zeros((BLOCK_N, gpb), dtype=tl.float32)
    acc7 = tl.zeros((BLOCK_N, gpb), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        more = row_ok[:, None] & (tl.full((1, 1), k0 + BLOCK_K, tl.int32) < k_end)
        next_words, next_high, next_scale = _weight_tile(base_ptr, high_ptr, scale_ptr, rows, more, k0 + BLOCK_K,
                                                         GPR, K_PAD, BITS, GROUP, HIGH_BYTES, BLOCK_K)
        even, odd = _unpack_codes(words, high, BITS)
        acc0 += _row_sums(xq_ptr, t0, T, even, odd, w_scale, k0, ROW_INTS, GPR, K_PAD, BITS, GROUP, BLOCK_N, BLOCK_K,
                          USE_ASM)
        if BLOCK_T > 1:
            acc1 += _row_sums(xq_ptr, t0 + 1, T, even, odd, w_scale, k0, ROW_INTS, GPR, K_PAD, BITS, GROUP, BLOCK_N,
                              BLOCK_K, USE_ASM)
        if BLOCK_T > 2:
            acc2 += _row_sums(xq_ptr, t0 + 2, T, even, odd, w_scale, k0, ROW_INTS, GPR, K_PAD, BITS, GROUP, BLOCK_N,
                              BLOCK_K, USE_ASM)
            acc3 += _row_sums(xq_ptr, t0 + 3, T, even, odd, w_scale, k0, ROW_INTS, GPR, K_PAD, BITS, GROUP, BLOCK_N,
                              BLOCK_K, USE_ASM)
        if BLOCK_T > 4:
            acc4 += _row_sums(xq_ptr, t0 + 4, T, even, odd, w_scale, k0, ROW_INTS, GPR, K_PAD, BITS, GROUP, BLOCK_N,
                              BLOCK_K, USE_ASM)
            acc5 += _row_sums(xq_ptr, t0 + 5, T, even, odd, w_scale, k0, ROW_INTS, GPR, K_PAD, BITS, GROUP, BLOCK_N,
                              BLOCK_K, USE_ASM)
            acc6 += _row_sums(xq_ptr, t0 + 6, T, even, odd, w_scale, k0, ROW_INTS, GPR, K_PAD, BITS, GROUP, BLOCK_N,
                              BLOCK_K, USE_ASM)
            acc7 += _row_sums(xq_ptr, t0 + 7, T, even, odd, w_scale, k0, ROW_INTS, GPR, K_PAD, BITS, GROUP, BLOCK_N,
                              BLOCK_K, USE_ASM)
        words, high, w_scale = next_words, next_high, next_scale
    _store_row(y_ptr, acc0, t0, T, N, split, rows, row_ok)
    if BLOCK_T > 1:
        _store_row(y_ptr, acc1, t0 + 1, T, N, split, rows, row_ok)
    if BLOCK_T > 2:
        _store_row(y_ptr, acc2, t0 + 2, T, N, split, rows, row_ok)
        _store_row(y_ptr, acc3, t0 + 3, T, N, split, rows, row_ok)
    if BLOCK_T > 4:
        _store_row(y_ptr, acc4, t0 + 4, T, N, split, rows, row_ok)
        _store_row(y_ptr, acc5, t0 + 5, T, N, split, rows, row_ok)
        _store_row(y_ptr, acc6, t0 + 6, T, N, split, rows, row_ok)
        _store_row(y_ptr, acc7, t0 + 7, T, N, split, rows, row_ok)


def block_rows(t: int) -> int:
    """Rows of x per program: the next of 1, 2, 4, 8 that holds t (8 for more: several programs)."""
    return min(MAX_ROWS, triton.next_power_of_2(max(1, t)))


def qgemv_lanes(x, w, y, block_n: int, block_k: int, split: int, num_warps: int, xq: QuantizedX | None = None,
                defer_sum: bool = False):
    """y = x @ W^T for T rows of x [T, K] (y [T, N]) with the decode GEMV's tiles: pass the one-row
    product's (block_n, block_k, split, num_warps) so each row's result is its decode product's.
    `xq`: x's rows already in dp4a words; `defer_sum`: see finish_splits."""
    t = x.shape[0]
    if w.k_pad % (split * block_k):
        raise ValueError(f"qgemv_lanes: {split} K-splits of {block_k}-lane blocks do not tile K_pad {w.k_pad}")
    words = quantize_x(x, w, xq)
    target = split_partials(y, split)
    block_t = block_rows(t)
    _qgemv_lanes_kernel[(triton.cdiv(w.rows, block_n), split, triton.cdiv(t, block_t))](
        words, code_words(w.base), high_plane(w), w.scale, target, t, w.rows, w.k_pad // split,
        ROW_INTS=words.shape[1], GPR=w.groups_per_row, K_PAD=w.k_pad, BITS=w.fmt.bits, GROUP=w.fmt.group_size,
        HIGH_BYTES=w.fmt.high_bytes_per_group, BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k,
        USE_ASM=native_dp4a(), num_warps=num_warps, **LAUNCH)
    return finish_splits(target, y, defer_sum)


def qgemv_lanes_reference(x, w):
    """Each row through the one-row kernel's arithmetic in plain torch (exact integer group sums)."""
    from .qgemv_int8 import qgemv_int8_reference

    return qgemv_int8_reference(x, w)
