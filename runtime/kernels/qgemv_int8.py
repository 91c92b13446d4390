"""Decode products (one row of x, or a block of 2..16 rows: MTP verify blocks, several lanes) for the
row-split formats (Q4/Q5/Q6/W8) with integer dot products.

Why: converting every 4-bit code to float (one I2F per weight, a quarter-rate instruction on Hopper)
made the float GEMV compute-bound at 0.18-0.35 of the copy bandwidth (the run record (`git show 5d8956c:bench/RESULTS.md`) §9). Here x is quantized per weight
group to 14 bits, split into a high and a low signed byte (x = 128 * hi + lo), and each 32-bit word
of codes meets x in `dp4a` instructions: four byte products per instruction, integer accumulation,
one float conversion per group. Nibble codes are made unsigned (q + 8) with one logic op per word;
the offset comes back as 8 * sum(x) per group. The fifth and sixth bits of Q5 / Q6 codes are spread
from their high plane into bit 4 / bits 4-5 of each byte with a multiply or a few shifts per word.

Row blocks (T = 2..16: verify blocks, several lanes), two kernels. The dp4a row kernel loads and
unpacks each code word once and meets every row's x words in dp4a ([rows of x, weight rows, words]
broadcast); with the one-row kernel's tiles and K-splits each row's integers and float sums are the
one-row kernel's, bit for bit, but its dp4a work grows with T. The int8 tensor-core kernel turns
codes into unsigned bytes with byte-parallel 32-bit logic (inline PTX: Q4 one shift + one lop3 per
four codes; Q5/Q6 pick the high bits with a per-byte mask operand, so how Triton packs bytes into
registers cannot misplace them) and feeds them with x's high and low bytes to int8 MMAs (exact int32
group sums; float sums in another order than decode's). Under the interpreter it unpacks with plain
integer ops (Q5/Q6 through the dp4a kernel's word-level unpacking).

Numerics: x is rounded to 14 bits relative to its group's largest magnitude (relative error of a
group's dot product <= ~1e-4); weights are exact. `qgemv_int8_reference` computes the same integer
sums in int64. Under TRITON_INTERPRET the dp4a instruction is emulated with shifts (same integers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import interpreted
from .conv1d import conv4_silu, conv4_weights
from .launch import LAUNCH, pdl_wait

X_LEVELS = 16319  # 127 * 128 + 63: the largest |x| code whose high byte stays within int8
X_TINY = 1e-30  # groups whose largest |x| is below this count as zero (their scale would underflow)
ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: adding it rounds a float to an integer (ties to even), no F2I
ROUND_MAGIC_BITS = 0x4B400000
INT8_BITS = (4, 5, 6, 8)  # formats this path serves
_X_LEVELS = tl.constexpr(X_LEVELS)  # kernels may read module globals only as constexpr
_X_TINY = tl.constexpr(X_TINY)
_ROUND_MAGIC = tl.constexpr(ROUND_MAGIC)
_ROUND_MAGIC_BITS = tl.constexpr(ROUND_MAGIC_BITS)


def native_dp4a() -> bool:
    """dp4a and the other inline PTX run natively (on a GPU), not emulated by the interpreter."""
    return not interpreted()


@triton.jit
def _dp4a(a, b, c, A_SIGNED: tl.constexpr, USE_ASM: tl.constexpr):
    """c + sum over the four bytes of a * b (b signed; a signed or unsigned), elementwise int32."""
    if USE_ASM:
        if A_SIGNED:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                             dtype=tl.int32, is_pure=True, pack=1)
    else:  # the interpreter: the four bytes side by side on a new last axis (a few ops per call, not 20)
        return c + tl.sum(_bytes4(a, A_SIGNED) * _bytes4(b, True), axis=-1)


@triton.jit
def _bytes4(words, SIGNED: tl.constexpr):
    """Interpreter only: int32 words [...] -> their four bytes [..., 4], byte 0 first, signed or unsigned."""
    up = 24 - 8 * tl.arange(0, 4)
    w = tl.expand_dims(words, -1)
    if SIGNED:
        return (w << up) >> 24
    return (w >> (24 - up)) & 255


@triton.jit
def _pack4(b0, b1, b2, b3):
    """Four signed byte values -> one int32 word, b0 in the lowest byte."""
    return (b0 & 255) | ((b1 & 255) << 8) | ((b2 & 255) << 16) | ((b3 & 255) << 24)


@triton.jit
def _quantized_x(x_ptr, k0, K, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr,
                 SWIGLU: tl.constexpr = False):
    """x lanes [k0, k0 + BLOCK_K) loaded and quantized (see _quantize_values). SWIGLU: the row holds a gate/up
    projection (gate lanes, then up lanes at K) and x is silu(gate) * up, rounded to the row's dtype as the
    SwiGLU kernel writes it."""
    ks = k0 + tl.arange(0, BLOCK_K)
    if SWIGLU:
        g = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + K + ks, mask=ks < K, other=0.0).to(tl.float32)
        xv = (g * tl.sigmoid(g) * u).to(x_ptr.dtype.element_ty).to(tl.float32)
    else:
        xv = tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
    return _quantize_values(xv, BITS, GROUP, BLOCK_K)


@triton.jit
def _quantize_values(xv, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """BLOCK_K lanes of x (float32) as dp4a words. Returns (hi_a, lo_a, hi_b, lo_b, x_scale [groups],
    x_sum [groups]): for 4- to 6-bit codes a = even lanes and b = odd lanes, BLOCK_K / 8 words each; for
    8-bit codes a = all lanes in order (BLOCK_K / 4 words) and b is unused."""
    gpb: tl.constexpr = BLOCK_K // GROUP
    xg = tl.reshape(xv, (gpb, GROUP))
    amax = tl.max(tl.abs(xg), axis=1)
    x_scale = tl.where(amax > _X_TINY, amax / _X_LEVELS, 1.0)
    xg = tl.where(amax[:, None] > _X_TINY, xg, 0.0)
    r = ((xg / x_scale[:, None]) + _ROUND_MAGIC).to(tl.int32, bitcast=True) - _ROUND_MAGIC_BITS
    x_sum = tl.sum(r, axis=1)
    hi = (r + 64) >> 7
    lo = r - (hi << 7)
    if BITS != 8:  # nibble formats: flat lane = word * 8 + byte * 2 + parity, byte = 2 * b1 + b0
        hi_e, hi_o = tl.split(tl.reshape(hi, (BLOCK_K // 8, 2, 2, 2)))
        lo_e, lo_o = tl.split(tl.reshape(lo, (BLOCK_K // 8, 2, 2, 2)))
    else:  # flat lane = word * 4 + byte; a dummy parity axis keeps one code path
        hi_e = tl.reshape(hi, (BLOCK_K // 4, 2, 2))
        lo_e = tl.reshape(lo, (BLOCK_K // 4, 2, 2))
        hi_o, lo_o = hi_e, lo_e
    a0, a1 = tl.split(hi_e)  # [words, b1] for b0 = 0, 1
    h00, h10 = tl.split(a0)
    h01, h11 = tl.split(a1)
    a0, a1 = tl.split(lo_e)
    l00, l10 = tl.split(a0)
    l01, l11 = tl.split(a1)
    a0, a1 = tl.split(hi_o)
    o00, o10 = tl.split(a0)
    o01, o11 = tl.split(a1)
    a0, a1 = tl.split(lo_o)
    p00, p10 = tl.split(a0)
    p01, p11 = tl.split(a1)
    return (_pack4(h00, h01, h10, h11), _pack4(l00, l01, l10, l11), _pack4(o00, o01, o10, o11),
            _pack4(p00, p01, p10, p11), x_scale, x_sum)


@triton.jit
def _spread_pairs(x):
    """2-bit fields at bits 0, 4, 8, 12 -> bits 4, 12, 20, 28."""
    y = (x & 0x33) | ((x & 0x3300) << 8)
    return ((y & 0x00030003) | ((y & 0x00300030) << 4)) << 4


@triton.jit
def _load_codes(base_ptr, high_ptr, rows, ok, widx, row_words, GPR: tl.constexpr, HIGH_BYTES: tl.constexpr,
                BITS: tl.constexpr):
    """Raw code words `widx` of `rows` where `ok` ([BLOCK_N, 1] or [BLOCK_N, words]) allows, and the
    matching high-plane entries (Q5: one byte per word; Q6: one int16 per word); formats without a
    high plane get the code words again (the compiler merges the copies)."""
    words = tl.load(base_ptr + rows[:, None] * row_words + widx[None, :], mask=ok, other=0)
    if BITS == 5:
        high = tl.load(high_ptr + rows[:, None] * (GPR * HIGH_BYTES) + widx[None, :], mask=ok, other=0)
    elif BITS == 6:
        high = tl.load(high_ptr + rows[:, None] * (GPR * HIGH_BYTES // 2) + widx[None, :], mask=ok, other=0)
    else:
        high = words
    return words, high


@triton.jit
def _unpack_codes(words, high, BITS: tl.constexpr):
    """Loaded code words as dp4a operands: (even, odd) lanes as unsigned bytes q + 2^(BITS-1) for 4-6
    bits; for 8 bits the signed words themselves (odd is unused)."""
    if BITS == 8:
        return words, words
    elif BITS == 4:
        even = (words ^ -2004318072) & 0x0F0F0F0F  # 0x88888888: two's-complement nibble -> q + 8
        odd = ((words >> 4) ^ 0x08080808) & 0x0F0F0F0F
        return even, odd
    else:
        if BITS == 5:  # even lanes' fifth bits are bits 0,2,4,6 of the byte; odd lanes' 1,3,5,7
            # inverted first (sign bit -> q + 16: each source bit lands on exactly one target bit, so
            # flipping before the spread equals flipping after, one op less per half); bit 2i -> bit
            # 8i + 4: the four partial products never carry into a target bit
            nb = ~high.to(tl.int32)
            he = ((nb & 0x55) * 0x00410410) & 0x10101010
            ho = (((nb >> 1) & 0x55) * 0x00410410) & 0x10101010
            return (words & 0x0F0F0F0F) | he, ((words >> 4) & 0x0F0F0F0F) | ho
        else:  # BITS == 6: even lanes bits 0-1, 4-5 of the int16; odd lanes 2-3, 6-7
            h = high.to(tl.int32) & 0xFFFF
            he = _spread_pairs(h & 0x3333)
            ho = _spread_pairs((h >> 2) & 0x3333)
            flip: tl.constexpr = 0x20202020  # sign bit -> q + 32
            return (words & 0x0F0F0F0F) | (he ^ flip), ((words >> 4) & 0x0F0F0F0F) | (ho ^ flip)


@triton.jit
def _code_bytes(base_ptr, high_ptr, rows, row_ok, widx, row_words, GPR: tl.constexpr, HIGH_BYTES: tl.constexpr,
                BITS: tl.constexpr):
    """Code words `widx` of `rows` as dp4a operands (see _unpack_codes)."""
    words, high = _load_codes(base_ptr, high_ptr, rows, row_ok[:, None], widx, row_words, GPR, HIGH_BYTES, BITS)
    return _unpack_codes(words, high, BITS)


@triton.jit
def _block_words(first, WORDS: tl.constexpr):
    """Word indices first .. first + WORDS - 1 of a block that starts at a multiple of WORDS (k0 steps
    by BLOCK_K; `first` a runtime value or the constant 0), declared so: code words load as vectors."""
    return tl.max_contiguous(tl.multiple_of(first + tl.arange(0, WORDS), WORDS), WORDS)


@triton.jit
def _weight_tile(base_ptr, high_ptr, scale_ptr, rows, ok, k0, GPR: tl.constexpr, K_PAD: tl.constexpr,
                 BITS: tl.constexpr, GROUP: tl.constexpr, HIGH_BYTES: tl.constexpr, BLOCK_K: tl.constexpr):
    """Everything the weights contribute to lanes [k0, k0 + BLOCK_K) of `rows` (masked by `ok`,
    [BLOCK_N, 1]): (code words, high plane, group scales). Weights are never written while a model
    runs, so a kernel may load its first tile before pdl_wait()."""
    LANES: tl.constexpr = 4 if BITS == 8 else 8
    wpb: tl.constexpr = BLOCK_K // LANES
    widx = _block_words(k0 // LANES, wpb)
    words, high = _load_codes(base_ptr, high_ptr, rows, ok, widx, K_PAD // LANES, GPR, HIGH_BYTES, BITS)
    gidx = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    scale = tl.load(scale_ptr + rows[:, None] * GPR + gidx[None, :], mask=ok, other=0.0)
    return words, high, scale


@triton.jit
def _dot_rows_int8(x_ptr, base_ptr, high_ptr, scale_ptr, rows, row_ok, K, k_begin, k_end, words, high, w_scale,
                   GPR: tl.constexpr, K_PAD: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                   HIGH_BYTES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr,
                   PREQUANT: tl.constexpr, SWIGLU: tl.constexpr = False):
    """sum_k W[rows, k] * x[k] over [k_begin, k_end) -> [BLOCK_N] float32; (words, high, w_scale) is
    the first tile, from _weight_tile(..., k_begin, ...). `base_ptr` points at the code plane as int32
    words (8 lanes per word for 4-6 bits, 4 for 8 bits); for Q6 `high_ptr` is the high plane as int16.
    With PREQUANT, `x_ptr` is x's row already in dp4a words (see _quantize_x_kernel), shared by every
    program instead of quantized by each; SWIGLU: x is SwiGLU of a gate/up row (_quantized_x). Each step issues the next tile's loads before its own
    arithmetic, so two tiles per program are in flight (the loop waits on memory, not on issue)."""
    LANES: tl.constexpr = 4 if BITS == 8 else 8  # lanes per code word
    gpb: tl.constexpr = BLOCK_K // GROUP
    wpb: tl.constexpr = BLOCK_K // LANES  # words per block and row
    row_words: tl.constexpr = K_PAD // LANES
    acc = tl.zeros((BLOCK_N, gpb), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        # a block-shaped condition: triton 3.9's interpreter rejects a scalar bool broadcast into a mask
        more = row_ok[:, None] & (tl.full((1, 1), k0 + BLOCK_K, tl.int32) < k_end)
        next_words, next_high, next_scale = _weight_tile(base_ptr, high_ptr, scale_ptr, rows, more, k0 + BLOCK_K,
                                                         GPR, K_PAD, BITS, GROUP, HIGH_BYTES, BLOCK_K)
        if PREQUANT:
            widx = _block_words(k0 // LANES, wpb)
            gq = k0 // GROUP + tl.arange(0, gpb)
            hi_a = tl.load(x_ptr + widx)
            lo_a = tl.load(x_ptr + row_words + widx)
            hi_b = tl.load(x_ptr + 2 * row_words + widx)
            lo_b = tl.load(x_ptr + 3 * row_words + widx)
            x_scale = tl.load(x_ptr + 4 * row_words + gq).to(tl.float32, bitcast=True)
            x_sum = tl.load(x_ptr + 4 * row_words + GPR + gq)
        else:
            hi_a, lo_a, hi_b, lo_b, x_scale, x_sum = _quantized_x(x_ptr, k0, K, BITS, GROUP, BLOCK_K, SWIGLU)
        even, odd = _unpack_codes(words, high, BITS)
        acc += group_products(even, odd, hi_a, lo_a, hi_b, lo_b, x_scale, x_sum, w_scale, BITS, GROUP, BLOCK_N, BLOCK_K,
                              USE_ASM)
        words, high, w_scale = next_words, next_high, next_scale
    return tl.sum(acc, axis=1)


@triton.jit
def _dp4a_joined(codes, hi, lo, SIGNED: tl.constexpr):
    """Interpreter only: (dp4a(codes, hi) << 7) + dp4a(codes, lo) for codes [N, words] against x's words [words],
    taken as one byte product with x's code hi * 128 + lo per byte: the same int32 (nothing overflows)."""
    x = _bytes4(hi, True) * 128 + _bytes4(lo, True)
    return tl.sum(_bytes4(codes, SIGNED) * tl.expand_dims(x, 0), axis=2)


@triton.jit
def group_products(even, odd, hi_a, lo_a, hi_b, lo_b, x_scale, x_sum, w_scale, BITS: tl.constexpr, GROUP: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr):
    """One tile of unpacked code words (_unpack_codes) against one row of x's dp4a words: the float
    contribution [BLOCK_N, groups] = exact integer group sums (less the code offset) times both scales.
    Every row-of-x product (decode GEMV, the lanes kernel) runs this, so their rows agree bit for bit."""
    LANES: tl.constexpr = 4 if BITS == 8 else 8
    gpb: tl.constexpr = BLOCK_K // GROUP
    wpb: tl.constexpr = BLOCK_K // LANES
    wpg: tl.constexpr = GROUP // LANES
    OFFSET: tl.constexpr = 0 if BITS == 8 else 1 << (BITS - 1)  # codes enter dp4a as q + OFFSET >= 0
    zero = tl.zeros((BLOCK_N, wpb), dtype=tl.int32) if USE_ASM else None
    if not USE_ASM:  # the interpreter: the same integer sums with x's two bytes joined first (fewer ops)
        d = _dp4a_joined(even, hi_a, lo_a, BITS == 8)
        if BITS != 8:
            d += _dp4a_joined(odd, hi_b, lo_b, False)
    elif BITS == 8:
        d = _dp4a(even, tl.broadcast_to(hi_a[None, :], (BLOCK_N, wpb)), zero, True, USE_ASM) << 7
        d = _dp4a(even, tl.broadcast_to(lo_a[None, :], (BLOCK_N, wpb)), d, True, USE_ASM)
    else:
        d = _dp4a(even, tl.broadcast_to(hi_a[None, :], (BLOCK_N, wpb)), zero, False, USE_ASM)
        d = _dp4a(odd, tl.broadcast_to(hi_b[None, :], (BLOCK_N, wpb)), d, False, USE_ASM) << 7
        d = _dp4a(even, tl.broadcast_to(lo_a[None, :], (BLOCK_N, wpb)), d, False, USE_ASM)
        d = _dp4a(odd, tl.broadcast_to(lo_b[None, :], (BLOCK_N, wpb)), d, False, USE_ASM)
    dg = tl.sum(tl.reshape(d, (BLOCK_N, gpb, wpg)), axis=2)
    if OFFSET != 0:
        dg -= OFFSET * x_sum[None, :]
    return dg.to(tl.float32) * (w_scale.to(tl.float32) * x_scale[None, :])


@triton.jit
def write_quantized_x(xq_row_ptr, xv, k0, K_PAD: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """Lanes [k0, k0 + BLOCK_K) of one row of x (float32, already rounded to the activation dtype, zero
    beyond K) -> that row's dp4a words: [hi_a | lo_a | hi_b | lo_b] (K_PAD / LANES words each), then the
    group scales (float32 bits) and the group sums. Lanes at or beyond K_PAD are not stored. Kernels
    that produce a GEMV's input write it here, so the GEMV needs no quantization launch of its own."""
    LANES: tl.constexpr = 4 if BITS == 8 else 8
    row_words: tl.constexpr = K_PAD // LANES
    GPR: tl.constexpr = K_PAD // GROUP
    hi_a, lo_a, hi_b, lo_b, x_scale, x_sum = _quantize_values(xv, BITS, GROUP, BLOCK_K)
    widx = k0 // LANES + tl.arange(0, BLOCK_K // LANES)
    gq = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
    wok = widx < row_words
    gok = gq < GPR
    tl.store(xq_row_ptr + widx, hi_a, mask=wok)
    tl.store(xq_row_ptr + row_words + widx, lo_a, mask=wok)
    tl.store(xq_row_ptr + 2 * row_words + widx, hi_b, mask=wok)  # 8-bit codes: copies of a (unread)
    tl.store(xq_row_ptr + 3 * row_words + widx, lo_b, mask=wok)
    tl.store(xq_row_ptr + 4 * row_words + gq, x_scale.to(tl.int32, bitcast=True), mask=gok)
    tl.store(xq_row_ptr + 4 * row_words + GPR + gq, x_sum, mask=gok)


@triton.jit
def _quantize_x_kernel(x_ptr, xq_ptr, K, stride_x, ROW_INTS: tl.constexpr, K_PAD: tl.constexpr,
                       BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows of x -> dp4a words (see write_quantized_x); ROW_INTS int32 per row."""
    pdl_wait()
    r = tl.program_id(0)
    k0 = tl.program_id(1) * BLOCK_K
    ks = k0 + tl.arange(0, BLOCK_K)
    xv = tl.load(x_ptr + r * stride_x + ks, mask=ks < K, other=0.0).to(tl.float32)
    write_quantized_x(xq_ptr + r * ROW_INTS, xv, k0, K_PAD, BITS, GROUP, BLOCK_K)


def _lanes(bits: int) -> int:
    """Lanes per 32-bit code word."""
    return 4 if bits == 8 else 8


@dataclass(frozen=True)
class QuantizedX:
    """Rows of x already in dp4a words for products whose weights have this geometry; a kernel that
    produces x (rmsnorm, SwiGLU, gated norm) can fill it in the same launch (write_quantized_x)."""

    words: torch.Tensor  # int32 [T, row_ints]
    k_pad: int
    group: int
    bits: int  # 8, or any nibble width (4-6 share one layout)

    @staticmethod
    def empty(rows: int, w, device) -> "QuantizedX":
        bits = 8 if w.fmt.bits == 8 else 4
        row_ints = 4 * (w.k_pad // _lanes(bits)) + 2 * w.groups_per_row
        return QuantizedX(torch.empty(rows, row_ints, dtype=torch.int32, device=device), w.k_pad, w.fmt.group_size,
                          bits)

    def check(self, w, rows: int) -> torch.Tensor:
        """The words, after checking they were made for `w`'s layout and `rows` rows of x."""
        if (self.k_pad, self.group, self.bits == 8) != (w.k_pad, w.fmt.group_size, w.fmt.bits == 8) or \
                self.words.shape[0] != rows:
            raise ValueError(f"quantized x for K_pad {self.k_pad}, group {self.group}, {self.words.shape[0]} rows "
                             f"does not fit a {w.fmt.name} weight with K_pad {w.k_pad} and {rows} rows of x")
        return self.words

    def fits(self, rows: int, lanes: int, chunk: int, covered: int) -> bool:
        """Whether a producer of `rows` rows of `lanes` lanes can fill these words itself: its programs
        write `chunk` lanes each (whole groups and whole words) and together lanes [0, covered),
        zeros past `lanes`, which must reach K_pad."""
        return (self.words.shape[0] == rows and lanes <= self.k_pad <= covered and chunk % self.group == 0
                and chunk % _lanes(self.bits) == 0)

    def fill(self, x: torch.Tensor) -> "QuantizedX":
        """Quantize rows of x [T, K] into these words in their own launch."""
        block_k = 128 if self.k_pad % 256 else 256
        _quantize_x_kernel[(x.shape[0], self.k_pad // block_k)](
            x, self.words, x.shape[1], x.stride(0), ROW_INTS=self.words.shape[1], K_PAD=self.k_pad, BITS=self.bits,
            GROUP=self.group, BLOCK_K=block_k, **LAUNCH)
        return self


def producer_words(xq: QuantizedX | None, placeholder: torch.Tensor, rows: int, lanes: int, chunk: int,
                   covered: int) -> tuple[bool, torch.Tensor, dict]:
    """What a kernel producing x passes for `xq` (see QuantizedX.fits for the geometry): (whether it
    fills the words itself, the words or `placeholder`, the constexprs of write_quantized_x). When it
    does not and `xq` is given, the caller fills them after the launch (xq.fill)."""
    if xq is not None and xq.fits(rows, lanes, chunk, covered):
        return True, xq.words, {"QUANT": True, "ROW_INTS": xq.words.shape[1], "K_PAD": xq.k_pad, "QBITS": xq.bits,
                                "GROUP": xq.group}
    return False, placeholder, {"QUANT": False, "ROW_INTS": 0, "K_PAD": 0, "QBITS": 4, "GROUP": 64}


def quantize_x(x: torch.Tensor, w, xq: QuantizedX | None = None) -> torch.Tensor:
    """Rows of x [T, K] in dp4a words for weights shaped like `w` -> int32 [T, row ints]; when `xq`
    is given (filled by the kernel that produced x) it is used as is."""
    if xq is not None:
        return xq.check(w, x.shape[0])
    return QuantizedX.empty(x.shape[0], w, x.device).fill(x).words


@triton.jit
def _qgemv_int8_kernel(x_ptr, base_ptr, high_ptr, scale_ptr, y_ptr, N, K, K_PER_SPLIT,
                       conv_state_ptr, conv_lane_ptr, conv_w_ptr, CONV_C, CONV_SLOTS,
                       GPR: tl.constexpr, K_PAD: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                       HIGH_BYTES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       USE_ASM: tl.constexpr, PREQUANT: tl.constexpr, SWIGLU_OUT: tl.constexpr = False,
                       CONV: tl.constexpr = False):
    """SWIGLU_OUT (one split): W is a gate/up pair [2I, K] (N = 2I) and y gets silu(gate) * up [I]: a program's
    even rows are gate rows, each odd one the matching up row, rounded to y's dtype before the SwiGLU (the
    numbers the swiglu kernel would have read). CONV (one split, one row): rows < CONV_C get the width-4 causal
    conv + SiLU of conv1d's lanes kernel over the lane's carried window (slot 0 of its stack [slots, 3, CONV_C]),
    which each program moves on for its own rows: a GDN layer's qkvz product and its conv in one launch."""
    split = tl.program_id(1)
    if SWIGLU_OUT:
        local = tl.arange(0, BLOCK_N)
        act_rows = tl.program_id(0) * (BLOCK_N // 2) + local // 2
        rows = act_rows + (local % 2) * (N // 2)
        row_ok = act_rows < N // 2
    else:
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
    # the first weight tile streams in while the kernel before this one finishes
    words, high, w_scale = _weight_tile(base_ptr, high_ptr, scale_ptr, rows, row_ok[:, None], split * K_PER_SPLIT,
                                        GPR, K_PAD, BITS, GROUP, HIGH_BYTES, BLOCK_K)
    pdl_wait()
    y = _dot_rows_int8(x_ptr, base_ptr, high_ptr, scale_ptr, rows, row_ok, K, split * K_PER_SPLIT,
                       (split + 1) * K_PER_SPLIT, words, high, w_scale, GPR, K_PAD, BITS, GROUP, HIGH_BYTES, BLOCK_N,
                       BLOCK_K, USE_ASM, PREQUANT)
    if SWIGLU_OUT:
        gate, up = tl.split(tl.reshape(y.to(y_ptr.dtype.element_ty).to(tl.float32), (BLOCK_N // 2, 2)))
        out_rows = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + out_rows, (gate * tl.sigmoid(gate) * up).to(y_ptr.dtype.element_ty), mask=out_rows < N // 2)
    elif CONV:
        _conv_epilogue(y, rows, row_ok, y_ptr, conv_state_ptr, conv_lane_ptr, conv_w_ptr, CONV_C, CONV_SLOTS)
    else:
        tl.store(y_ptr + split * N + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _conv_epilogue(y, rows, row_ok, y_ptr, state_ptr, lane_ptr, w_ptr, C, SLOTS):
    """conv1d's _conv4_lanes_kernel for one step over this program's rows of the product (its arithmetic, conv4_silu,
    and its roundings: the product as stored, then as the state's dtype; SiLU rounded to the state's dtype)."""
    state_ty = state_ptr.dtype.element_ty
    xt = y.to(y_ptr.dtype.element_ty).to(state_ty).to(tl.float32)
    conv = row_ok & (rows < C)
    lane = tl.load(lane_ptr).to(tl.int64)
    st = state_ptr + lane * SLOTS * 3 * C
    p0 = tl.load(st + rows, mask=conv, other=0.0).to(tl.float32)
    p1 = tl.load(st + C + rows, mask=conv, other=0.0).to(tl.float32)
    p2 = tl.load(st + 2 * C + rows, mask=conv, other=0.0).to(tl.float32)
    w0, w1, w2, w3 = conv4_weights(w_ptr, rows, conv)
    silu = conv4_silu(w0, w1, w2, w3, p0, p1, p2, xt).to(state_ty).to(tl.float32)
    tl.store(y_ptr + rows, tl.where(conv, silu, y).to(y_ptr.dtype.element_ty), mask=row_ok)
    tl.store(st + rows, p1.to(state_ty), mask=conv)
    tl.store(st + C + rows, p2.to(state_ty), mask=conv)
    tl.store(st + 2 * C + rows, xt.to(state_ty), mask=conv)


@triton.jit
def _qgemm_rows_int8_kernel(xq_ptr, base_ptr, high_ptr, scale_ptr, y_ptr, T, N, K_PER_SPLIT, ROW_INTS: tl.constexpr,
                            GPR: tl.constexpr, K_PAD: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                            HIGH_BYTES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr):
    """A few rows of x (pre-quantized, ROW_INTS int32 each): [BLOCK_T, BLOCK_N, words] broadcasts of
    each row's x words against the code words, unpacked once; the arithmetic of _dot_rows_int8."""
    pdl_wait()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    toks = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < N
    tok_ok = toks < T
    LANES: tl.constexpr = 4 if BITS == 8 else 8
    gpb: tl.constexpr = BLOCK_K // GROUP
    wpb: tl.constexpr = BLOCK_K // LANES
    wpg: tl.constexpr = GROUP // LANES
    row_words: tl.constexpr = K_PAD // LANES
    OFFSET: tl.constexpr = 0 if BITS == 8 else 1 << (BITS - 1)
    shape: tl.constexpr = (BLOCK_T, BLOCK_N, wpb)
    xrow = xq_ptr + toks[:, None] * ROW_INTS  # [BLOCK_T, 1]
    xm = tok_ok[:, None]
    acc = tl.zeros((BLOCK_T, BLOCK_N, gpb), dtype=tl.float32)
    for k0 in range(split * K_PER_SPLIT, (split + 1) * K_PER_SPLIT, BLOCK_K):
        widx = _block_words(k0 // LANES, wpb)
        gq = k0 // GROUP + tl.arange(0, gpb)
        hi_a = tl.broadcast_to(tl.load(xrow + widx[None, :], mask=xm, other=0)[:, None, :], shape)
        lo_a = tl.broadcast_to(tl.load(xrow + row_words + widx[None, :], mask=xm, other=0)[:, None, :], shape)
        x_scale = tl.load(xrow + 4 * row_words + gq[None, :], mask=xm, other=0).to(tl.float32, bitcast=True)
        x_sum = tl.load(xrow + 4 * row_words + GPR + gq[None, :], mask=xm, other=0)
        even, odd = _code_bytes(base_ptr, high_ptr, rows, row_ok, widx, row_words, GPR, HIGH_BYTES, BITS)
        even = tl.broadcast_to(even[None, :, :], shape)
        zero = tl.zeros(shape, dtype=tl.int32)
        if BITS == 8:
            d = _dp4a(even, hi_a, zero, True, USE_ASM) << 7
            d = _dp4a(even, lo_a, d, True, USE_ASM)
        else:
            odd = tl.broadcast_to(odd[None, :, :], shape)
            hi_b = tl.broadcast_to(tl.load(xrow + 2 * row_words + widx[None, :], mask=xm, other=0)[:, None, :], shape)
            lo_b = tl.broadcast_to(tl.load(xrow + 3 * row_words + widx[None, :], mask=xm, other=0)[:, None, :], shape)
            d = _dp4a(even, hi_a, zero, False, USE_ASM)
            d = _dp4a(odd, hi_b, d, False, USE_ASM) << 7
            d = _dp4a(even, lo_a, d, False, USE_ASM)
            d = _dp4a(odd, lo_b, d, False, USE_ASM)
        dg = tl.sum(tl.reshape(d, (BLOCK_T, BLOCK_N, gpb, wpg)), axis=3)
        if OFFSET != 0:
            dg -= OFFSET * x_sum[:, None, :]
        w_scale = tl.load(scale_ptr + rows[:, None] * GPR + gq[None, :], mask=row_ok[:, None], other=0.0)
        acc += dg.to(tl.float32) * (w_scale.to(tl.float32)[None, :, :] * x_scale[:, None, :])
    y = tl.sum(acc, axis=2)
    out = y_ptr + split * T * N + toks[:, None] * N + rows[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=tok_ok[:, None] & row_ok[None, :])


def qgemm_rows_int8(x: torch.Tensor, w, y: torch.Tensor, block_t: int, block_n: int, block_k: int, split: int,
                    num_warps: int, xq: QuantizedX | None = None) -> torch.Tensor:
    """y = x @ W^T for a few rows of x with the dp4a kernel; x [T, K], y [T, N]."""
    t = x.shape[0]
    if w.k_pad % (split * block_k):
        raise ValueError(f"qgemm_rows_int8: {split} K-splits of {block_k}-lane blocks do not tile K_pad {w.k_pad}")
    xq = quantize_x(x, w, xq)
    target = split_partials(y, split)
    _qgemm_rows_int8_kernel[(triton.cdiv(w.rows, block_n), split, triton.cdiv(t, block_t))](
        xq, code_words(w.base), high_plane(w), w.scale, target, t, w.rows, w.k_pad // split, ROW_INTS=xq.shape[1],
        GPR=w.groups_per_row, K_PAD=w.k_pad, BITS=w.fmt.bits, GROUP=w.fmt.group_size,
        HIGH_BYTES=w.fmt.high_bytes_per_group, BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k,
        USE_ASM=native_dp4a(), num_warps=num_warps, **LAUNCH)
    return finish_splits(target, y)


@triton.jit
def _nibble_bytes(b, ODD: tl.constexpr, USE_ASM: tl.constexpr):
    """Q4 code bytes b (uint8: lanes 2j and 2j + 1) -> int8 codes q + 8 of the low (ODD = 0) or high
    nibble's lane. Natively one 32-bit shift + logic op per four bytes (Triton's byte arithmetic costs
    ~7 instructions per byte); the op is the same in every byte, so how Triton groups bytes into
    registers does not matter (a Q5 variant that depended on byte positions in the register was wrong)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            f"{{ .reg .b32 t; shr.u32 t, $1, {4 * ODD}; lop3.b32 $0, t, 0x0F0F0F0F, 0x08080808, 0x6a; }}",
            "=r,r", [b], dtype=tl.int8, is_pure=True, pack=4)
    else:
        return (((b.to(tl.int32) >> (4 * ODD)) & 0xF) ^ 8).to(tl.int8)


@triton.jit
def _q5_bytes(b, hb, bit, ODD: tl.constexpr):
    """Q5 code bytes b (uint8) -> int8 codes q + 16 of the low (ODD = 0) or high nibble's lane, with the
    fifth bit from `hb` (the lane's high-plane byte) at the position marked in `bit` (one set bit per
    byte). Byte-parallel 32-bit ops (a masked byte is nonzero iff adding 0x7F sets its top bit), so the
    result does not depend on how Triton packs bytes into registers."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t, c; and.b32 t, $2, $3; add.u32 t, t, 0x7F7F7F7F; and.b32 t, t, 0x80808080; "
        f"shr.u32 t, t, 3; xor.b32 t, t, 0x10101010; shr.u32 c, $1, {4 * ODD}; "
        "lop3.b32 $0, c, 0x0F0F0F0F, t, 0xea; }",
        "=r,r,r,r", [b, hb, bit], dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def _q6_bytes(b, hb, bit, ODD: tl.constexpr):
    """Q6 code bytes b (uint8) -> int8 codes q + 32: bits 4 and 5 from `hb` at the position marked in
    `bit` and the one above it (byte-parallel, as _q5_bytes)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t, u, m, c; and.b32 t, $2, $3; add.u32 t, t, 0x7F7F7F7F; and.b32 t, t, 0x80808080; "
        "shr.u32 t, t, 3; shl.b32 m, $3, 1; and.b32 u, $2, m; add.u32 u, u, 0x7F7F7F7F; and.b32 u, u, 0x80808080; "
        f"shr.u32 u, u, 2; or.b32 t, t, u; xor.b32 t, t, 0x20202020; shr.u32 c, $1, {4 * ODD}; "
        "lop3.b32 $0, c, 0x0F0F0F0F, t, 0xea; }",
        "=r,r,r,r", [b, hb, bit], dtype=tl.int8, is_pure=True, pack=4)


@triton.jit
def _word_bytes(words, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr):
    """int32 words [BLOCK_N, WIDTH / 4] of byte values -> int8 [BLOCK_N, WIDTH], byte k of word w at 4w + k."""
    k = tl.arange(0, 4)
    return tl.reshape(((words[:, :, None] >> (8 * k[None, None, :])) & 255).to(tl.int8), (BLOCK_N, WIDTH))


@triton.jit
def unpack_group_bytes(b, hb, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr):
    """A weight group's loaded planes -> (even, odd) lanes as unsigned int8 codes q + 2^(BITS-1): `b` the
    code bytes [BLOCK_N, GROUP / 2]; `hb` Q5's 8 high bytes, Q6's 8 high int16 words (else unused).
    Q5 / Q6 need the inline-PTX path (the interpreter takes group_code_bytes' word path)."""
    WIDTH: tl.constexpr = GROUP // 2
    j = tl.arange(0, WIDTH)
    if BITS == 4:
        even = _nibble_bytes(b, 0, USE_ASM)
        odd = _nibble_bytes(b, 1, USE_ASM)
    elif BITS == 5:
        hbb = tl.reshape(tl.broadcast_to(hb[:, :, None], (BLOCK_N, 8, 4)), (BLOCK_N, WIDTH))
        even = _q5_bytes(b, hbb, (1 << (2 * (j % 4))).to(tl.uint8)[None, :], 0)
        odd = _q5_bytes(b, hbb, (2 << (2 * (j % 4))).to(tl.uint8)[None, :], 1)
    else:  # BITS == 6: int16 per word: byte k's lanes use bits 4k..4k+3; take its byte
        k = tl.arange(0, 4)[None, None, :]
        hbb = tl.reshape(((hb.to(tl.int32)[:, :, None] >> (8 * (k // 2))) & 255).to(tl.uint8), (BLOCK_N, WIDTH))
        low_bit = (1 << (4 * ((j % 4) % 2))).to(tl.uint8)[None, :]
        even = _q6_bytes(b, hbb, low_bit, 0)
        odd = _q6_bytes(b, hbb, low_bit << 2, 1)
    return even, odd


@triton.jit
def group_code_bytes(code_ptr, high_ptr, rows, row_ok, g, GPR: tl.constexpr, K_PAD: tl.constexpr, BITS: tl.constexpr,
                     GROUP: tl.constexpr, HIGH_BYTES: tl.constexpr, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr):
    """Weight group `g` of `rows` as bytes: nibble formats -> (even, odd) lanes as unsigned int8 codes
    q + 2^(BITS-1), [BLOCK_N, GROUP / 2] each; W8 -> (codes, codes) as signed int8 [BLOCK_N, GROUP].
    `code_ptr` is the code plane as bytes (int8 for W8), or as int32 words for the interpreted Q5/Q6
    path, which reuses the dp4a kernel's word-level unpacking."""
    NIBBLES: tl.constexpr = BITS != 8
    WIDTH: tl.constexpr = GROUP // 2 if NIBBLES else GROUP  # code bytes per group
    j = tl.arange(0, WIDTH)
    # one if-chain, no early return: triton compiles the statements after a return inside a static if
    if BITS == 8:
        even = tl.load(code_ptr + rows[:, None] * K_PAD + g * WIDTH + j[None, :], mask=row_ok[:, None], other=0)
        odd = even
    elif BITS == 4 or USE_ASM:
        b = tl.load(code_ptr + rows[:, None] * (K_PAD // 2) + g * WIDTH + j[None, :], mask=row_ok[:, None], other=0)
        if BITS == 5:
            hb = tl.load(high_ptr + rows[:, None] * (GPR * HIGH_BYTES) + g * HIGH_BYTES + tl.arange(0, 8)[None, :],
                         mask=row_ok[:, None], other=0)
        elif BITS == 6:
            hb = tl.load(high_ptr + rows[:, None] * (GPR * HIGH_BYTES // 2) + g * (HIGH_BYTES // 2)
                         + tl.arange(0, 8)[None, :], mask=row_ok[:, None], other=0)
        else:
            hb = b
        even, odd = unpack_group_bytes(b, hb, BITS, GROUP, BLOCK_N, USE_ASM)
    else:  # interpreted Q5 / Q6: the dp4a kernel's word-level unpacking, then each word's bytes
        widx = g * (GROUP // 8) + tl.arange(0, GROUP // 8)
        ew, ow = _code_bytes(code_ptr, high_ptr, rows, row_ok, widx, K_PAD // 8, GPR, HIGH_BYTES, BITS)
        even = _word_bytes(ew, BLOCK_N, WIDTH)
        odd = _word_bytes(ow, BLOCK_N, WIDTH)
    return even, odd


@triton.jit
def _qgemm_rows_mma_kernel(xb_ptr, xi_ptr, code_ptr, high_ptr, scale_ptr, y_ptr, T, N, GROUPS_PER_SPLIT,
                           ROW_INTS: tl.constexpr, GPR: tl.constexpr, K_PAD: tl.constexpr, BITS: tl.constexpr,
                           GROUP: tl.constexpr, HIGH_BYTES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                           GROUPS_PER_STEP: tl.constexpr, USE_ASM: tl.constexpr):
    """A block of x rows on integer tensor cores: per weight group, the codes as bytes (nibble formats:
    unsigned q + 2^(BITS-1)) times the rows' high and low x bytes in int8 dots with int32 sums, then the
    group's offset and scales in float. `xb_ptr` / `xi_ptr` are the same pre-quantized rows (see
    _quantize_x_kernel) as int8 and as int32."""
    pdl_wait()
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    toks = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < N
    tok_ok = toks < T
    NIBBLES: tl.constexpr = BITS != 8
    LANES: tl.constexpr = 4 if BITS == 8 else 8
    row_words: tl.constexpr = K_PAD // LANES
    PLANE: tl.constexpr = 4 * row_words  # bytes per x plane
    WIDTH: tl.constexpr = GROUP // 2 if NIBBLES else GROUP  # code bytes (and x bytes per plane) per group
    OFFSET: tl.constexpr = 0 if BITS == 8 else 1 << (BITS - 1)
    j = tl.arange(0, WIDTH)
    x_rows = xb_ptr + toks[None, :] * (4 * ROW_INTS) + j[:, None]  # [WIDTH, BLOCK_T]: x^T
    xm = tok_ok[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    for g0 in range(split * GROUPS_PER_SPLIT, (split + 1) * GROUPS_PER_SPLIT, GROUPS_PER_STEP):
        for gg in tl.static_range(GROUPS_PER_STEP):  # several groups per iteration: more loads in flight
            g = g0 + gg
            x_hi = tl.load(x_rows + g * WIDTH, mask=xm, other=0)
            x_lo = tl.load(x_rows + PLANE + g * WIDTH, mask=xm, other=0)
            even, odd = group_code_bytes(code_ptr, high_ptr, rows, row_ok, g, GPR, K_PAD, BITS, GROUP, HIGH_BYTES,
                                         BLOCK_N, USE_ASM)
            if NIBBLES:
                xo_hi = tl.load(x_rows + 2 * PLANE + g * WIDTH, mask=xm, other=0)
                xo_lo = tl.load(x_rows + 3 * PLANE + g * WIDTH, mask=xm, other=0)
                d = tl.dot(odd, xo_hi, tl.dot(even, x_hi, out_dtype=tl.int32), out_dtype=tl.int32)
                d = tl.dot(odd, xo_lo, tl.dot(even, x_lo, d << 7, out_dtype=tl.int32), out_dtype=tl.int32)
            else:
                d = tl.dot(even, x_lo, tl.dot(even, x_hi, out_dtype=tl.int32) << 7, out_dtype=tl.int32)
            x_info = xi_ptr + toks * ROW_INTS + 4 * row_words + g
            x_scale = tl.load(x_info, mask=tok_ok, other=0).to(tl.float32, bitcast=True)
            if OFFSET != 0:
                d -= OFFSET * tl.load(x_info + GPR, mask=tok_ok, other=0)[None, :]
            w_scale = tl.load(scale_ptr + rows * GPR + g, mask=row_ok, other=0.0).to(tl.float32)
            acc += d.to(tl.float32) * (w_scale[:, None] * x_scale[None, :])
    out = y_ptr + split * T * N + toks[None, :] * N + rows[:, None]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & tok_ok[None, :])


def qgemm_rows_mma(x: torch.Tensor, w, y: torch.Tensor, block_n: int, split: int, num_warps: int,
                   groups_per_step: int = 1, num_stages: int = 3, xq: QuantizedX | None = None) -> torch.Tensor:
    """y = x @ W^T for a block of rows of x on int8 tensor cores (16 rows per program); x [T, K], y [T, N]."""
    t = x.shape[0]
    if w.groups_per_row % (split * groups_per_step):
        raise ValueError(f"qgemm_rows_mma: {split} K-splits of {groups_per_step}-group steps do not tile "
                         f"{w.groups_per_row} groups")
    xq = quantize_x(x, w, xq)
    target = split_partials(y, split)
    # code bytes (int32 words for the interpreter's Q5/Q6 word path)
    code = w.base.view(torch.int8) if w.fmt.bits == 8 else w.base.view(torch.uint8)
    if w.fmt.bits in (5, 6) and not native_dp4a():
        code = code_words(w.base)
    _qgemm_rows_mma_kernel[(triton.cdiv(w.rows, block_n), split, triton.cdiv(t, 16))](
        xq.view(torch.int8), xq, code, high_plane(w), w.scale, target, t, w.rows, w.groups_per_row // split,
        ROW_INTS=xq.shape[1], GPR=w.groups_per_row, K_PAD=w.k_pad, BITS=w.fmt.bits, GROUP=w.fmt.group_size,
        HIGH_BYTES=w.fmt.high_bytes_per_group, BLOCK_T=16, BLOCK_N=block_n, GROUPS_PER_STEP=groups_per_step,
        USE_ASM=native_dp4a(), num_warps=num_warps, num_stages=num_stages, **LAUNCH)
    return finish_splits(target, y)


@triton.jit
def _sum_splits_kernel(src_ptr, dst_ptr, SPLITS, M, BLOCK: tl.constexpr):
    pdl_wait()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in range(SPLITS):
        acc += tl.load(src_ptr + s * M + i, mask=ok, other=0.0)
    tl.store(dst_ptr + i, acc.to(dst_ptr.dtype.element_ty), mask=ok)


def split_partials(y: torch.Tensor, split: int) -> torch.Tensor:
    """Where a product with `split` K-splits writes: y itself for one split, else float32 partials
    [split, *y.shape] for finish_splits to sum."""
    return y if split == 1 else torch.empty(split, *y.shape, dtype=torch.float32, device=y.device)


@dataclass(frozen=True)
class SplitPartials:
    """A product's float32 K-split partials [splits, T, N], not yet summed into `y` (unwritten). The
    RMSNorm after a layer's last products sums them itself (in split order, rounded to y's dtype, as
    finish_splits would), which saves a launch per product."""

    parts: torch.Tensor
    y: torch.Tensor


def finish_splits(target: torch.Tensor, y: torch.Tensor, defer: bool = False) -> torch.Tensor | SplitPartials:
    """Sum the float32 K-split partials [splits, T, N] into y in split order (deterministic, no
    atomics) and cast, in one launch (torch's sum + cast were two per matrix per token); with one
    split the kernel wrote y itself. With `defer` (the caller's consumer sums them), the partials are
    returned as SplitPartials instead."""
    if target is y:
        return y
    if defer and y.is_contiguous():
        return SplitPartials(target, y)
    if not y.is_contiguous():
        y.copy_(target.sum(0))
        return y
    block = 4096 if interpreted() else 512
    _sum_splits_kernel[(triton.cdiv(y.numel(), block),)](target, y, target.shape[0], y.numel(), BLOCK=block, num_warps=4, **LAUNCH)
    return y


def code_words(base: torch.Tensor) -> torch.Tensor:
    """The code plane as int32 words (a view; planes are 4-byte aligned and whole words per row)."""
    return base.view(torch.int32) if base.dtype != torch.int32 else base


def high_plane(w) -> torch.Tensor:
    """The plane the kernel reads for bits 4-5: Q6's as int16 (two bytes per code word), Q5's as bytes."""
    if w.high is None:
        return w.base
    return w.high.view(torch.int16) if w.fmt.bits == 6 else w.high


def qgemv_int8(x: torch.Tensor, w, y: torch.Tensor, block_n: int, block_k: int, split: int, num_warps: int,
               prequant: bool = True, xq: QuantizedX | None = None, defer_sum: bool = False,
               swiglu_out: bool = False, conv: tuple | None = None):
    """y[0] = W @ x[0] for a Q4/Q5/Q6/W8 PackedLinear; `split` K-splits write float32 partials first.
    `prequant`: quantize x once in its own launch (else every program quantizes its slice); an `xq`
    already holding x's words is read instead. `defer_sum`: see finish_splits. `swiglu_out` (one split, W a
    gate/up pair [2I, K]): y [1, I] gets silu(gate) * up, the SwiGLU in the product's own launch. `conv` (one
    split) = (stack [lanes, slots, 3, C], lane [1] int on the device, weight [C, 4]): y's first C columns get the
    width-4 causal conv + SiLU over the lane's slot-0 window, which moves on a step (conv1d.causal_conv1d_lanes)."""
    if w.k_pad % (split * block_k):
        raise ValueError(f"qgemv_int8: {split} K-splits of {block_k}-lane blocks do not tile K_pad {w.k_pad}")
    if swiglu_out and (split != 1 or w.rows % 2 or block_n % 2 or y.shape[-1] != w.rows // 2):
        raise ValueError(f"qgemv_int8: SwiGLU of [{w.rows}, {w.cols}] into {tuple(y.shape)} needs one split, an even "
                         "gate/up pair and half its rows out")
    if conv is not None:
        stack, lane, weight = conv
        if split != 1 or swiglu_out or x.shape[0] != 1 or stack.shape[-2] != 3 or weight.shape[-1] != 4 \
                or stack.shape[-1] > w.rows or not (stack.is_contiguous() and weight.is_contiguous()):
            raise ValueError("qgemv_int8: the conv epilogue takes one row, one split, a width-4 conv over the "
                             "product's first columns")
        conv_args = (stack, lane, weight, stack.shape[-1], stack.shape[1])
    else:
        conv_args = (y, y, y, 0, 0)  # unread
    target = split_partials(y, split)
    prequant = prequant or xq is not None
    xin = quantize_x(x, w, xq) if prequant else x
    _qgemv_int8_kernel[(triton.cdiv(w.rows, block_n), split)](
        xin, code_words(w.base), high_plane(w), w.scale, target, w.rows, w.cols, w.k_pad // split, *conv_args,
        GPR=w.groups_per_row, K_PAD=w.k_pad, BITS=w.fmt.bits, GROUP=w.fmt.group_size,
        HIGH_BYTES=w.fmt.high_bytes_per_group, BLOCK_N=block_n, BLOCK_K=block_k, USE_ASM=native_dp4a(),
        PREQUANT=prequant, SWIGLU_OUT=swiglu_out, CONV=conv is not None, num_warps=num_warps, **LAUNCH)
    return finish_splits(target, y, defer_sum)


def quantize_x_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [K_pad] float32 -> (integer codes [K_pad] int64 in [-X_LEVELS, X_LEVELS], scale per group)."""
    xg = x.float().view(-1, group)
    amax = xg.abs().amax(1)
    scale = torch.where(amax > X_TINY, amax / X_LEVELS, torch.ones_like(amax))
    xg = torch.where(amax[:, None] > X_TINY, xg, torch.zeros_like(xg))
    return torch.round(xg / scale[:, None]).long().view(-1), scale


def qgemv_int8_reference(x: torch.Tensor, w) -> torch.Tensor:
    """The same arithmetic in plain torch: exact integer group sums, then float scales. x [T, K]."""
    if x.shape[0] != 1:
        return torch.cat([qgemv_int8_reference(x[i : i + 1], w) for i in range(x.shape[0])])
    from runtime.dequant import unpack_codes

    g = w.fmt.group_size
    xp = torch.zeros(w.k_pad, dtype=torch.float32, device=x.device)
    xp[: w.cols] = x[0].float()
    codes, x_scale = quantize_x_reference(xp, g)
    high = None if w.high is None else w.high.view(torch.uint8)
    q = unpack_codes(w.base.view(torch.uint8), high, w.rows, w.k_pad, w.fmt).long()
    sums = (q.view(w.rows, -1, g) * codes.view(1, -1, g)).sum(-1)  # exact int64 [N, groups]
    scale = w.scale.float().view(w.rows, -1).double()
    return (sums.double() * scale * x_scale.double()[None, :]).sum(1).to(x.dtype)[None, :]
