"""x [T, K] (T = 1..16 rows: one lane, several lanes, verify blocks) times a Q4/Q5 row-split matrix, with
every weight word loaded by the thread whose tensor-core fragment it fills (mma.sync m16n8k16, bf16).

Why: Triton's dot operands come from shared memory or from layout conversions whose cost grows with the
tile (~5 thread-instructions per weight re-packing bytes, bench/RESULTS.md §2), so its row kernels cost two
one-row products at any T. Here each warp owns 16 weight rows and walks K one 64-lane group (one scale) at
a time. The mma's A fragment gives thread (g = lane / 4, c = lane % 4) rows g and g + 8 and four K lanes per
16-lane step; a dot product does not care in which order K is summed, as long as A and B agree, so thread c
takes the 16 consecutive lanes [16c, 16c + 16) of the group: two 32-bit code words per row, loaded as they
lie in the artifact (no re-layout), and nibbles j and j + 4 of a word land in one bf16 pair with a shift and
one logic op (codes placed under the exponent of 128.0, the offset taken off with one packed FMA: exact
integers). x's 16 lanes are loaded the same way and paired to match with byte permutes. B's 8 columns are
rows of x, so T <= 8 costs one mma per step and T <= 16 two: the work per weight hardly grows with T.
Each group's products are exact float32 sums of bf16 products, scaled once by the group's scale.

Triton lays out tensors per element, not per thread, and an mma is warp-collective: the kernel therefore
keeps one element per thread (tensors of 32 x warps elements, the default layout), and all thread-specific
work (addresses from %tid.x, loads, unpacking, mma) happens in inline PTX. Weight words are loaded 4 groups
ahead by hand, so each thread keeps 64 bytes in flight. The PTX strings are the kernels' constexpr arguments,
chosen on the host for the format, the cache hint and the number of x columns. No interpreter path: on a CPU,
tests/ptx_warp.py runs the PTX of one warp and tests/test_frag_kernel.py holds it to `frag_reference` (the
same group sums in plain torch); GPU tests hold the kernel to it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import tuning_from_env
from .launch import LAUNCH, pdl_wait
from .qgemv_int8 import SplitPartials, finish_splits, split_partials

FRAG_BITS = (4, 5)
ROWS_PER_WARP = 16
GROUP = 64


def _nibble_pair(dst: str, word: str, j: int, bits: int, high: str | None) -> str:
    """bf16 pair (element j, element j + 4) of an 8-code word as 128 + 2^(b-1) + q (exact)."""
    src = word if j == 0 else "t"
    out = "" if j == 0 else f"shr.u32 t, {word}, {4 * j}; "
    if bits == 4:  # (n & 0xF) ^ 0x4308: the two's-complement nibble n as n ^ 8 = q + 8 under 128.0
        return out + f"lop3.b32 {dst}, {src}, 0x000F000F, 0x43084308, 0x6A; "
    # Q5: bit 4 of u (element j's high bit at bit j of `high`, element j + 4's at bit j + 16) flips 0x10
    return (out + f"shl.b32 hs, {high}, {4 - j}; lop3.b32 hx, hs, 0x00100010, 0x43104310, 0x6A; "
            f"lop3.b32 {dst}, {src}, 0x000F000F, hx, 0x6A; ")


def _q6_pair(dst: str, word: str, j: int, w: int, high: str) -> str:
    """Q6's bf16 pair (element j, element j + 4) of code word w (0 or 1) of a row as 128 + 32 + q (exact): bits 4
    and 5 of u come from `high`, which holds word 0's elements j and j + 4 at bits 2j and 16 + 2j and word 1's at
    8 + 2j and 24 + 2j (qgemm_fragment_layout's Q6 high fields), shifted to bits 4-5 and 20-21; they flip 0x20
    (u ^ 32 = q + 32)."""
    src = word if j == 0 else "t"
    out = "" if j == 0 else f"shr.u32 t, {word}, {4 * j}; "
    shift = 4 - 2 * j if w == 0 else -(4 + 2 * j)
    if shift > 0:
        out += f"shl.b32 hs, {high}, {shift}; "
    elif shift < 0:
        out += f"shr.u32 hs, {high}, {-shift}; "
    else:
        out += f"mov.b32 hs, {high}; "
    return out + (f"lop3.b32 hx, hs, 0x00300030, 0x43204320, 0x6A; "
                  f"lop3.b32 {dst}, {src}, 0x000F000F, hx, 0x6A; ")


def _field_pair(dst: str, i: int) -> str:
    """Register i's bf16 pair from a Q5 group's words in fields order (qgemm_fragment_layout._fields_of_pairs) as
    128 + u, u = code + 16 (exact): a 5-bit field of each half under 0x4300; register 15 gathers its bits from the
    halves' top bits of the 5 words."""
    if i < 15:
        word, shift = f"w{i // 3}", 5 * (i % 3)
        out = "" if shift == 0 else f"shr.u32 t, {word}, {shift}; "
        return out + f"lop3.b32 {dst}, {word if shift == 0 else 't'}, 0x001F001F, 0x43004300, 0xEA; "
    out = f"shr.u32 t, w0, 15; lop3.b32 {dst}, t, 0x00010001, 0x43004300, 0xEA; "
    for b in range(1, 5):
        out += f"shr.u32 t, w{b}, {15 - b}; lop3.b32 {dst}, t, 0x{(1 << (16 + b)) | (1 << b):08X}, {dst}, 0xEA; "
    return out


def _compute_asm(bits: int, nt: int, words: bool = False, pairs: bool = False, x_regs: bool = False,
                 fields: bool = False) -> str:
    """One 64-lane group of 16 rows (per warp) times NT x 8 columns of x: d = A.B per 16-lane step, then
    acc += scale(row) * d. Operands: $0-$7 acc out, $8-$15 acc in, then either (packed) $16/$17 code words
    of rows g / g + 8 (64-bit), $18 scales (and Q5 high bits), $19/$20 x addresses of columns g / g + 8, or
    (words: each operand one loaded register, so no instruction waits on a load before the group's turn)
    $16-$19 code words (row g's two, row g + 8's two), $20 scales of rows g / g + 8, $21 their Q5 high
    halves (unused for Q4; Q6: 64 bits, row g's 32 then row g + 8's, see _q6_pair), $22/$23 x addresses (a thread's
    16 lanes of x: two 16-byte loads). `x_regs` (words): the first column tile's x comes in loaded, $22-$29
    (_X_GROUP_ASM), instead of as an address; with two column tiles $30 is the second tile's x address.

    `pairs`: the code words hold lanes (0, 2, 4, 6, 1, 3, 5, 7) in nibbles 0-7 and the Q5 high bytes their bits
    in that order (qgemm_fragment_layout's pair order), so nibbles j and j + 4 are lanes 2j and 2j + 1: the bf16
    pair they make lines up with one register of x as loaded, and B needs no byte permutes (8 fewer instructions
    per group and column tile). `fields` (Q5, words): $16-$19 and $21 are the group's five words in fields order
    (qgemm_fragment_layout.Q5_FIELDS), each register's pair the one pair order gives it, B as in pair order."""
    if bits == 6 and not words:
        raise ValueError("_compute_asm: Q6 takes code words (fragment order)")
    if fields and (bits != 5 or not words):
        raise ValueError("_compute_asm: fields order is Q5 code words")
    pairs = pairs or fields
    offset = {4: "0xC308C308", 5: "0xC310C310", 6: "0xC320C320"}[bits]  # -(128 + 2^(b-1)) in bf16
    xg, xg8 = ("$22", "$23") if words else ("$19", "$20")
    lines = ["{ .reg .b32 w0, w1, w2, w3, w4, a0, a1, a2, a3, b0, b1, t, hs, hx, one, off, h0, h1, ha0, ha1, hb0, hb1;",
             ".reg .b32 x<16>; .reg .f32 d<8>, f0, f1; .reg .b16 s0, s1, s2, s3;"]
    if x_regs:
        if not words:
            raise ValueError("_compute_asm: x in registers takes code words")
        lines += [f"mov.b32 x{i}, ${22 + i};" for i in range(8)]
        xg8 = "$30"  # two column tiles: the second tile's x still loaded here
    else:
        lines.append(f"ld.global.nc.v4.b32 {{x0, x1, x2, x3}}, [{xg}]; "
                     f"ld.global.nc.v4.b32 {{x4, x5, x6, x7}}, [{xg}+16];")
    if nt == 2:
        lines.append(f"ld.global.nc.v4.b32 {{x8, x9, x10, x11}}, [{xg8}]; "
                     f"ld.global.nc.v4.b32 {{x12, x13, x14, x15}}, [{xg8}+16];")
    if words:
        # Q6: rows g / g + 8, 64 bits; fields: the group's fifth word
        high = "mov.b64 {h0, h1}, $21;" if bits == 6 else "mov.b32 w4, $21;" if fields else "mov.b32 {s2, s3}, $21;"
        lines.append("mov.b32 w0, $16; mov.b32 w1, $17; mov.b32 w2, $18; mov.b32 w3, $19; mov.b32 {s0, s1}, $20; "
                     + high)
    else:
        lines.append("mov.b64 {w0, w1}, $16; mov.b64 {w2, w3}, $17; mov.b64 {s0, s1, s2, s3}, $18;")
    lines += [f"mov.b32 one, 0x3F803F80; mov.b32 off, {offset};"]
    lines += [f"mov.f32 d{i}, 0f00000000;" for i in range(4 * nt)]
    if bits == 5 and not fields:  # high bits of the thread's 16 lanes per row: lanes 0-7 for word 0, 8-15 for
        # word 1, laid out so that lane j sits at bit j and lane j + 4 at bit j + 16 (see _nibble_pair; in pair order
        # the same code takes lanes 2j and 2j + 1)
        lines += ["cvt.u32.u16 h0, s2; cvt.u32.u16 h1, s3;",
                  "shl.b32 t, h0, 12; or.b32 ha0, h0, t; shr.u32 hb0, h0, 8; shl.b32 t, hb0, 12; or.b32 hb0, hb0, t;",
                  "shl.b32 t, h1, 12; or.b32 ha1, h1, t; shr.u32 hb1, h1, 8; shl.b32 t, hb1, 12; or.b32 hb1, hb1, t;"]
    for step in range(4):
        word_g, word_g8 = ("w0", "w2") if step < 2 else ("w1", "w3")
        high_g, high_g8 = ("ha0", "ha1") if step < 2 else ("hb0", "hb1")
        j = 2 * (step % 2)
        for reg, (dst, word, jj, high, row_high) in enumerate((("a0", word_g, j, high_g, "h0"),
                                                               ("a1", word_g8, j, high_g8, "h1"),
                                                               ("a2", word_g, j + 1, high_g, "h0"),
                                                               ("a3", word_g8, j + 1, high_g8, "h1"))):
            if fields:
                pair = _field_pair(dst, 4 * step + reg)
            elif bits == 6:
                pair = _q6_pair(dst, word, jj, step // 2, row_high)
            else:
                pair = _nibble_pair(dst, word, jj, bits, high)
            lines.append(pair + f"fma.rn.bf16x2 {dst}, {dst}, one, off;")
        i0, i1 = (step, step + 2) if step < 2 else (step + 2, step + 4)
        for tile in range(nt):
            d = ", ".join(f"d{4 * tile + i}" for i in range(4))
            if pairs:  # lanes 2j, 2j + 1 of step s's code pairs are x's register 2s (+ 1) as loaded
                b = f"x{2 * step + 8 * tile}, x{2 * step + 1 + 8 * tile}"
            else:
                xa, xb = f"x{i0 + 8 * tile}", f"x{i1 + 8 * tile}"
                lines.append(f"prmt.b32 b0, {xa}, {xb}, 0x5410; prmt.b32 b1, {xa}, {xb}, 0x7632;")
                b = "b0, b1"
            lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{d}}}, {{a0, a1, a2, a3}}, {{{b}}}, "
                         f"{{{d}}};")
    lines.append("cvt.f32.f16 f0, s0; cvt.f32.f16 f1, s1;")
    for i in range(8):
        if i < 4 * nt:
            lines.append(f"fma.rn.f32 ${i}, d{i}, {'f0' if i % 4 < 2 else 'f1'}, ${8 + i};")
        else:
            lines.append(f"mov.f32 ${i}, ${8 + i};")
    return " ".join(lines) + " }"


def _load_asm(bits: int, hint: str = "") -> str:
    """Prefetch one group: $0/$1 code words of rows g / g + 8 (8 bytes each), $2 the two scales (and Q5's
    high-bit halves); $3/$4 code addresses, $5/$6 scale addresses, $7/$8 high-bit addresses, $9 load or not.
    `hint`: cache qualifiers of HINTS (".L2::256B" asks L2 to fetch that much around each access: a warp
    reads 32 bytes of each of its 16 rows per group, and the next groups of a row are then L2 hits)."""
    ld = f"@p ld.global.nc{hint}"
    # a row's scales for 64 groups share one 128-byte line: cached in L1, they cost one L2 request per line
    high = f"{ld}.b16 s2, [$7]; {ld}.b16 s3, [$8];" if bits == 5 else ""
    return ("{ .reg .pred p; .reg .b32 a, b, c, d; .reg .b16 s0, s1, s2, s3; setp.ne.s32 p, $9, 0; "
            "mov.b32 a, 0; mov.b32 b, 0; mov.b32 c, 0; mov.b32 d, 0; "
            "mov.b16 s0, 0; mov.b16 s1, 0; mov.b16 s2, 0; mov.b16 s3, 0; "
            f"{ld}.v2.b32 {{a, b}}, [$3]; {ld}.v2.b32 {{c, d}}, [$4]; @p ld.global.nc.b16 s0, [$5]; "
            "@p ld.global.nc.b16 s1, [$6]; " + high +
            " mov.b64 $0, {a, b}; mov.b64 $1, {c, d}; mov.b64 $2, {s0, s1, s2, s3}; }")


HINTS = (".L1::no_allocate", ".L1::no_allocate.L2::128B", ".L1::no_allocate.L2::256B", ".L2::256B")
_COMPUTE_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 8 + ["f"] * 8 + ["l"] * 5))
_LOAD_CONSTRAINTS = tl.constexpr("=l,=l,=l,l,l,l,l,l,l,r")


@triton.jit
def _thread_ids(like):
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [like], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _load_group(wa0, wa1, sa0, sa1, ha0, ha1, gi, ok, LOAD_ASM: tl.constexpr):
    """Code words, scales (and high bits) of group gi of this thread's rows, loaded when ok (_load_asm)."""
    args = [wa0 + gi * 32, wa1 + gi * 32, sa0 + gi * 2, sa1 + gi * 2, ha0 + gi * 8, ha1 + gi * 8, ok.to(tl.int32)]
    return tl.inline_asm_elementwise(LOAD_ASM, _LOAD_CONSTRAINTS, args, dtype=(tl.int64, tl.int64, tl.int64),
                                     is_pure=False, pack=1)


@triton.jit
def _group_product(acc, slot, xa0, xa1, gi, COMPUTE_ASM: tl.constexpr):
    """acc (8 float32 per thread) + this group's contribution, from a loaded slot (_compute_asm)."""
    a0, a1, a2, a3, a4, a5, a6, a7 = acc
    w01, w23, sh = slot
    args = [a0, a1, a2, a3, a4, a5, a6, a7, w01, w23, sh, xa0 + gi * 128, xa1 + gi * 128]
    return tl.inline_asm_elementwise(COMPUTE_ASM, _COMPUTE_CONSTRAINTS, args, dtype=(tl.float32,) * 8, is_pure=False,
                                     pack=1)


@triton.jit
def _weight_addresses(base_ptr, high_ptr, scale_ptr, tid, pid, split, N, GROUPS_PER_SPLIT, GPR: tl.constexpr,
                      WARPS: tl.constexpr):
    """Byte addresses of this thread's rows g and g + 8 at the split's first group: code words, scales, Q5
    high bits. Rows past N read row N - 1 (valid memory); their results are not stored."""
    lane = tid % 32
    c = lane % 4
    row0 = pid * (16 * WARPS) + (tid // 32) * 16 + lane // 4
    r0 = tl.minimum(row0, N - 1).to(tl.int64)
    r1 = tl.minimum(row0 + 8, N - 1).to(tl.int64)
    first = split * GROUPS_PER_SPLIT
    wa0 = (base_ptr + r0 * (GPR * 32) + first * 32 + c * 8).to(tl.int64, bitcast=True)
    wa1 = (base_ptr + r1 * (GPR * 32) + first * 32 + c * 8).to(tl.int64, bitcast=True)
    sa0 = (scale_ptr + r0 * GPR + first).to(tl.int64, bitcast=True)
    sa1 = (scale_ptr + r1 * GPR + first).to(tl.int64, bitcast=True)
    ha0 = (high_ptr + r0 * (GPR * 8) + first * 8 + c * 2).to(tl.int64, bitcast=True)
    ha1 = (high_ptr + r1 * (GPR * 8) + first * 8 + c * 2).to(tl.int64, bitcast=True)
    return wa0, wa1, sa0, sa1, ha0, ha1


@triton.jit
def _qgemm_rows_frag_kernel(x_ptr, base_ptr, high_ptr, scale_ptr, out_ptr, N, T, K, GROUPS_PER_SPLIT,
                            GPR: tl.constexpr, NT: tl.constexpr, WARPS: tl.constexpr, LOAD_ASM: tl.constexpr,
                            COMPUTE_ASM: tl.constexpr):
    """One program: 16 x WARPS weight rows, one K-split of GROUPS_PER_SPLIT groups (a multiple of 4, the groups
    each thread keeps in flight; 8 were no faster on the H200); LOAD_ASM / COMPUTE_ASM: the PTX of _load_asm /
    _compute_asm for the format, cache hint and columns; out is [T, N] (one split: y itself) or this split's float32 partials."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    zero = tl.zeros([32 * WARPS], tl.int32)
    tid = _thread_ids(zero)
    wa0, wa1, sa0, sa1, ha0, ha1 = _weight_addresses(base_ptr, high_ptr, scale_ptr, tid, pid, split, N,
                                                     GROUPS_PER_SPLIT, GPR, WARPS)
    # weights are never written during inference: the first groups are fetched before waiting on x's writer
    s0 = _load_group(wa0, wa1, sa0, sa1, ha0, ha1, 0, zero == 0, LOAD_ASM)
    s1 = _load_group(wa0, wa1, sa0, sa1, ha0, ha1, 1, zero + 1 < GROUPS_PER_SPLIT, LOAD_ASM)
    s2 = _load_group(wa0, wa1, sa0, sa1, ha0, ha1, 2, zero + 2 < GROUPS_PER_SPLIT, LOAD_ASM)
    s3 = _load_group(wa0, wa1, sa0, sa1, ha0, ha1, 3, zero + 3 < GROUPS_PER_SPLIT, LOAD_ASM)
    pdl_wait()
    lane = tid % 32
    g = lane // 4
    c = lane % 4
    row0 = pid * (16 * WARPS) + (tid // 32) * 16 + g
    lane16 = (split * GROUPS_PER_SPLIT * 64 + c * 16).to(tl.int64)
    xr0 = tl.minimum(g, T - 1).to(tl.int64)
    xr1 = tl.minimum(g + 8, T - 1).to(tl.int64)
    xa0 = (x_ptr + xr0 * K + lane16).to(tl.int64, bitcast=True)
    xa1 = (x_ptr + xr1 * K + lane16).to(tl.int64, bitcast=True)
    f = tl.zeros([32 * WARPS], tl.float32)
    acc = (f, f, f, f, f, f, f, f)
    for gi in range(0, GROUPS_PER_SPLIT, 4):  # slot j holds group gi + j, then fetches gi + j + 4
        acc = _group_product(acc, s0, xa0, xa1, gi, COMPUTE_ASM)
        s0 = _load_group(wa0, wa1, sa0, sa1, ha0, ha1, gi + 4, zero + gi + 4 < GROUPS_PER_SPLIT, LOAD_ASM)
        acc = _group_product(acc, s1, xa0, xa1, gi + 1, COMPUTE_ASM)
        s1 = _load_group(wa0, wa1, sa0, sa1, ha0, ha1, gi + 5, zero + gi + 5 < GROUPS_PER_SPLIT, LOAD_ASM)
        acc = _group_product(acc, s2, xa0, xa1, gi + 2, COMPUTE_ASM)
        s2 = _load_group(wa0, wa1, sa0, sa1, ha0, ha1, gi + 6, zero + gi + 6 < GROUPS_PER_SPLIT, LOAD_ASM)
        acc = _group_product(acc, s3, xa0, xa1, gi + 3, COMPUTE_ASM)
        s3 = _load_group(wa0, wa1, sa0, sa1, ha0, ha1, gi + 7, zero + gi + 7 < GROUPS_PER_SPLIT, LOAD_ASM)
    _store_rows(out_ptr, acc, split, T, N, row0, c, NT)


@triton.jit
def _store_rows(out_ptr, acc, split, T, N, row0, c, NT: tl.constexpr):
    """Accumulator i of a thread is row row0 + 8 * ((i % 4) // 2), column 2c + i % 2 + 8 * (i // 4): stored to
    this split's [T, N] (rows < N, columns < T)."""
    out_base = out_ptr + split * T * N
    a0, a1, a2, a3, a4, a5, a6, a7 = acc
    ty = out_ptr.dtype.element_ty
    n0 = 2 * c
    ok0 = row0 < N
    ok1 = row0 + 8 < N
    tl.store(out_base + n0 * N + row0, a0.to(ty), mask=ok0 & (n0 < T))
    tl.store(out_base + (n0 + 1) * N + row0, a1.to(ty), mask=ok0 & (n0 + 1 < T))
    tl.store(out_base + n0 * N + row0 + 8, a2.to(ty), mask=ok1 & (n0 < T))
    tl.store(out_base + (n0 + 1) * N + row0 + 8, a3.to(ty), mask=ok1 & (n0 + 1 < T))
    if NT == 2:
        tl.store(out_base + (n0 + 8) * N + row0, a4.to(ty), mask=ok0 & (n0 + 8 < T))
        tl.store(out_base + (n0 + 9) * N + row0, a5.to(ty), mask=ok0 & (n0 + 9 < T))
        tl.store(out_base + (n0 + 8) * N + row0 + 8, a6.to(ty), mask=ok1 & (n0 + 8 < T))
        tl.store(out_base + (n0 + 9) * N + row0 + 8, a7.to(ty), mask=ok1 & (n0 + 9 < T))


def aligned_rows(x: torch.Tensor) -> torch.Tensor:
    """x contiguous and 16-byte aligned: the PTX loads x's lanes 16 bytes at a time (a view at an odd offset
    into a larger buffer would fault with a misaligned address)."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def frag_supported(w, t: int) -> bool:
    """Whether the fragment kernel takes this product: Q4/Q5 in groups of 64 lanes, K a multiple of 256 (whole
    groups, four per loop step), 1..16 rows of x."""
    return w.fmt.bits in FRAG_BITS and w.fmt.group_size == GROUP and w.cols % (4 * GROUP) == 0 and 1 <= t <= 16


def frag_splits(rows: int, groups: int, warps: int, programs: int) -> int:
    """K-splits (each a multiple of 4 groups, the loop's step, and >= 8 groups) so that row blocks x splits
    stay within `programs`."""
    blocks = triton.cdiv(rows, ROWS_PER_WARP * warps)
    best = 1
    for split in range(2, groups // 8 + 1):
        if groups % (4 * split) == 0 and blocks * split <= programs:
            best = split
    return best


# best total over the 27B's Q4/Q5 products at T = 8 in the H200 sweep (bench/RESULTS.md §2): L2 fetching 256 bytes
# per weight access, 4 warps, ~528 programs
# side-by-side runs: NINFER_FRAG_TILE=hint,warps,programs
FRAG_TUNING = tuning_from_env("NINFER_FRAG_TILE", ("hint", "warps", "programs"), {"warps": 4, "programs": 528, "hint": 2})


def qgemm_rows_frag(x: torch.Tensor, w, y: torch.Tensor, warps: int | None = None, programs: int | None = None,
                    defer_sum: bool = False, hint: int | None = None) -> torch.Tensor | SplitPartials:
    """y [T, N] = x [T, K] @ W^T (bf16 x, T <= 16) through the fragment kernel (GPU only)."""
    t, k = x.shape
    if not frag_supported(w, t) or x.dtype != torch.bfloat16:
        raise ValueError(f"qgemm_rows_frag: {w.fmt.name} [{w.rows}, {w.cols}] with {t} rows of {x.dtype} is not "
                         "supported (Q4/Q5, K a multiple of 64, 1-16 bf16 rows)")
    x = aligned_rows(x)
    warps, programs = warps or FRAG_TUNING["warps"], programs or FRAG_TUNING["programs"]
    hint = FRAG_TUNING["hint"] if hint is None else hint
    groups = k // GROUP
    split = frag_splits(w.rows, groups, warps, programs)
    nt = 1 if t <= 8 else 2
    target = split_partials(y, split)
    high = w.high if w.high is not None else w.base
    grid = (triton.cdiv(w.rows, ROWS_PER_WARP * warps), split)
    _qgemm_rows_frag_kernel[grid](x, w.base, high, w.scale, target, w.rows, t, k, groups // split,
                                  GPR=w.groups_per_row, NT=nt, WARPS=warps, LOAD_ASM=_load_asm(w.fmt.bits, HINTS[hint]),
                                  COMPUTE_ASM=_compute_asm(w.fmt.bits, nt),
                                  num_warps=warps, **LAUNCH)
    return finish_splits(target, y, defer_sum)


def frag_reference(x: torch.Tensor, w) -> torch.Tensor:
    """What the kernel computes, in plain torch: per 64-lane group the exact float32 sum of bf16 products of
    the integer codes and x, times the group's scale, summed over groups. [T, N] float32."""
    from runtime.dequant import unpack_codes

    codes = unpack_codes(w.base.view(torch.uint8), None if w.high is None else w.high.view(torch.uint8), w.rows,
                         w.k_pad, w.fmt)
    groups = w.cols // GROUP
    xb = x.to(torch.bfloat16).float().view(x.shape[0], groups, GROUP)
    codes = codes.view(w.rows, -1, GROUP)[:, :groups].double()
    sums = torch.einsum("tgk,ngk->tng", xb.double(), codes).float()
    scales = w.scale.view(w.rows, -1)[:, :groups].float()
    return (sums * scales[None]).sum(-1)
