"""The fragment-order product on int8 tensor cores (Q4/Q5/W8, T = 1..16 rows of x): codes as unsigned bytes (W8:
its signed bytes as stored), x as the dp4a words its producer wrote (14-bit integers split into a high and a low
signed byte, see qgemv_int8), mma.sync m16n8k32 u8 (W8: s8) x s8 -> s32.

Why: the bf16 fragment kernel (qgemm_fragment_layout) spends 44 of its 66 SASS instructions per 16-row group
turning nibble pairs into bf16 pairs (a logic op, a packed FMA and most of a shift per pair), and a Q5 product
another 46 on its fifth bits (`python bench/sass_count.py q4|q5`): the products are issue-bound, Q5's worst.
Bytes are cheaper: the even lanes of a code word are its low nibbles and the odd lanes its high nibbles (one
logic op, or a shift and one, for four codes), and the dp4a words hold x's even and odd lanes of that word in
the same byte order, so B is x's words as loaded. A group's 32 Q5 high bits of a thread lie in "byte order"
(qgemm_fragment_layout.high_to_byte_order): a shift and one logic op put four of them at bit 4 of their
bytes. The integer group sums are exact; each is offset (codes enter as q + 2^(b-1), the offset comes back as
2^(b-1) times x's integer group sum, the mma's starting value) and scaled once by both scales: the dp4a GEMV's
arithmetic, its sums taken in another order.

Thread (g = lane / 4, c = lane % 4) holds code words 2c and 2c + 1 of rows g and g + 8 of each group (the
fragment order of qgemm_fragment_layout, lane order inside words); per group two k = 32 steps (the even lanes
of both words, then the odd lanes), each an mma with x's high bytes and one with its low bytes, B a pair of
words one load brings (hi_a 2c, 2c + 1; then hi_b). B's column g is x row g (g + 8 for the
second column tile): its words 2c, 2c + 1 of hi_a, hi_b, lo_a, lo_b; the accumulators' columns 2c, 2c + 1 take
those rows' group scales and sums.

W8 (32-lane groups, a row's group 32 bytes as a Q4 group's, so the same fragment order, loads and program): the
thread's words 2c, 2c + 1 of rows g and g + 8 are A of one k = 32 step as stored (k 4c.. the word 2c, k 16 + 4c..
the word 2c + 1); x's dp4a words for 8-bit codes hold every lane in order, so B is x's words 2c, 2c + 1 of the
group, one 8-byte load for the high bytes and one for the low. No offset: the codes are signed, the mma s8 x s8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import LAUNCH, pdl_wait
from .qgemm_fragment_layout import (CHUNK, FRAGMENT_TUNING, W8_BITS, _chunk_load_asm, _load_chunk, _program_start,
                                    _store_program, fragment_shape)
from .qgemm_rows_frag import HINTS, SplitPartials, finish_splits, split_partials
from .qgemv_int8 import QuantizedX, _lanes, quantize_x

_MMA = "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32"
_MMA_W8 = "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32"


def _code_bytes(dst: str, word: str, odd: bool, bits: int, shift: int | None) -> str:
    """Four unsigned code bytes u = q + 2^(b-1) of a code word: its even lanes (low nibbles) or odd lanes (high
    nibbles). Q5: `shift` moves the byte-order high bits of this output to bit 4 of each byte (positive: left)."""
    src = word
    out = ""
    if odd:
        out, src = f"shr.u32 t, {word}, 4; ", "t"
    if bits == 4:  # (n & 0xF) ^ 8: the two's-complement nibble as n + 8
        return out + f"lop3.b32 {dst}, {src}, 0x0F0F0F0F, 0x08080808, 0x6A; "
    moved = "hw" if shift == 0 else "hm"
    if shift:
        out += f"{'shl' if shift > 0 else 'shr'}.b32 hm, hw, {abs(shift)}; "
    # (~h & 0x10) per byte: the fifth bit flipped (u = q + 16); then the nibbles under it: (n & 0xF) | that
    return out + f"lop3.b32 hm, {moved}, 0x10101010, 0, 0x0C; lop3.b32 {dst}, {src}, 0x0F0F0F0F, hm, 0xEA; "


def _scaled_sums(tile: int, j: int) -> str:
    """Group j's integer sums of column tile `tile` (x's high-byte sums h, low-byte sums l) into the accumulators:
    (h * 128 + l) times the row's group scale (ws0 rows g, ws1 rows g + 8) and x's (its column's, group j); the
    first group of a chunk adds to the accumulators coming in ($8-$15), the rest to the ones going out."""
    lines = []
    for i in range(4):
        acc = 4 * tile + i
        ws, xs = ("ws0" if i < 2 else "ws1"), f"xs{4 * (2 * tile + i % 2) + j}"
        into = f"${8 + acc}" if j == 0 else f"${acc}"
        lines.append(f"mad.lo.s32 h{acc}, h{acc}, 128, l{acc}; cvt.rn.f32.s32 f, h{acc}; "
                     f"mul.f32 c, {ws}, {xs}; fma.rn.f32 ${acc}, f, c, {into};")
    return " ".join(lines)


def _w8_chunk_asm(nt: int, rw_bytes: int) -> str:
    """_int8_chunk_asm's operands for W8: four 32-lane groups (a chunk) of 16 rows times NT x 8 columns of x; code
    words $16-$31 (group j's at 16 + 4j: row g's words 2c, 2c + 1, then row g + 8's), $32-$35 group j's row scales,
    $36-$39 unused, $40/$41 x's hi words of B's columns g / g + 8 at the chunk's word 2c (lo `rw_bytes` on, a
    group 32 bytes on), $42-$45 the chunk's 4 group scales of x rows 2c, 2c + 1, 2c + 8, 2c + 9."""
    cols = 2 * nt
    lines = ["{ .reg .b32 xh<4>, xl<4>, z; .reg .s32 h<8>, l<8>; .reg .f32 xs<16>, ws0, ws1, f, c; "
             ".reg .b16 sg0, sg1;", "mov.b32 z, 0;"]
    for col in range(cols):
        q = ", ".join(f"xs{4 * col + j}" for j in range(4))
        lines.append(f"ld.global.nc.v4.f32 {{{q}}}, [$4{2 + col}];")
    for j in range(4):
        first = 16 + 4 * j
        frag = f"{{${first}, ${first + 2}, ${first + 1}, ${first + 3}}}"  # k 4c.. rows g, g + 8; k 16 + 4c.. alike
        lines.append(f"mov.b32 {{sg0, sg1}}, ${32 + j}; cvt.f32.f16 ws0, sg0; cvt.f32.f16 ws1, sg1;")
        for tile in range(nt):
            a, b = 2 * tile, 2 * tile + 1
            addr, at = f"$4{tile}", 32 * j
            h = ", ".join(f"h{4 * tile + i}" for i in range(4))
            lo = ", ".join(f"l{4 * tile + i}" for i in range(4))
            lines.append(f"ld.global.nc.v2.b32 {{xh{a}, xh{b}}}, [{addr}+{at}]; "
                         f"ld.global.nc.v2.b32 {{xl{a}, xl{b}}}, [{addr}+{at + rw_bytes}];")
            lines.append(f"{_MMA_W8} {{{h}}}, {frag}, {{xh{a}, xh{b}}}, {{z, z, z, z}}; "
                         f"{_MMA_W8} {{{lo}}}, {frag}, {{xl{a}, xl{b}}}, {{z, z, z, z}};")
            lines.append(_scaled_sums(tile, j))
    lines += [f"mov.f32 ${i}, ${8 + i};" for i in range(4 * nt, 8)]
    return " ".join(lines) + " }"


def _int8_chunk_asm(bits: int, nt: int, rw_bytes: int, gpr_bytes: int) -> str:
    """Four 64-lane groups (a chunk) of 16 rows (per warp) times NT x 8 columns of x. Operands: $0-$7 acc out,
    $8-$15 acc in, $16-$31 code words (group j's at 16 + 4j: row g's words 2c, 2c + 1, then row g + 8's), $32-$35
    group j's row scales (two halves), $36-$39 its Q5 high bits in byte order (unused for Q4), $40/$41 the x words
    of B's columns g / g + 8 at the chunk's first group, hi_a word 2c (lo_a, hi_b, lo_b `rw_bytes` apart, a group
    32 bytes on), $42-$45 the chunk's 4 group scales of x rows 2c, 2c + 1, 2c + 8, 2c + 9 (their integer sums
    `gpr_bytes` after). Addresses advance once per chunk; within it the groups are immediate offsets."""
    off = 1 << (bits - 1)
    cols = 2 * nt
    lines = ["{ .reg .b32 e<4>, o<4>, t, z, hw, hm, xh<8>, xl<8>; .reg .s32 h<8>, l<8>, k<4>, xsum<16>;",
             ".reg .f32 xs<16>, ws0, ws1, f, c; .reg .b16 sg0, sg1;", "mov.b32 z, 0;"]
    for col in range(cols):  # x scales and integer sums of the accumulators' columns, 4 groups each
        q = ", ".join(f"xs{4 * col + j}" for j in range(4))
        qs = ", ".join(f"xsum{4 * col + j}" for j in range(4))
        lines.append(f"ld.global.nc.v4.f32 {{{q}}}, [$4{2 + col}]; ld.global.nc.v4.s32 {{{qs}}}, [$4{2 + col}+{gpr_bytes}];")
    for j in range(4):
        first = 16 + 4 * j
        for tile in range(nt):
            a, b = 2 * tile, 2 * tile + 1  # hi_a words 2c / 2c + 1 in xh<a> / xh<b>, hi_b in xh<a + 4> / .., lo alike
            addr, at = f"$4{tile}", 32 * j
            lines.append(f"ld.global.nc.v2.b32 {{xh{a}, xh{b}}}, [{addr}+{at}]; "
                         f"ld.global.nc.v2.b32 {{xl{a}, xl{b}}}, [{addr}+{at + rw_bytes}]; "
                         f"ld.global.nc.v2.b32 {{xh{a + 4}, xh{b + 4}}}, [{addr}+{at + 2 * rw_bytes}]; "
                         f"ld.global.nc.v2.b32 {{xl{a + 4}, xl{b + 4}}}, [{addr}+{at + 3 * rw_bytes}];")
        lines.append(f"mov.b32 hw, ${36 + j};")
        # outputs e/o 0-3: rows (g, g + 8) x words (2c, 2c + 1); the Q5 bits of output (row r, word w, parity p)
        # at 8i + 4r + 2w + p of the byte-order word
        for n in range(4):
            row, w = n // 2, n % 2
            for odd, dst in ((False, f"e{n}"), (True, f"o{n}")):
                lines.append(_code_bytes(dst, f"${first + n}", odd, bits, 4 - (4 * row + 2 * w + int(odd))))
        lines.append(f"mov.b32 {{sg0, sg1}}, ${32 + j}; cvt.f32.f16 ws0, sg0; cvt.f32.f16 ws1, sg1;")
        for tile in range(nt):
            h = ", ".join(f"h{4 * tile + i}" for i in range(4))
            lo = ", ".join(f"l{4 * tile + i}" for i in range(4))
            k0, k1 = f"k{2 * tile}", f"k{2 * tile + 1}"
            lines.append(f"mul.lo.s32 {k0}, xsum{4 * (2 * tile) + j}, {-off}; "
                         f"mul.lo.s32 {k1}, xsum{4 * (2 * tile + 1) + j}, {-off};")
            for step, parity in enumerate("eo"):  # even lanes of both words, then odd: B is one loaded pair
                frag = f"{{{parity}0, {parity}2, {parity}1, {parity}3}}"
                xa = 2 * tile + 4 * step
                start_h = "{z, z, z, z}" if step == 0 else f"{{{h}}}"
                start_l = f"{{{k0}, {k1}, {k0}, {k1}}}" if step == 0 else f"{{{lo}}}"
                lines.append(f"{_MMA} {{{h}}}, {frag}, {{xh{xa}, xh{xa + 1}}}, {start_h}; "
                             f"{_MMA} {{{lo}}}, {frag}, {{xl{xa}, xl{xa + 1}}}, {start_l};")
            lines.append(_scaled_sums(tile, j))
    lines += [f"mov.f32 ${i}, ${8 + i};" for i in range(4 * nt, 8)]
    return " ".join(lines) + " }"


_CHUNK_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 8 + ["f"] * 8 + ["r"] * 24 + ["l"] * 6))


@triton.jit
def _int8_chunk(acc, chunk, xw0, xw1, xs0, xs1, xs2, xs3, ci, COMPUTE_ASM: tl.constexpr):
    """acc + one chunk's contribution (_int8_chunk_asm); x's words advance 128 bytes per chunk, its scales 16."""
    a0, a1, a2, a3, a4, a5, a6, a7 = acc
    (c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, s0, s1, s2, s3, h0, h1, h2, h3) = chunk
    args = [a0, a1, a2, a3, a4, a5, a6, a7, c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15,
            s0, s1, s2, s3, h0, h1, h2, h3, xw0 + ci * 128, xw1 + ci * 128, xs0 + ci * 16, xs1 + ci * 16,
            xs2 + ci * 16, xs3 + ci * 16]
    return tl.inline_asm_elementwise(COMPUTE_ASM, _CHUNK_CONSTRAINTS, args, dtype=(tl.float32,) * 8, is_pure=False,
                                     pack=1)


@triton.jit
def _x_row(xq_ptr, row, T, ROW_BYTES: tl.constexpr):
    return xq_ptr + tl.minimum(row, T - 1).to(tl.int64) * ROW_BYTES


@triton.jit
def _qgemm_fragment_int8_kernel(xq_ptr, codes_ptr, high_ptr, scales_ptr, out_ptr, N, T, BLOCKS, CHUNKS_PER_SPLIT,
                                G: tl.constexpr, NT: tl.constexpr, BW: tl.constexpr, KS: tl.constexpr,
                                BITS: tl.constexpr, ROW_BYTES: tl.constexpr, SCALES_AT: tl.constexpr,
                                LOAD_ASM: tl.constexpr, COMPUTE_ASM: tl.constexpr):
    """qgemm_fragment_layout's program shape (BW 16-row blocks, a K-split shared by KS warps per block, summed in
    the program) over x's dp4a words (xq_ptr: bytes, ROW_BYTES per row of x; group scales at SCALES_AT)."""
    pid, split, zero, lane, ca, sa, ha, first, count, c0, c1 = _program_start(
        codes_ptr, scales_ptr, high_ptr, BLOCKS, CHUNKS_PER_SPLIT, G, BW, KS, BITS, LOAD_ASM, False)
    pdl_wait()
    g, c = lane // 4, lane % 4
    xq = xq_ptr.to(tl.pointer_type(tl.int8))
    xw0 = (_x_row(xq, g, T, ROW_BYTES) + c * 8).to(tl.int64, bitcast=True)
    xw1 = (_x_row(xq, g + 8, T, ROW_BYTES) + c * 8).to(tl.int64, bitcast=True)
    xs0 = (_x_row(xq, 2 * c, T, ROW_BYTES) + SCALES_AT).to(tl.int64, bitcast=True)
    xs1 = (_x_row(xq, 2 * c + 1, T, ROW_BYTES) + SCALES_AT).to(tl.int64, bitcast=True)
    xs2 = (_x_row(xq, 2 * c + 8, T, ROW_BYTES) + SCALES_AT).to(tl.int64, bitcast=True)
    xs3 = (_x_row(xq, 2 * c + 9, T, ROW_BYTES) + SCALES_AT).to(tl.int64, bitcast=True)
    f = tl.zeros([32 * BW * KS], tl.float32)
    acc = (f, f, f, f, f, f, f, f)
    for ci in range(0, CHUNKS_PER_SPLIT // KS, 2):  # chunks past a warp's count are zeros, x read in bounds
        acc = _int8_chunk(acc, c0, xw0, xw1, xs0, xs1, xs2, xs3, tl.minimum(first + ci, G // 4 - 1), COMPUTE_ASM)
        c0 = _load_chunk(ca, sa, ha, ci + 2, zero + ci + 2 < count, BITS, LOAD_ASM)
        acc = _int8_chunk(acc, c1, xw0, xw1, xs0, xs1, xs2, xs3, tl.minimum(first + ci + 1, G // 4 - 1), COMPUTE_ASM)
        c1 = _load_chunk(ca, sa, ha, ci + 3, zero + ci + 3 < count, BITS, LOAD_ASM)
    _store_program(out_ptr, acc, pid, split, T, N, BW, KS, NT)


def qgemm_fragment_int8(x: torch.Tensor, w, y: torch.Tensor, xq: QuantizedX | None = None, warps: int | None = None,
                        programs: int | None = None, hint: int | None = None, defer_sum: bool = False,
                        ksplit: int | None = None) -> torch.Tensor | SplitPartials:
    """y [T, N] = x [T, K] @ W^T for a PackedLinear whose planes are in fragment order, byte order (Q4/Q5/W8,
    T = 1..16);
    x as dp4a words: `xq` when its producer wrote them, else quantized here (a launch). GPU only (inline PTX)."""
    fp = w.fragment
    t, k = x.shape
    if fp is None or fp.order != "bytes" or not 1 <= t <= 16 or k != fp.cols:
        raise ValueError(f"qgemm_fragment_int8: {t} rows of {k} columns against [{w.rows}, {w.cols}] "
                         f"(planes in fragment {'order' if fp is None else fp.order}): needs 1-16 rows and byte order")
    words = quantize_x(x, w, xq)
    warps = warps or FRAGMENT_TUNING["warps"]
    programs = programs or FRAGMENT_TUNING["programs"]
    hint = FRAGMENT_TUNING["hint"] if hint is None else hint
    ksplit = FRAGMENT_TUNING["ksplit"] if ksplit is None else ksplit
    if not ksplit and defer_sum:  # partials the next rmsnorm sums: K split across programs only
        ksplit = 1
    if not ksplit and fp.fmt.bits == W8_BITS:
        # W8: 4 warps sharing each block's K at least ties fragment_shape's loop on every product measured (H100,
        # session 36, `bench/gemv_compare.py OUT w8`: DFlash2 gate_up 34816 x 5120 at T = 1 / 4 / 8 / 16 0.85 / 0.82
        # / 0.78 / 0.39 -> 1.00 / 0.94 / 0.85 / 0.53 of copy; the loop already picks 4 for MLP down, MTP fc)
        ksplit = 4
    bw, ks, split, size = fragment_shape(fp.blocks, fp.groups // CHUNK, warps, programs, ksplit)
    nt = 1 if t <= 8 else 2
    rw_bytes = w.k_pad // _lanes(fp.fmt.bits) * 4  # one of hi_a / lo_a / hi_b / lo_b (write_quantized_x)
    compute = _w8_chunk_asm(nt, rw_bytes) if fp.fmt.bits == W8_BITS else _int8_chunk_asm(fp.fmt.bits, nt, rw_bytes,
                                                                                     fp.groups * 4)
    target = split_partials(y, split)
    high = fp.high if fp.high is not None else fp.codes
    _qgemm_fragment_int8_kernel[(triton.cdiv(fp.blocks, bw), split)](
        words, fp.codes, high, fp.scales, target, fp.rows, t, fp.blocks, size, G=fp.groups, NT=nt, BW=bw, KS=ks,
        BITS=fp.fmt.bits, ROW_BYTES=words.shape[1] * 4, SCALES_AT=4 * rw_bytes,
        LOAD_ASM=_chunk_load_asm(fp.fmt.bits, HINTS[hint]),
        COMPUTE_ASM=compute, num_warps=bw * ks, **LAUNCH)
    return finish_splits(target, y, defer_sum)


def fragment_int8_reference(x: torch.Tensor, w) -> torch.Tensor:
    """What the kernel computes, in plain torch: the dp4a GEMV's integer group sums (x rounded to 14 bits per
    group) times both scales, summed over groups in float64. [T, N] float32."""
    from .qgemv_int8 import qgemv_int8_reference

    return qgemv_int8_reference(x.float(), w).float()  # (in x's dtype it would come back rounded to bf16)
