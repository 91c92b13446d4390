"""Decode attention over compressed KV (int4 and int8 group-64 codes, e8cube keys: rk4v4, rk4v4-e8, rk8v4, int8,
rk2v4-e8; head dim 256) with every code word loaded by the thread whose tensor-core fragment it fills.

Why: paged_attention.py decodes K and V tiles to fp16 tensors and hands them to tl.dot, whose operand layouts
Triton reaches through shared memory or register shuffles; at 200K context its rk4v4-e8 attention ran at ~0.3 of
copy bandwidth, ALU-bound (bench/RESULTS.md §1), so the codec that reads 3.7x fewer bytes than bf16 decoded slower.
Here the fragments are built where the codes land (the technique of qgemm_rows_frag.py): 3.1-4.2x fewer
instructions per key by their sm_90 SASS (bench/sass_count.py).

One warp owns one split of a (lane, kv head)'s keys and 8 of its query rows, and walks the split a page (64 keys)
at a time:

- Scores S^T = K Q^T: 16 keys are mma.sync m16n8k16's A rows and 8 query rows its B columns (a 6- or 8-head GQA
  group at T = 1; more rows take a warp per 8, each reading the same keys). Thread (g, c) = (lane / 4, lane % 4)
  reads keys g and g + 8, its share of each 64-element group (int4: bytes 8c .. 8c + 7; int8: 16c ..; e8cube: the
  two 8-vectors 2c, 2c + 1, decoded into int4's nibble order). A dot product does not care in which order the
  dims are summed as long as A and B agree, so the codes fill the thread's A slots in the order one logic op per
  register places them, and Q's B fragments hold the matching dims. Codes become fp16 subnormals, (n + 8) 2^-24
  (int4; high nibbles 16x, their queries / 16) or (b + 128) 2^-24 (int8), exact; what the offsets contribute is
  the same mma over a zero code's pattern, taken off once per group before its keys' scales multiply (float32).
- Softmax over the page in the log2 domain: per query column a thread holds 2 x 4 scores; max and sum cross the
  8 threads of a column with butterfly shuffles.
- Values O^T = V^T P^T: 16 output dims are A's rows and the 16 keys of a step its k. Thread (g, c) needs keys
  2c, 2c + 1, 2c + 8, 2c + 9 of dims it chooses (int4: the 4 bytes 4g .. of each group; int8: the 8 bytes 8g ..);
  one byte permute pairs two keys' bytes and one logic op per A register places a code of each. P's B fragment
  is the scores' C fragment transposed in registers (movmatrix), times each key's group scale (fp16); the
  offsets' share is a second mma over a constant A, taken off at the end.

Each warp writes its split's (m, l) and un-normalized output as paged_attention's partials (natural-log units),
and paged_attention's combine launch merges the splits (and applies the output gate when given one). The PTX
strings are constexpr arguments built here per pool geometry; on a CPU, Triton's interpreter runs the kernel with
the PTX emulated warp by warp (tests/ptx_warp.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from runtime.kv.codecs import Codec

from ..switches import setting
from . import tuning_from_env
from .launch import LAUNCH, pdl_wait
from .paged_attention import MIN_SPLIT, PAGE, _split_len, combine_splits, split_size
from .qgemm_rows_frag import _thread_ids

KEY_KINDS = ("int4g64", "int4g64e8", "int8g64", "e8cube")  # int4g64e8: int4g64's codes, chosen otherwise
VALUE_KINDS = ("int4g64", "int8g64")
HEAD_DIM = 256
COLUMNS = tl.constexpr(8)  # query rows per warp: the mma's 8 B columns (more rows: a warp per 8 on the same keys)
MAX_ROWS = 64  # query rows per (lane, kv head): 8 column tiles (DFlash2's 8-row verify block of an 8-head group)
TILE = 64  # keys per softmax step: one page, 4 mma k-steps of 16
LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)
# auto: on a GPU for the codecs and shapes it takes (H100, 27B at 200K: rk4v4-e8 92.8 -> 112.0 tok/s, int8 81.7 ->
# 112.6, rk2v4-e8 69.6 -> 103.3, side by side; bench/RESULTS.md §1); on: also under the interpreter (tests, with
# its PTX emulated); off: the tl.dot kernel
# Warps per program (consecutive warps: the column tiles and kv heads of one split, so a program reads whole token
# rows), the warps aimed at over the grid (~8 per SM are resident at ~250 registers) and the code loads' cache hint
FRAG_ATTENTION = tuning_from_env("NINFER_ATTENTION_FRAG_TILE", ("warps", "splits", "hint"),  # side-by-side runs
                                 {"mode": setting("NINFER_ATTENTION_FRAG"), "warps": 4, "splits": 1024,
                                  "hint": 2})

_LOW = "0x000F000F, 0x00080008, 0x6a"  # (w & mask) ^ 8: low nibble n as the fp16 subnormal (n + 8) 2^-24
_HIGH = "0x00F000F0, 0x00800080, 0x6a"  # high nibble as 16 (n + 8) 2^-24
_BYTE = "0x00FF00FF, 0x00800080, 0x6a"  # (w & mask) ^ 0x80: bytes 0 and 2, b as (b + 128) 2^-24
_ZERO_LOW, _ZERO_HIGH = "0x00080008", "0x00800080"  # the same of a zero code (n = 0): the offsets taken off
_ZERO_BYTE = "0x00800080"
UNIT = tl.constexpr(2.0 ** 24)  # codes reach the mma in units of 2^-24
_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"
HINTS = ("", ".L2::128B", ".L2::256B", ".L1::no_allocate.L2::256B")  # on the code loads (a page's rows: all heads)
# The pool is written every step (the KV append before this launch), so its loads are plain ld.global, as the
# tl.dot kernel's are, not the read-only path the weight kernels use.


def _nibbles(out: list[str], word: str) -> str:
    """A code word's 8 nibbles as 4 exact fp16 pairs, (j, j + 4) for j = 0..3: one logic op each, no offset taken
    off (the products' offsets are summed apart and subtracted once)."""
    return (f"shr.b32 t, {word}, 8; lop3.b32 {out[0]}, {word}, {_LOW}; lop3.b32 {out[1]}, {word}, {_HIGH}; "
            f"lop3.b32 {out[2]}, t, {_LOW}; lop3.b32 {out[3]}, t, {_HIGH}; ")


def _bytes(out: list[str], word: str) -> str:
    """A code word's 4 int8 codes as 2 exact fp16 pairs: bytes (0, 2), then (1, 3)."""
    return f"shr.b32 t, {word}, 8; lop3.b32 {out[0]}, {word}, {_BYTE}; lop3.b32 {out[1]}, t, {_BYTE}; "


def _spread(reg: str) -> str:
    """Bit i of an 8-bit value to bit 4i (three shift-and-merge steps)."""
    return (f"shl.b32 zt, {reg}, 12; lop3.b32 {reg}, {reg}, zt, 0x000F000F, 0xA8; "
            f"shl.b32 zt, {reg}, 6; lop3.b32 {reg}, {reg}, zt, 0x03030303, 0xA8; "
            f"shl.b32 zt, {reg}, 3; lop3.b32 {reg}, {reg}, zt, 0x11111111, 0xA8; ")


def _e8_vector(out: str, word: str, half: int) -> str:
    """The e8cube 8-vector in bytes 2 half (magnitudes) and 2 half + 1 (signs, bit 7 the shift) of `word` as an
    int4-like word (nibble i = element i, two's complement of q, 4 v = q odd in [-7, 7]; specs/kv-codecs.md §4.2):
    q + 8 = 8 (not negative) + 4 (magnitude xor negative) + 2 (not shifted down) + 1, element 7's sign the parity
    that puts the point on E8; stored with bit 3 flipped, as the nibble extraction flips it back."""
    return (f"bfe.u32 zm, {word}, {16 * half}, 8; bfe.u32 zs, {word}, {16 * half + 8}, 8; and.b32 z7, zs, 0x7F; "
            "xor.b32 zt, z7, zm; popc.b32 zt, zt; bfi.b32 zn, zt, z7, 7, 1; xor.b32 zx, zm, zn; "
            + _spread("zn") + _spread("zx") +
            "shr.u32 zb, zs, 7; mul.lo.u32 zb, zb, 0x22222222; xor.b32 zb, zb, 0x33333333; "
            f"shl.b32 zn, zn, 3; shl.b32 zx, zx, 2; lop3.b32 {out}, zn, zx, zb, 0xFE; ")


def _key_group(prefix: str, words: list[str], bits: int) -> tuple[str, list[tuple[str, str]]]:
    """One key's group (32 code bytes of int4: 2 words; 64 of int8: 4 words, this thread's share) as the A registers
    of its 4 k-steps: (k slots 2c.., k slots 2c + 8..) per step."""
    regs = [f"{prefix}{i}" for i in range(8)]
    if bits == 2:  # e8cube: the word's two 8-vectors as int4-like words, then as int4
        text, pairs = _key_group(prefix, [f"{prefix}v0", f"{prefix}v1"], 4)
        return _e8_vector(f"{prefix}v0", words[0], 0) + _e8_vector(f"{prefix}v1", words[0], 1) + text, pairs
    if bits == 4:  # word 0: steps 0 (low nibbles j, high nibbles j) and 1 (same, bytes 1, 3); word 1: steps 2, 3
        return _nibbles(regs[:4], words[0]) + _nibbles(regs[4:], words[1]), [(regs[2 * j], regs[2 * j + 1])
                                                                              for j in range(4)]
    return "".join(_bytes(regs[2 * j : 2 * j + 2], words[j]) for j in range(4)), [(regs[2 * j], regs[2 * j + 1])
                                                                                    for j in range(4)]


def keys_asm(step: int, code_stride: int, scale_stride: int, hint: str = "", bits: int = 4) -> str:
    """Scores of keys 16 step + (g, g + 8) of a page x query columns (2c, 2c + 1), in the log2 domain. Operands:
    $0-$3 out (key g: columns 2c, 2c + 1; key g + 8: same); $4 the page's code address for key 0 of this thread
    (+ g rows + this thread's bytes: 8c of int4 groups, 16c of int8), $5 its scale address (+ g rows), $6 keys left
    in the page from key g, $7 the softmax scale x log2(e) x 2^24, $8-$15 each group's offset sums
    (key_offsets_asm), $16-$47 Q's B fragments (group G, k-step j: $(16 + 8G + 2j), $(17 + 8G + 2j)). Code words
    are loaded whole pages at a time (in bounds even past the context; their scores are masked), scales only for
    keys in the context (zero otherwise)."""
    first, second = 16 * step, 16 * step + 8
    per_group = bits // 2  # words of one key's group for this thread (e8cube: one word, two 8-vectors)
    lines = [f"{{ .reg .pred pg, ph; .reg .b32 w<{8 * per_group}>, sc<4>, a<8>, e<8>, t, av<2>, ev<2>, zm, zs, z7, "
             "zt, zn, zx, zb; .reg .b16 s<8>; .reg .f32 p<4>, z, f, h, d<4>;",
             f"setp.gt.s32 pg, $6, {first}; setp.gt.s32 ph, $6, {second}; mov.f32 z, 0f00000000;",
             "mov.b32 sc0, 0; mov.b32 sc1, 0; mov.b32 sc2, 0; mov.b32 sc3, 0;"]
    width = {2: "", 4: ".v2", 8: ".v4"}[bits]
    for key, row in enumerate((first, second)):
        for grp in range(4):
            regs = ", ".join(f"w{(4 * key + grp) * per_group + i}" for i in range(per_group))
            regs = regs if bits == 2 else f"{{{regs}}}"
            lines.append(f"ld.global{hint}{width}.b32 {regs}, [$4+{row * code_stride + 8 * bits * grp}];")
    lines += [f"@pg ld.global.v2.b32 {{sc0, sc1}}, [$5+{first * scale_stride}];",
              f"@ph ld.global.v2.b32 {{sc2, sc3}}, [$5+{second * scale_stride}];",
              "mov.b32 {s0, s1}, sc0; mov.b32 {s2, s3}, sc1; mov.b32 {s4, s5}, sc2; mov.b32 {s6, s7}, sc3;"]
    lines += [f"mov.f32 ${i}, z;" for i in range(4)]
    for grp in range(4):
        text_g, rows_g = _key_group("a", [f"w{grp * per_group + i}" for i in range(per_group)], bits)
        text_h, rows_h = _key_group("e", [f"w{(4 + grp) * per_group + i}" for i in range(per_group)], bits)
        lines += [text_g, text_h]
        for j in range(4):
            qb = 16 + 8 * grp + 2 * j
            acc = "z, z, z, z" if j == 0 else "p0, p1, p2, p3"
            lines.append(f"{_MMA} {{p0, p1, p2, p3}}, {{{rows_g[j][0]}, {rows_h[j][0]}, {rows_g[j][1]}, "
                         f"{rows_h[j][1]}}}, {{${qb}, ${qb + 1}}}, {{{acc}}};")
        o0, o1 = f"${8 + 2 * grp}", f"${9 + 2 * grp}"
        lines.append(f"cvt.f32.f16 f, s{grp}; cvt.f32.f16 h, s{4 + grp}; mul.f32 f, f, $7; mul.f32 h, h, $7; "
                     f"sub.f32 d0, p0, {o0}; sub.f32 d1, p1, {o1}; sub.f32 d2, p2, {o0}; sub.f32 d3, p3, {o1}; "
                     "fma.rn.f32 $0, d0, f, $0; fma.rn.f32 $1, d1, f, $1; fma.rn.f32 $2, d2, h, $2; "
                     "fma.rn.f32 $3, d3, h, $3;")
    return " ".join(lines) + " }"


def key_offsets_asm(bits: int = 4) -> str:
    """What a zero code contributes to each group's product with Q (columns 2c, 2c + 1): the same mma over the
    offset every code carries. Operands: $0-$7 out (group G at 2G, 2G + 1), $8-$39 Q's B fragments."""
    low, high = (_ZERO_LOW, _ZERO_HIGH) if bits == 4 else (_ZERO_BYTE, _ZERO_BYTE)
    lines = ["{ .reg .b32 lo, hi; .reg .f32 p<4>, z; mov.f32 z, 0f00000000; "
             f"mov.b32 lo, {low}; mov.b32 hi, {high};"]
    for grp in range(4):
        for j in range(4):
            qb = 8 + 8 * grp + 2 * j
            acc = "z, z, z, z" if j == 0 else "p0, p1, p2, p3"
            lines.append(f"{_MMA} {{p0, p1, p2, p3}}, {{lo, lo, hi, hi}}, {{${qb}, ${qb + 1}}}, {{{acc}}};")
        lines.append(f"mov.f32 ${2 * grp}, p0; mov.f32 ${2 * grp + 1}, p1;")
    return " ".join(lines) + " }"


def probabilities_asm(step: int, scale_stride: int) -> str:
    """P^T's B fragments for keys 16 step + (2c, 2c + 1 | 2c + 8, 2c + 9) of column g, times each key's group
    scale, per group. Operands: $0-$7 out (group G: $2G keys 2c.., $(2G + 1) keys 2c + 8..), $8/$9 the scores'
    probabilities of key g (columns 2c, 2c + 1), $10/$11 of key g + 8, $12 the page's value-scale address
    (+ 2c rows), $13 keys left in the page from key 2c. The transpose is one movmatrix per 8 x 8 half."""
    base = 16 * step
    lines = ["{ .reg .pred qa, qb, qc, qd; .reg .b32 t0, t1, b0, b1, xa<2>, xb<2>, xc<2>, xd<2>, sp;",
             "cvt.rn.f16x2.f32 t0, $9, $8; movmatrix.sync.aligned.m8n8.trans.b16 b0, t0;",
             "cvt.rn.f16x2.f32 t1, $11, $10; movmatrix.sync.aligned.m8n8.trans.b16 b1, t1;"]
    for name, key in (("a", 0), ("b", 1), ("c", 8), ("d", 9)):
        lines.append(f"setp.gt.s32 q{name}, $13, {base + key}; mov.b32 x{name}0, 0; mov.b32 x{name}1, 0; "
                     f"@q{name} ld.global.v2.b32 {{x{name}0, x{name}1}}, [$12+{(base + key) * scale_stride}];")
    for grp in range(4):
        word, sel = grp // 2, "0x5410" if grp % 2 == 0 else "0x7632"
        lines.append(f"prmt.b32 sp, xa{word}, xb{word}, {sel}; mul.rn.f16x2 ${2 * grp}, b0, sp; "
                     f"prmt.b32 sp, xc{word}, xd{word}, {sel}; mul.rn.f16x2 ${2 * grp + 1}, b1, sp;")
    return " ".join(lines) + " }"


def values_asm(step: int, group: int, rescale: bool, code_stride: int, hint: str = "", bits: int = 4) -> str:
    """acc (group `group`'s 4 m-tiles of O^T: 16 dims x 8 query columns each) and its offset sums += V^T P^T over
    keys 16 step + 0..15 of a page (acc x alpha first when `rescale`: a page's first step). Operands: $0-$15 acc
    out (m-tile j at 4j: dim rows g / g + 8, columns 2c, 2c + 1), $16-$19 offset sums out (rows g / g + 8 likewise),
    $20-$35 acc in, $36-$39 offset sums in, $40 the page's value-code address (+ 2c rows + this thread's bytes:
    4g of int4 groups, 8g of int8), $41/$42 the group's scaled P fragments (probabilities_asm), $43/$44 alpha of
    columns 2c / 2c + 1. Rows: int4 m-tile j row g is byte j's low nibble, row g + 8 its high nibble; int8 row g is
    byte j, row g + 8 byte j + 4."""
    rows = [16 * step + k for k in (0, 1, 8, 9)]
    keys = ("a", "b", "c", "d")
    if bits == 4:
        lines = ["{ .reg .b32 wa0, wb0, wc0, wd0, x, y, xu, xv, xs, ys, m0, m1, m2, m3, lo, hi; .reg .f32 c<20>;"]
        lines += [f"ld.global{hint}.b32 w{key}0, [$40+{row * code_stride + 32 * group}];"
                  for key, row in zip(keys, rows)]
        # bytes 0, 1 of keys 2c and 2c + 1 (x) / 2c + 8 and 2c + 9 (y); bytes 2, 3 likewise (xu, xv)
        lines.append("prmt.b32 x, wa0, wb0, 0x5410; prmt.b32 y, wc0, wd0, 0x5410; "
                     "prmt.b32 xu, wa0, wb0, 0x7632; prmt.b32 xv, wc0, wd0, 0x7632;")
        for j, (lo, hi) in enumerate((("x", "y"), ("xs", "ys"), ("xu", "xv"), ("xs", "ys"))):
            if j in (1, 3):  # the odd byte of each pair
                first, second = ("x", "y") if j == 1 else ("xu", "xv")
                lines.append(f"shr.b32 xs, {first}, 8; shr.b32 ys, {second}, 8;")
            lines.append(f"lop3.b32 m0, {lo}, {_LOW}; lop3.b32 m1, {lo}, {_HIGH}; "
                         f"lop3.b32 m2, {hi}, {_LOW}; lop3.b32 m3, {hi}, {_HIGH};")
            lines.append(_value_mma([f"${4 * j + i}" for i in range(4)], [f"${20 + 4 * j + i}" for i in range(4)],
                                    [f"c{4 * j + i}" for i in range(4)], "m0, m1, m2, m3", rescale))
        zero = f"mov.b32 lo, {_ZERO_LOW}; mov.b32 hi, {_ZERO_HIGH};"
    else:
        lines = ["{ .reg .b32 wa<2>, wb<2>, wc<2>, wd<2>, x<4>, y<4>, xs, ys, m0, m1, m2, m3, lo, hi; "
                 ".reg .f32 c<20>;"]
        lines += [f"ld.global{hint}.v2.b32 {{w{key}0, w{key}1}}, [$40+{row * code_stride + 64 * group}];"
                  for key, row in zip(keys, rows)]
        # x0: bytes 0, 1 of keys 2c and 2c + 1, x1: bytes 2, 3, x2 / x3: bytes 4, 5 / 6, 7; y: keys 2c + 8, 2c + 9
        for i, (word, sel) in enumerate(((0, "0x5410"), (0, "0x7632"), (1, "0x5410"), (1, "0x7632"))):
            lines.append(f"prmt.b32 x{i}, wa{word}, wb{word}, {sel}; prmt.b32 y{i}, wc{word}, wd{word}, {sel};")
        for j in range(4):
            low, high = (f"x{j // 2}", f"y{j // 2}"), (f"x{2 + j // 2}", f"y{2 + j // 2}")  # rows g / g + 8
            if j % 2:
                lines.append(f"shr.b32 xs, {low[0]}, 8; shr.b32 ys, {low[1]}, 8; lop3.b32 m0, xs, {_BYTE}; "
                             f"lop3.b32 m2, ys, {_BYTE}; shr.b32 xs, {high[0]}, 8; shr.b32 ys, {high[1]}, 8; "
                             f"lop3.b32 m1, xs, {_BYTE}; lop3.b32 m3, ys, {_BYTE};")
            else:
                lines.append(f"lop3.b32 m0, {low[0]}, {_BYTE}; lop3.b32 m2, {low[1]}, {_BYTE}; "
                             f"lop3.b32 m1, {high[0]}, {_BYTE}; lop3.b32 m3, {high[1]}, {_BYTE};")
            lines.append(_value_mma([f"${4 * j + i}" for i in range(4)], [f"${20 + 4 * j + i}" for i in range(4)],
                                    [f"c{4 * j + i}" for i in range(4)], "m0, m1, m2, m3", rescale))
        zero = f"mov.b32 lo, {_ZERO_BYTE}; mov.b32 hi, {_ZERO_BYTE};"
    lines.append(zero)
    lines.append(_value_mma([f"${16 + i}" for i in range(4)], [f"${36 + i}" for i in range(4)],
                            [f"c{16 + i}" for i in range(4)], "lo, hi, lo, hi", rescale))
    return " ".join(lines) + " }"


def _value_mma(out: list[str], acc_in: list[str], scratch: list[str], a: str, rescale: bool) -> str:
    text = ""
    if rescale:
        text = " ".join(f"mul.f32 {scratch[i]}, {acc_in[i]}, ${43 + i % 2};" for i in range(4)) + " "
        acc_in = scratch
    return text + f"{_MMA} {{{', '.join(out)}}}, {{{a}}}, {{$41, $42}}, {{{', '.join(acc_in)}}};"


WARP_MAX_ASM = tl.constexpr("{ .reg .f32 t; shfl.sync.bfly.b32 t, $1, 4, 0x1f, 0xffffffff; max.f32 $0, $1, t; "
                            "shfl.sync.bfly.b32 t, $0, 8, 0x1f, 0xffffffff; max.f32 $0, $0, t; "
                            "shfl.sync.bfly.b32 t, $0, 16, 0x1f, 0xffffffff; max.f32 $0, $0, t; }")
WARP_SUM_ASM = tl.constexpr(WARP_MAX_ASM.value.replace("max.f32", "add.f32"))
_KEYS_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 4 + ["l", "l", "r"] + ["f"] * 9 + ["r"] * 32))
_OFFSETS_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 8 + ["r"] * 32))
_PROBABILITIES_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 8 + ["f"] * 4 + ["l", "r"]))
_VALUES_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 20 + ["f"] * 20 + ["l", "r", "r", "f", "f"]))


@triton.jit
def _lanes(x, ASM: tl.constexpr):
    """x reduced (max or sum) over the 8 threads holding the same query columns (lanes c, c + 4, .. c + 28)."""
    return tl.inline_asm_elementwise(ASM, "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _half_pair(q_row, d, ok, SCALE: tl.constexpr, STEP: tl.constexpr):
    """q[d], q[d + STEP] (times SCALE, exact: a power of two) as one packed fp16 pair."""
    lo = (tl.load(q_row + d, mask=ok, other=0.0).to(tl.float32) * SCALE).to(tl.float16)
    hi = (tl.load(q_row + d + STEP, mask=ok, other=0.0).to(tl.float32) * SCALE).to(tl.float16)
    return (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _query_fragments(q_row, c, ok, KB: tl.constexpr):
    """Q's B fragments for the 16 k-steps, in the keys' order (_key_group): group G, k-step j holds, of int4 keys,
    dims 64G + 16c + 8(j // 2) + 2(j % 2) + (0, 4) (low nibbles) then + 1 (high nibbles, queries / 16); of int8
    keys dims 64G + 16c + 4j + (0, 2) then + 1."""
    out = ()
    for grp in tl.static_range(4):
        for j in tl.static_range(4):
            if KB <= 4:  # int4 and e8cube (whose 8-vectors are decoded into int4's nibble order)
                d = 64 * grp + 16 * c + 8 * (j // 2) + 2 * (j % 2)
                out = out + (_half_pair(q_row, d, ok, 1.0, 4), _half_pair(q_row, d + 1, ok, 0.0625, 4))
            else:
                d = 64 * grp + 16 * c + 4 * j
                out = out + (_half_pair(q_row, d, ok, 1.0, 2), _half_pair(q_row, d + 1, ok, 1.0, 2))
    return out


@triton.jit
def _value_group(acc, off, codes, b0, b1, alpha0, alpha1, ASMS: tl.constexpr, INDEX: tl.constexpr):
    r = tl.inline_asm_elementwise(ASMS[INDEX], _VALUES_CONSTRAINTS, acc + off + (codes, b0, b1, alpha0, alpha1),
                                  dtype=(tl.float32,) * 20, is_pure=False, pack=1)
    acc = ()
    for i in tl.static_range(16):
        acc = acc + (r[i],)
    return acc, (r[16], r[17], r[18], r[19])


@triton.jit
def _address(ptr):
    return ptr.to(tl.int64, bitcast=True)


@triton.jit
def _store_group(part_o_ptr, acc, off, part0, ok0, ok1, g, GRP: tl.constexpr, VB: tl.constexpr):
    """Group GRP's dims from its 4 m-tiles, each less its offset sums, back from units of 2^-24. int4: m-tile j's
    row g is dim 64 GRP + 8g + 2j (low nibbles), row g + 8 the next dim (high nibbles, 16x); int8: row g is dim
    64 GRP + 8g + j, row g + 8 dim + 4."""
    HIGH: tl.constexpr = 1 if VB == 4 else 4  # the dim of row g + 8 after row g's
    HIGH_UNIT: tl.constexpr = UNIT / 16 if VB == 4 else UNIT
    for j in tl.static_range(4):
        d = 64 * GRP + 8 * g + (2 * j if VB == 4 else j)
        tl.store(part_o_ptr + part0 * 256 + d, (acc[4 * j] - off[0]) * UNIT, mask=ok0)
        tl.store(part_o_ptr + (part0 + 1) * 256 + d, (acc[4 * j + 1] - off[1]) * UNIT, mask=ok1)
        tl.store(part_o_ptr + part0 * 256 + d + HIGH, (acc[4 * j + 2] - off[2]) * HIGH_UNIT, mask=ok0)
        tl.store(part_o_ptr + (part0 + 1) * 256 + d + HIGH, (acc[4 * j + 3] - off[3]) * HIGH_UNIT, mask=ok1)


@triton.jit
def _attention_frag_kernel(q_ptr, part_o_ptr, part_ml_ptr, k0, k1, v0, v1, block_table_ptr, ctx_len_ptr,
                           T, HQ, HKV, PAGES_PER_LANE, SPLITS, SPLIT_MIN, TILES, score_scale,
                           KW0: tl.constexpr, KW1: tl.constexpr, VW0: tl.constexpr, VW1: tl.constexpr,
                           W: tl.constexpr, KEYS_ASM: tl.constexpr, OFFSETS_ASM: tl.constexpr,
                           PROBABILITIES_ASM: tl.constexpr, VALUES_ASM: tl.constexpr, KB: tl.constexpr,
                           VB: tl.constexpr):
    """W warps of one lane, each one (split, kv head, 8-row column tile), tiles then heads fastest: the warps of a
    program read the same token rows (see the module's docstring)."""
    pdl_wait()  # the queries and this step's keys and values are written by the kernels before
    lane = tl.program_id(0)
    group = HQ // HKV
    rows_total = T * group
    zero = tl.zeros([32 * W], tl.int32)
    tid = _thread_ids(zero)
    g = (tid % 32) // 4
    c = tid % 4
    warp = tl.program_id(1) * W + tid // 32
    tile = warp % TILES
    kvh = (warp // TILES) % HKV
    split = warp // TILES // HKV
    lane_kvh = lane * HKV + kvh
    ctx = tl.load(ctx_len_ptr + lane)
    split_len = _split_len(ctx, SPLITS, SPLIT_MIN, 64)
    begin = split * split_len
    end = tl.minimum(begin + split_len, ctx)
    query = COLUMNS * tile + g  # B column g is query row 8 tile + g
    row_ok = query < rows_total
    head = kvh * group + query % group
    q_row = q_ptr + ((lane * T + tl.minimum(query // group, T - 1)) * HQ + tl.where(row_ok, head, 0)) * 256
    qf = _query_fragments(q_row, c, row_ok, KB)
    o = tl.inline_asm_elementwise(OFFSETS_ASM, _OFFSETS_CONSTRAINTS, qf, dtype=(tl.float32,) * 8, is_pure=True,
                                  pack=1)
    koff = (o[0], o[1], o[2], o[3], o[4], o[5], o[6], o[7])
    sscale = zero.to(tl.float32) + score_scale
    r0 = COLUMNS * tile + 2 * c  # the query rows of this thread's columns 2c, 2c + 1
    last0 = ctx - T + r0 // group  # the last key each of them sees
    last1 = ctx - T + (r0 + 1) // group
    # this thread's byte offsets inside a page (rows of HKV heads): keys g / values 2c, code bytes 8c / 4g of int4
    # groups (16c / 8g of int8)
    k_thread = g.to(tl.int64) * HKV * KW0 + 2 * KB * c
    ks_thread = g.to(tl.int64) * HKV * KW1
    v_thread = (2 * c).to(tl.int64) * HKV * VW0 + VB * g
    vs_thread = (2 * c).to(tl.int64) * HKV * VW1
    m0 = tl.full([32 * W], float("-inf"), tl.float32)
    m1 = m0
    l0 = tl.zeros([32 * W], tl.float32)
    l1 = l0
    acc0 = (l0, l0, l0, l0, l0, l0, l0, l0, l0, l0, l0, l0, l0, l0, l0, l0)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    off0 = (l0, l0, l0, l0)
    off1 = off0
    off2 = off0
    off3 = off0
    # a program whose splits all lie past the lane's context (a short context under a long capacity) runs no tile
    first_split = tl.program_id(1) * W // (TILES * HKV)
    pages = tl.where(first_split * split_len < ctx, split_len // 64, 0)
    for ti in range(0, pages):
        n0 = begin + ti * 64
        page = tl.load(block_table_ptr + lane * PAGES_PER_LANE + n0 // 64, mask=n0 < end, other=0)
        row0 = page.to(tl.int64) * 64 * HKV + kvh
        kc = _address(k0 + row0 * KW0 + k_thread)
        ks = _address(k1 + row0 * KW1 + ks_thread)
        vc = _address(v0 + row0 * VW0 + v_thread)
        vs = _address(v1 + row0 * VW1 + vs_thread)
        lim0 = tl.minimum(last0, end - 1) - n0 - g  # key g + i of the page is visible to column 2c when i <= lim0
        lim1 = tl.minimum(last1, end - 1) - n0 - g
        s = ()
        for u in tl.static_range(4):
            r = tl.inline_asm_elementwise(KEYS_ASM[u], _KEYS_CONSTRAINTS, (kc, ks, end - n0 - g, sscale) + koff + qf,
                                          dtype=(tl.float32,) * 4, is_pure=False, pack=1)
            s = s + (tl.where(16 * u <= lim0, r[0], float("-inf")), tl.where(16 * u <= lim1, r[1], float("-inf")),
                     tl.where(16 * u + 8 <= lim0, r[2], float("-inf")),
                     tl.where(16 * u + 8 <= lim1, r[3], float("-inf")))
        mx0 = tl.maximum(tl.maximum(tl.maximum(s[0], s[2]), tl.maximum(s[4], s[6])),
                         tl.maximum(tl.maximum(s[8], s[10]), tl.maximum(s[12], s[14])))
        mx1 = tl.maximum(tl.maximum(tl.maximum(s[1], s[3]), tl.maximum(s[5], s[7])),
                         tl.maximum(tl.maximum(s[9], s[11]), tl.maximum(s[13], s[15])))
        new0 = tl.maximum(m0, _lanes(mx0, WARP_MAX_ASM))
        new1 = tl.maximum(m1, _lanes(mx1, WARP_MAX_ASM))
        safe0 = tl.where(new0 == float("-inf"), 0.0, new0)
        safe1 = tl.where(new1 == float("-inf"), 0.0, new1)
        alpha0 = tl.exp2(m0 - safe0)
        alpha1 = tl.exp2(m1 - safe1)
        p = ()
        for i in tl.static_range(16):
            p = p + (tl.exp2(s[i] - (safe0 if i % 2 == 0 else safe1)),)
        l0 = l0 * alpha0 + (((p[0] + p[2]) + (p[4] + p[6])) + ((p[8] + p[10]) + (p[12] + p[14])))
        l1 = l1 * alpha1 + (((p[1] + p[3]) + (p[5] + p[7])) + ((p[9] + p[11]) + (p[13] + p[15])))
        m0 = new0
        m1 = new1
        for u in tl.static_range(4):
            b = tl.inline_asm_elementwise(PROBABILITIES_ASM[u], _PROBABILITIES_CONSTRAINTS,
                                          (p[4 * u], p[4 * u + 1], p[4 * u + 2], p[4 * u + 3], vs, end - n0 - 2 * c),
                                          dtype=(tl.int32,) * 8, is_pure=False, pack=1)
            acc0, off0 = _value_group(acc0, off0, vc, b[0], b[1], alpha0, alpha1, VALUES_ASM, 8 * u + 4 * (u == 0))
            acc1, off1 = _value_group(acc1, off1, vc, b[2], b[3], alpha0, alpha1,
                                      VALUES_ASM, 8 * u + 1 + 4 * (u == 0))
            acc2, off2 = _value_group(acc2, off2, vc, b[4], b[5], alpha0, alpha1,
                                      VALUES_ASM, 8 * u + 2 + 4 * (u == 0))
            acc3, off3 = _value_group(acc3, off3, vc, b[6], b[7], alpha0, alpha1,
                                      VALUES_ASM, 8 * u + 3 + 4 * (u == 0))
    l0 = _lanes(l0, WARP_SUM_ASM)
    l1 = _lanes(l1, WARP_SUM_ASM)
    part0 = (lane_kvh * SPLITS + split) * rows_total + r0  # partials [lane, kvh, split, row, D] and (m, l)
    ok0 = (r0 < rows_total) & (split < SPLITS)
    ok1 = (r0 + 1 < rows_total) & (split < SPLITS)
    tl.store(part_ml_ptr + part0 * 2, m0 * LN2, mask=ok0 & (g == 0))  # natural-log units, as the combine reads
    tl.store(part_ml_ptr + part0 * 2 + 1, l0, mask=ok0 & (g == 0))
    tl.store(part_ml_ptr + part0 * 2 + 2, m1 * LN2, mask=ok1 & (g == 0))
    tl.store(part_ml_ptr + part0 * 2 + 3, l1, mask=ok1 & (g == 0))
    _store_group(part_o_ptr, acc0, off0, part0, ok0, ok1, g, 0, VB)
    _store_group(part_o_ptr, acc1, off1, part0, ok0, ok1, g, 1, VB)
    _store_group(part_o_ptr, acc2, off2, part0, ok0, ok1, g, 2, VB)
    _store_group(part_o_ptr, acc3, off3, part0, ok0, ok1, g, 3, VB)


@functools.lru_cache(maxsize=16)
def kernel_asm(hkv: int, key_width: int, key_scales: int, value_width: int, value_scales: int, hint: str = "") -> dict:
    """The PTX strings for a pool of `hkv` heads (token rows of hkv x width bytes; code bits from the widths): keys
    per 16-key step, values per (step, group) with a page's first step rescaling (index 8 step + 4 + group),
    probabilities per step."""
    code_k, scale_k, code_v, scale_v = hkv * key_width, 2 * hkv * key_scales, hkv * value_width, 2 * hkv * value_scales
    key_bits, value_bits = 8 * key_width // HEAD_DIM, 8 * value_width // HEAD_DIM
    values = []
    for step in range(4):
        values += [values_asm(step, grp, False, code_v, hint, value_bits) for grp in range(4)]
        values += [values_asm(step, grp, True, code_v, hint, value_bits) for grp in range(4)]
    return {"KEYS_ASM": tuple(keys_asm(step, code_k, scale_k, hint, key_bits) for step in range(4)),
            "OFFSETS_ASM": key_offsets_asm(8 if key_bits == 8 else 4), "KB": key_bits, "VB": value_bits,
            "PROBABILITIES_ASM": tuple(probabilities_asm(step, scale_v) for step in range(4)),
            "VALUES_ASM": tuple(values)}


def frag_attention_supported(codec: Codec, head_dim: int, rows: int) -> bool:
    """int4 or int8 group-64 keys and values, or e8cube keys (rk4v4, rk4v4-e8, rk8v4, int8, rk2v4-e8), head dim
    256, at most 64 query rows per kv head."""
    return codec.key in KEY_KINDS and codec.value in VALUE_KINDS and head_dim == HEAD_DIM and 1 <= rows <= MAX_ROWS


def paged_attention_frag(q: torch.Tensor, pool: dict[str, torch.Tensor], codec: Codec, block_table: torch.Tensor,
                         ctx_len: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                         warps: int | None = None, target_splits: int | None = None, hint: int | None = None,
                         split_tokens: int = 0, gate=None) -> torch.Tensor:
    """paged_attention for frag_attention_supported shapes: q [lanes, T, HQ, 256] rotated as the codec says,
    returns [lanes, T, HQ, 256] in the value storage basis (or, with `gate`, the gated rows: see paged_attention).
    split_tokens > 0 pins the keys per split (tests)."""
    lanes, t, hq, d = q.shape
    hkv = pool["k_codes"].shape[2]
    if not frag_attention_supported(codec, d, t * (hq // hkv)):
        raise ValueError(f"paged_attention_frag: {codec.name} with head dim {d} and {t * (hq // hkv)} query rows per "
                         f"kv head (int4/int8/e8cube keys, int4/int8 values, head dim {HEAD_DIM}, "
                         f"at most {MAX_ROWS} rows)")
    warps = warps or FRAG_ATTENTION["warps"]
    target = target_splits or FRAG_ATTENTION["splits"]
    rows = t * (hq // hkv)
    capacity = block_table.shape[1] * PAGE
    if split_tokens:
        size = max(TILE, -(-min(split_tokens, capacity) // TILE) * TILE)
        split_min = size
    else:
        size = split_size(capacity, lanes * hkv * triton.cdiv(rows, COLUMNS.value), TILE, target)  # ~target warps
        split_min = -(-MIN_SPLIT // TILE) * TILE
    splits = triton.cdiv(capacity, size)
    o = out if out is not None else torch.empty_like(q)
    part_o = torch.empty(lanes * hkv * splits * rows * d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(lanes * hkv * splits * rows * 2, dtype=torch.float32, device=q.device)
    k0, k1, v0, v1 = pool["k_codes"], pool["k_scales"], pool["v_codes"], pool["v_scales"]
    asm = kernel_asm(hkv, k0.shape[-1], k1.shape[-1], v0.shape[-1], v1.shape[-1],
                     HINTS[FRAG_ATTENTION["hint"] if hint is None else hint])
    tiles = triton.cdiv(rows, COLUMNS.value)
    _attention_frag_kernel[(lanes, triton.cdiv(splits * hkv * tiles, warps))](
        q.contiguous(), part_o, part_ml, k0, k1, v0, v1, block_table, ctx_len, t, hq, hkv, block_table.shape[1],
        splits, split_min, tiles, scale * LOG2E * UNIT.value * (0.25 if codec.key == "e8cube" else 1.0), KW0=k0.shape[-1], KW1=k1.shape[-1], VW0=v0.shape[-1],
        VW1=v1.shape[-1], W=warps, num_warps=warps, **asm, **LAUNCH)
    return combine_splits(part_o, part_ml, o, ctx_len, t, hq, hkv, splits, split_min, TILE, gate)
