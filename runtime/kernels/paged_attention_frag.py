"""Decode attention over int4 keys and values (rk4v4, rk4v4-e8: int4g64 K and V, head dim 256) with every code
word loaded by the thread whose tensor-core fragment it fills.

Why: paged_attention.py decodes K and V tiles to fp16 tensors and hands them to tl.dot, whose operand layouts
Triton reaches through shared memory or register shuffles; at 200K context its rk4v4-e8 attention ran at ~0.3 of
copy bandwidth (ALU-bound: ~12 thread instructions per code; bench/RESULTS.md §1), so the codec that reads 3.7x
fewer bytes than bf16 decoded slower. Here the fragments are built where the codes land (the technique of
qgemm_rows_frag.py), about 1.3 thread instructions per code.

One warp owns one split of a (lane, kv head)'s keys and walks it 64 keys (one page) at a time:

- Scores S^T = K Q^T: 16 keys are mma.sync m16n8k16's A rows and the kv head's query rows (<= 8: a 6- or 8-head
  GQA group at T = 1) its B columns. Thread (g, c) = (lane / 4, lane % 4) reads keys g and g + 8, 8 code bytes
  of each 64-element group (bytes 8c .. 8c + 7): a dot product does not care in which order the dims are summed
  as long as A and B agree, so the 16 nibbles of those bytes fill the thread's A slots of the group's 4 k-steps
  in the order one logic op places them (nibbles j and j + 4 of a word: low nibbles as 1032 + n in fp16, high
  nibbles as 1152 + 16 n, both exact; one subtraction each), and Q's B fragments hold the matching dims (high-
  nibble dims' queries divided by 16, exact). Each group's four mma sum into fresh registers that its keys'
  scales multiply once (float32).
- Softmax over the 64 keys in the log2 domain: per query column a thread holds 2 x 4 scores; max and sum cross
  the 8 threads of a column with 3 butterfly shuffles.
- Values O^T = V^T P^T: 16 output dims are A's rows and the 16 keys of a step its k. Thread (g, c) needs keys
  2c, 2c + 1, 2c + 8, 2c + 9 of dims it chooses: the 4 code bytes 4g .. 4g + 3 of each group (dims 64 G + 8 g ..
  + 7); one byte permute pairs two keys' bytes and one logic op per A register places a nibble of each. P's B
  fragment is the scores' C fragment transposed in registers (movmatrix), times each key's group scale (fp16).
  The dims of a group's 4 m-tiles are stored back in order (high nibbles' rows divided by 16).

Each warp writes its split's (m, l) and un-normalized output as paged_attention's partials, in natural-log units,
and paged_attention's combine kernel merges the splits. The PTX strings are constexpr arguments built here;
on a CPU, Triton's interpreter runs the kernel with the PTX emulated warp by warp (tests/ptx_warp.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from runtime.kv.codecs import Codec

from .launch import LAUNCH, pdl_wait
from .paged_attention import MIN_SPLIT, PAGE, _combine_kernel, _split_len, split_size
from .qgemm_rows_frag import _thread_ids

KEY_KINDS = ("int4g64", "int4g64e8")  # the same codes and scales (e8 changes only how they were chosen)
VALUE_KINDS = ("int4g64",)
HEAD_DIM = 256
MAX_ROWS = 8  # query rows per (lane, kv head): the mma's 8 B columns
TILE = 64  # keys per softmax step: one page, 4 mma k-steps of 16
LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)
MODES = ("off", "on")
# warps per program (each its own split) and the splits aimed at over the whole grid (~12 warps per SM resident)
FRAG_ATTENTION = {"mode": os.environ.get("NINFER_ATTENTION_FRAG", "off"), "warps": 4, "splits": 1536}
if os.environ.get("NINFER_ATTENTION_FRAG_TILE"):  # side-by-side runs: warps,splits
    FRAG_ATTENTION.update(zip(("warps", "splits"), map(int, os.environ["NINFER_ATTENTION_FRAG_TILE"].split(","))))
if FRAG_ATTENTION["mode"] not in MODES:
    raise SystemExit(f"ninfer: NINFER_ATTENTION_FRAG={FRAG_ATTENTION['mode']!r} is not one of {', '.join(MODES)}")

_LOW = "0x000F000F, 0x64086408, 0x6a"  # (w & mask) ^ magic: low nibbles n as 1032 + n
_HIGH = "0x00F000F0, 0x64806480, 0x6a"  # high nibbles as 1152 + 16 n
_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"


def _nibbles(out: list[str], word: str) -> str:
    """A code word's 8 nibbles as 4 exact fp16 pairs: (j, j + 4) for j = 0..3, low nibbles as n, high as 16 n."""
    return (f"shr.b32 t, {word}, 8; "
            f"lop3.b32 {out[0]}, {word}, {_LOW}; sub.rn.f16x2 {out[0]}, {out[0]}, kl; "
            f"lop3.b32 {out[1]}, {word}, {_HIGH}; sub.rn.f16x2 {out[1]}, {out[1]}, kh; "
            f"lop3.b32 {out[2]}, t, {_LOW}; sub.rn.f16x2 {out[2]}, {out[2]}, kl; "
            f"lop3.b32 {out[3]}, t, {_HIGH}; sub.rn.f16x2 {out[3]}, {out[3]}, kh; ")


def keys_asm() -> str:
    """Scores of 16 keys (g, g + 8) x 8 query columns (2c, 2c + 1), scaled into the log2 domain. Operands: $0-$3
    out (key g: columns 2c, 2c + 1; key g + 8: same); $4/$5 code addresses of keys g / g + 8 (+ 8c), $6/$7 their
    scale rows, $8/$9 whether to load them, $10 the softmax scale x log2(e), $11-$42 Q's B fragments (group G,
    k-step j: $(11 + 8G + 2j), $(12 + 8G + 2j))."""
    lines = ["{ .reg .pred pg, ph; .reg .b32 w<16>, sc<4>, a<8>, e<8>, t, kl, kh; .reg .b16 s<8>; "
             ".reg .f32 p<4>, z, f, h; setp.ne.s32 pg, $8, 0; setp.ne.s32 ph, $9, 0; mov.f32 z, 0f00000000; "
             "mov.b32 kl, 0x64086408; mov.b32 kh, 0x64806480;"]
    lines += [f"mov.b32 w{i}, 0;" for i in range(16)] + [f"mov.b32 sc{i}, 0;" for i in range(4)]
    for key, (addr, pred) in enumerate((("$4", "pg"), ("$5", "ph"))):
        lines += [f"@{pred} ld.global.nc.v2.b32 {{w{8 * key + 2 * grp}, w{8 * key + 2 * grp + 1}}}, [{addr}+{32 * grp}];"
                  for grp in range(4)]
    lines += ["@pg ld.global.nc.v2.b32 {sc0, sc1}, [$6];", "@ph ld.global.nc.v2.b32 {sc2, sc3}, [$7];",
              "mov.b32 {s0, s1}, sc0; mov.b32 {s2, s3}, sc1; mov.b32 {s4, s5}, sc2; mov.b32 {s6, s7}, sc3;"]
    lines += [f"mov.f32 ${i}, z;" for i in range(4)]
    a, e = [f"a{i}" for i in range(8)], [f"e{i}" for i in range(8)]
    for grp in range(4):
        lines.append(_nibbles(a[:4], f"w{2 * grp}") + _nibbles(a[4:], f"w{2 * grp + 1}"))
        lines.append(_nibbles(e[:4], f"w{8 + 2 * grp}") + _nibbles(e[4:], f"w{9 + 2 * grp}"))
        for j in range(4):
            qb = 11 + 8 * grp + 2 * j
            acc = "z, z, z, z" if j == 0 else "p0, p1, p2, p3"
            lines.append(f"{_MMA} {{p0, p1, p2, p3}}, {{a{2 * j}, e{2 * j}, a{2 * j + 1}, e{2 * j + 1}}}, "
                         f"{{${qb}, ${qb + 1}}}, {{{acc}}};")
        lines.append(f"cvt.f32.f16 f, s{grp}; cvt.f32.f16 h, s{4 + grp}; mul.f32 f, f, $10; mul.f32 h, h, $10; "
                     "fma.rn.f32 $0, p0, f, $0; fma.rn.f32 $1, p1, f, $1; fma.rn.f32 $2, p2, h, $2; "
                     "fma.rn.f32 $3, p3, h, $3;")
    return " ".join(lines) + " }"


def values_asm(group: int, rescale: bool) -> str:
    """acc (group `group`'s 4 m-tiles of O^T, 16 dims x 8 query columns each) += V^T P^T over 16 keys (optionally
    acc x alpha first: the tile's first step). Operands: $0-$15 acc out (m-tile j at 4j: dims row g / g + 8,
    columns 2c, 2c + 1), $16-$31 acc in, $32-$35 code addresses of keys 2c, 2c + 1, 2c + 8, 2c + 9 (+ 4g), $36-$39
    their scale rows, $40-$43 whether to load them, $44/$45 P's B fragments (keys 2c.. / 2c + 8.., column g),
    $46/$47 alpha of columns 2c / 2c + 1."""
    lines = ["{ .reg .pred qa, qb, qc, qd; .reg .b32 wa, wb, wc, wd, x, y, u, v, xs, ys, m0, m1, m2, m3, sab, scd, "
             "b0, b1, kl, kh; .reg .b16 ha, hb, hc, hd; .reg .f32 c<16>;",
             "setp.ne.s32 qa, $40, 0; setp.ne.s32 qb, $41, 0; setp.ne.s32 qc, $42, 0; setp.ne.s32 qd, $43, 0;",
             "mov.b32 wa, 0; mov.b32 wb, 0; mov.b32 wc, 0; mov.b32 wd, 0; "
             "mov.b16 ha, 0; mov.b16 hb, 0; mov.b16 hc, 0; mov.b16 hd, 0;"]
    for name, addr, scale, pred in (("wa", "$32", "$36", "qa"), ("wb", "$33", "$37", "qb"),
                                    ("wc", "$34", "$38", "qc"), ("wd", "$35", "$39", "qd")):
        lines.append(f"@{pred} ld.global.nc.b32 {name}, [{addr}+{32 * group}]; "
                     f"@{pred} ld.global.nc.b16 h{name[1]}, [{scale}+{2 * group}];")
    lines += ["mov.b32 sab, {ha, hb}; mov.b32 scd, {hc, hd}; mul.rn.f16x2 b0, $44, sab; mul.rn.f16x2 b1, $45, scd;",
              "mov.b32 kl, 0x64086408; mov.b32 kh, 0x64806480;",
              # bytes 0, 1 of keys 2c and 2c + 1 (x) / 2c + 8 and 2c + 9 (y); bytes 2, 3 likewise (u, v)
              "prmt.b32 x, wa, wb, 0x5410; prmt.b32 y, wc, wd, 0x5410; "
              "prmt.b32 u, wa, wb, 0x7632; prmt.b32 v, wc, wd, 0x7632;"]
    for j, (lo, hi) in enumerate((("x", "y"), ("xs", "ys"), ("u", "v"), ("xs", "ys"))):
        if j in (1, 3):  # the odd byte of each pair
            src = "x, y" if j == 1 else "u, v"
            lines.append(f"shr.b32 xs, {src.split(', ')[0]}, 8; shr.b32 ys, {src.split(', ')[1]}, 8;")
        lines.append(f"lop3.b32 m0, {lo}, {_LOW}; sub.rn.f16x2 m0, m0, kl; "
                     f"lop3.b32 m1, {lo}, {_HIGH}; sub.rn.f16x2 m1, m1, kh; "
                     f"lop3.b32 m2, {hi}, {_LOW}; sub.rn.f16x2 m2, m2, kl; "
                     f"lop3.b32 m3, {hi}, {_HIGH}; sub.rn.f16x2 m3, m3, kh;")
        acc_in = [f"${16 + 4 * j + i}" for i in range(4)]
        if rescale:
            for i in range(4):
                lines.append(f"mul.f32 c{4 * j + i}, {acc_in[i]}, ${46 + i % 2};")
            acc_in = [f"c{4 * j + i}" for i in range(4)]
        lines.append(f"{_MMA} {{${4 * j}, ${4 * j + 1}, ${4 * j + 2}, ${4 * j + 3}}}, {{m0, m1, m2, m3}}, {{b0, b1}}, "
                     f"{{{', '.join(acc_in)}}};")
    return " ".join(lines) + " }"


P_FRAGMENT_ASM = tl.constexpr("{ .reg .b32 t; cvt.rn.f16x2.f32 t, $2, $1; movmatrix.sync.aligned.m8n8.trans.b16 $0, t; }")
WARP_MAX_ASM = tl.constexpr("{ .reg .f32 t; shfl.sync.bfly.b32 t, $1, 4, 0x1f, 0xffffffff; max.f32 $0, $1, t; "
                "shfl.sync.bfly.b32 t, $0, 8, 0x1f, 0xffffffff; max.f32 $0, $0, t; "
                "shfl.sync.bfly.b32 t, $0, 16, 0x1f, 0xffffffff; max.f32 $0, $0, t; }")
WARP_SUM_ASM = tl.constexpr(WARP_MAX_ASM.value.replace("max.f32", "add.f32"))
_KEYS_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 4 + ["l"] * 4 + ["r", "r", "f"] + ["r"] * 32))
_VALUES_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 16 + ["f"] * 16 + ["l"] * 8 + ["r"] * 6 + ["f", "f"]))


@triton.jit
def _lanes(x, ASM: tl.constexpr):
    """x reduced (max or sum) over the 8 threads holding the same query columns (lanes c, c + 4, .. c + 28)."""
    return tl.inline_asm_elementwise(ASM, "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _p_fragment(p_even, p_odd):
    """P^T's B fragment (keys 2c, 2c + 1 of column g) from the scores' C fragment (key g, columns 2c, 2c + 1)."""
    return tl.inline_asm_elementwise(P_FRAGMENT_ASM, "=r,f,f", [p_even, p_odd], dtype=tl.int32, is_pure=False,
                                     pack=1)


@triton.jit
def _half_pair(q_row, d, ok, SCALE: tl.constexpr):
    """q[d], q[d + 4] (times SCALE, exact: a power of two) as one packed fp16 pair."""
    lo = (tl.load(q_row + d, mask=ok, other=0.0).to(tl.float32) * SCALE).to(tl.float16)
    hi = (tl.load(q_row + d + 4, mask=ok, other=0.0).to(tl.float32) * SCALE).to(tl.float16)
    return (lo.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _query_fragments(q_row, c, ok):
    """Q's B fragments for the 16 k-steps: group G, k-step j holds dims 64G + 16c + 8(j // 2) + 2(j % 2) + (0, 4)
    (the keys' low nibbles) then + 1 (their high nibbles, queries / 16)."""
    out = ()
    for grp in tl.static_range(4):
        for j in tl.static_range(4):
            d = 64 * grp + 16 * c + 8 * (j // 2) + 2 * (j % 2)
            out = out + (_half_pair(q_row, d, ok, 1.0), _half_pair(q_row, d + 1, ok, 0.0625))
    return out


@triton.jit
def _value_group(acc, va, vb, vc, vd, sa, sb, sc, sd, oka, okb, okc, okd, pb0, pb1, alpha0, alpha1,
                 GRP: tl.constexpr, ASM: tl.constexpr):
    args = acc + (va, vb, vc, vd, sa, sb, sc, sd, oka, okb, okc, okd, pb0, pb1, alpha0, alpha1)
    return tl.inline_asm_elementwise(ASM, _VALUES_CONSTRAINTS, args, dtype=(tl.float32,) * 16, is_pure=False, pack=1)


@triton.jit
def _address(ptr):
    return ptr.to(tl.int64, bitcast=True)


@triton.jit
def _store_group(part_o_ptr, acc, part0, ok0, ok1, g, GRP: tl.constexpr):
    """Group GRP's dims from its 4 m-tiles: m-tile j's row g is dim 64 GRP + 8g + 2j, row g + 8 the next dim (x 16)."""
    for j in tl.static_range(4):
        d = 64 * GRP + 8 * g + 2 * j
        tl.store(part_o_ptr + part0 * 256 + d, acc[4 * j], mask=ok0)
        tl.store(part_o_ptr + (part0 + 1) * 256 + d, acc[4 * j + 1], mask=ok1)
        tl.store(part_o_ptr + part0 * 256 + d + 1, acc[4 * j + 2] * 0.0625, mask=ok0)
        tl.store(part_o_ptr + (part0 + 1) * 256 + d + 1, acc[4 * j + 3] * 0.0625, mask=ok1)


@triton.jit
def _attention_frag_kernel(q_ptr, part_o_ptr, part_ml_ptr, k0, k1, v0, v1, block_table_ptr, ctx_len_ptr,
                           T, HQ, HKV, PAGES_PER_LANE, SPLITS, SPLIT_MIN, score_scale,
                           KW0: tl.constexpr, KW1: tl.constexpr, VW0: tl.constexpr, VW1: tl.constexpr,
                           W: tl.constexpr, KEYS_ASM: tl.constexpr, VALUES_ASM: tl.constexpr):
    """One (lane, kv head) and W splits of its keys, a warp each (see the module's docstring)."""
    pdl_wait()  # the queries and this step's keys and values are written by the kernels before
    lane_kvh = tl.program_id(0)
    lane = lane_kvh // HKV
    kvh = lane_kvh % HKV
    group = HQ // HKV
    rows_total = T * group
    zero = tl.zeros([32 * W], tl.int32)
    tid = _thread_ids(zero)
    g = (tid % 32) // 4
    c = tid % 4
    split = tl.program_id(1) * W + tid // 32
    ctx = tl.load(ctx_len_ptr + lane)
    split_len = _split_len(ctx, SPLITS, SPLIT_MIN, 64)
    begin = split * split_len
    end = tl.minimum(begin + split_len, ctx)
    row_ok = g < rows_total  # B column g is query row g
    head = kvh * group + g % group
    q_row = q_ptr + ((lane * T + tl.minimum(g // group, T - 1)) * HQ + tl.where(row_ok, head, 0)) * 256
    qf = _query_fragments(q_row, c, row_ok)
    pos0 = ctx - T + (2 * c) // group  # the positions of this thread's query columns 2c, 2c + 1
    pos1 = ctx - T + (2 * c + 1) // group
    m0 = tl.full([32 * W], float("-inf"), tl.float32)
    m1 = m0
    l0 = tl.zeros([32 * W], tl.float32)
    l1 = l0
    acc0 = (l0, l0, l0, l0, l0, l0, l0, l0, l0, l0, l0, l0, l0, l0, l0, l0)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    for ti in range(0, split_len // 64):
        n0 = begin + ti * 64
        page = tl.load(block_table_ptr + lane * PAGES_PER_LANE + n0 // 64, mask=n0 < end, other=0)
        base = page.to(tl.int64) * 64
        s = ()
        for u in tl.static_range(4):
            kg = n0 + 16 * u + g
            rg = (base + 16 * u + g) * HKV + kvh
            rh = rg + 8 * HKV
            args = (_address(k0 + rg * KW0 + 8 * c), _address(k0 + rh * KW0 + 8 * c), _address(k1 + rg * KW1),
                    _address(k1 + rh * KW1), (kg < end).to(tl.int32), (kg + 8 < end).to(tl.int32),
                    zero.to(tl.float32) + score_scale) + qf
            r = tl.inline_asm_elementwise(KEYS_ASM, _KEYS_CONSTRAINTS, args, dtype=(tl.float32,) * 4, is_pure=False,
                                          pack=1)
            s = s + (tl.where((kg < end) & (kg <= pos0), r[0], float("-inf")),
                     tl.where((kg < end) & (kg <= pos1), r[1], float("-inf")),
                     tl.where((kg + 8 < end) & (kg + 8 <= pos0), r[2], float("-inf")),
                     tl.where((kg + 8 < end) & (kg + 8 <= pos1), r[3], float("-inf")))
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
            pb0 = _p_fragment(p[4 * u], p[4 * u + 1])
            pb1 = _p_fragment(p[4 * u + 2], p[4 * u + 3])
            ka = n0 + 16 * u + 2 * c
            ra = (base + 16 * u + 2 * c) * HKV + kvh
            rb = ra + HKV
            rc = ra + 8 * HKV
            rd = rc + HKV
            va, vb = _address(v0 + ra * VW0 + 4 * g), _address(v0 + rb * VW0 + 4 * g)
            vc, vd = _address(v0 + rc * VW0 + 4 * g), _address(v0 + rd * VW0 + 4 * g)
            sa, sb, sc, sd = _address(v1 + ra * VW1), _address(v1 + rb * VW1), _address(v1 + rc * VW1), \
                _address(v1 + rd * VW1)
            oka, okb = (ka < end).to(tl.int32), (ka + 1 < end).to(tl.int32)
            okc, okd = (ka + 8 < end).to(tl.int32), (ka + 9 < end).to(tl.int32)
            acc0 = _value_group(acc0, va, vb, vc, vd, sa, sb, sc, sd, oka, okb, okc, okd, pb0, pb1, alpha0, alpha1,
                                0, VALUES_ASM[8 * (u == 0)])
            acc1 = _value_group(acc1, va, vb, vc, vd, sa, sb, sc, sd, oka, okb, okc, okd, pb0, pb1, alpha0, alpha1,
                                1, VALUES_ASM[1 + 8 * (u == 0)])
            acc2 = _value_group(acc2, va, vb, vc, vd, sa, sb, sc, sd, oka, okb, okc, okd, pb0, pb1, alpha0, alpha1,
                                2, VALUES_ASM[2 + 8 * (u == 0)])
            acc3 = _value_group(acc3, va, vb, vc, vd, sa, sb, sc, sd, oka, okb, okc, okd, pb0, pb1, alpha0, alpha1,
                                3, VALUES_ASM[3 + 8 * (u == 0)])
    l0 = _lanes(l0, WARP_SUM_ASM)
    l1 = _lanes(l1, WARP_SUM_ASM)
    part0 = (lane_kvh * SPLITS + split) * rows_total + 2 * c  # partials [lane, kvh, split, row, D] and (m, l)
    ok0 = (2 * c < rows_total) & (split < SPLITS)
    ok1 = (2 * c + 1 < rows_total) & (split < SPLITS)
    tl.store(part_ml_ptr + part0 * 2, m0 * LN2, mask=ok0 & (g == 0))  # natural-log units, as the combine reads
    tl.store(part_ml_ptr + part0 * 2 + 1, l0, mask=ok0 & (g == 0))
    tl.store(part_ml_ptr + part0 * 2 + 2, m1 * LN2, mask=ok1 & (g == 0))
    tl.store(part_ml_ptr + part0 * 2 + 3, l1, mask=ok1 & (g == 0))
    _store_group(part_o_ptr, acc0, part0, ok0, ok1, g, 0)
    _store_group(part_o_ptr, acc1, part0, ok0, ok1, g, 1)
    _store_group(part_o_ptr, acc2, part0, ok0, ok1, g, 2)
    _store_group(part_o_ptr, acc3, part0, ok0, ok1, g, 3)


# values_asm per group, then the same with the tile's rescale first (index 8 + group; 4..7 unused)
VALUES_ASMS = tuple(values_asm(grp % 4, False) for grp in range(8)) + tuple(values_asm(grp % 4, True)
                                                                             for grp in range(8))


def frag_attention_supported(codec: Codec, head_dim: int, rows: int) -> bool:
    """int4g64 keys (plain or E8-chosen) and values, head dim 256, at most 8 query rows per kv head."""
    return codec.key in KEY_KINDS and codec.value in VALUE_KINDS and head_dim == HEAD_DIM and 1 <= rows <= MAX_ROWS


def frag_attention_enabled(codec: Codec, head_dim: int, rows: int, device: torch.device) -> bool:
    """NINFER_ATTENTION_FRAG=on and a shape the kernel takes (a GPU, or the interpreter the tests run)."""
    return FRAG_ATTENTION["mode"] == "on" and frag_attention_supported(codec, head_dim, rows)


def paged_attention_frag(q: torch.Tensor, pool: dict[str, torch.Tensor], codec: Codec, block_table: torch.Tensor,
                         ctx_len: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                         warps: int | None = None, target_splits: int | None = None,
                         split_tokens: int = 0) -> torch.Tensor:
    """paged_attention for frag_attention_supported shapes: q [lanes, T, HQ, 256] rotated as the codec says,
    returns [lanes, T, HQ, 256] in the value storage basis. split_tokens > 0 pins the keys per split (tests)."""
    lanes, t, hq, d = q.shape
    hkv = pool["k_codes"].shape[2]
    if not frag_attention_supported(codec, d, t * (hq // hkv)):
        raise ValueError(f"paged_attention_frag: {codec.name} with head dim {d} and {t * (hq // hkv)} query rows per "
                         f"kv head (int4 keys and values, head dim {HEAD_DIM}, at most {MAX_ROWS} rows)")
    warps = warps or FRAG_ATTENTION["warps"]
    target = target_splits or FRAG_ATTENTION["splits"]
    rows = t * (hq // hkv)
    capacity = block_table.shape[1] * PAGE
    if split_tokens:
        size = max(TILE, -(-min(split_tokens, capacity) // TILE) * TILE)
        split_min = size
    else:
        size = split_size(capacity, lanes * hkv, TILE, target)
        split_min = -(-MIN_SPLIT // TILE) * TILE
    splits = triton.cdiv(capacity, size)
    o = out if out is not None else torch.empty_like(q)
    part_o = torch.empty(lanes * hkv * splits * rows * d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(lanes * hkv * splits * rows * 2, dtype=torch.float32, device=q.device)
    k0, k1, v0, v1 = pool["k_codes"], pool["k_scales"], pool["v_codes"], pool["v_scales"]
    _attention_frag_kernel[(lanes * hkv, triton.cdiv(splits, warps))](
        q.contiguous(), part_o, part_ml, k0, k1, v0, v1, block_table, ctx_len, t, hq, hkv, block_table.shape[1],
        splits, split_min, scale * LOG2E, KW0=k0.shape[-1], KW1=k1.shape[-1], VW0=v0.shape[-1], VW1=v1.shape[-1],
        W=warps, KEYS_ASM=keys_asm(), VALUES_ASM=VALUES_ASMS, num_warps=warps, **LAUNCH)
    _combine_kernel[(lanes * hkv, rows, d // 64)](part_o, part_ml, o, ctx_len, t, hq, hkv, splits, split_min, D=d,
                                                  BLOCK_S=64, BLOCK_D=64, BLOCK_N=TILE, num_warps=4, **LAUNCH)
    return o
