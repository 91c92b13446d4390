"""Row-block products (T = 2..16 rows of x: several lanes, verify blocks, both) for the row-split
formats (Q4/Q5/Q6/W8) on bf16 tensor cores, reading every weight byte once.

Why: with T rows the memory-bound product should cost about what one row costs. The int8
tensor-core kernel (qgemv_int8) quantizes x into a high and a low byte and needs four int8 dots
per nibble group plus an int-to-float epilogue; it ran at 0.22-0.48 of the copy bandwidth. Here
the codes become exact bf16 integers with bit operations only (no int-to-float conversions): a
code byte's nibble u = q + 2^(BITS-1) placed under the exponent of 128.0 is the bf16 value 128 + u,
and one packed bf16 FMA subtracts 128 + 2^(BITS-1), leaving q exactly (|q| <= 127 is exact in
bf16). The codes of one weight group meet x's bf16 rows in one tensor-core dot (fp32 sums), and
the group's fp16 scale is applied to that dot's [rows, T] result, so no product is rounded before
it is summed: y = sum over groups of scale[row, g] * (q[row, g, :] . x[t, g, :]).

Q5/Q6 codes come from the same byte-parallel unpacking as the int8 kernel (unpack_group_bytes) and
then the same move under 128.0. W8 codes (8 bits do not fit under one bf16 exponent) go through
float32's 2^23 magic instead. Under the interpreter the codes are converted with plain integer ops.

`qgemm_rows_bf16_reference` is the exact float product (qlinear_reference's dequantized weights).
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from .launch import LAUNCH, pdl_wait
from .qgemv_int8 import finish_splits, native_dp4a, split_partials, unpack_group_bytes


def _bf16_pair(value: float) -> str:
    """A bf16 value repeated in both halves of a 32-bit PTX immediate (exact values only)."""
    bits = struct.unpack("<I", struct.pack("<f", value))[0]
    if bits & 0xFFFF:
        raise ValueError(f"{value} is not exact in bf16")
    return f"0x{(bits >> 16) * 0x10001:08X}"


_ONE = tl.constexpr(_bf16_pair(1.0))
_BIAS_Q4 = tl.constexpr(_bf16_pair(-136.0))  # 128 + 8
_BIAS_Q5 = tl.constexpr(_bf16_pair(-144.0))  # 128 + 16
_BIAS_Q6 = tl.constexpr(_bf16_pair(-160.0))  # 128 + 32
_PAIRS = tl.constexpr("prmt.b32 a, $2, 0, 0x4140; prmt.b32 c, $2, 0, 0x4342; ")  # bytes 0, 1 / 2, 3 -> low byte of each half


@triton.jit
def _q4_bf16(b, ODD: tl.constexpr):
    """Q4 code bytes (uint8, lanes 2j and 2j + 1) -> bf16 codes q of the low (ODD = 0) or high nibble,
    four per 32-bit register: two byte permutes, two lop3 (nibble ^ 8 under 128.0: 136 + q) and two
    packed FMAs (- 136)."""
    if ODD:
        unpack: tl.constexpr = _PAIRS + "shr.b32 a, a, 4; shr.b32 c, c, 4; "
    else:
        unpack: tl.constexpr = _PAIRS
    return tl.inline_asm_elementwise(
        "{ .reg .b32 a, c, one, bias; " + unpack +
        "lop3.b32 a, a, 0x000F000F, 0x43084308, 0x6a; lop3.b32 c, c, 0x000F000F, 0x43084308, 0x6a; "
        "mov.b32 one, " + _ONE + "; mov.b32 bias, " + _BIAS_Q4 + "; "
        "fma.rn.bf16x2 $0, a, one, bias; fma.rn.bf16x2 $1, c, one, bias; }",
        "=r,=r,r", [b], dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def _unsigned_bf16(u, BITS: tl.constexpr):
    """Unsigned Q5/Q6 code bytes u = q + 2^(BITS-1) -> bf16 q: under 128.0, then one packed FMA."""
    if BITS == 5:
        bias: tl.constexpr = _BIAS_Q5
    else:
        bias: tl.constexpr = _BIAS_Q6
    return tl.inline_asm_elementwise(
        "{ .reg .b32 a, c, one, bias; " + _PAIRS + "or.b32 a, a, 0x43004300; or.b32 c, c, 0x43004300; "
        "mov.b32 one, " + _ONE + "; mov.b32 bias, " + bias + "; "
        "fma.rn.bf16x2 $0, a, one, bias; fma.rn.bf16x2 $1, c, one, bias; }",
        "=r,=r,r", [u], dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def _w8_bf16(c):
    """Signed W8 codes (int8) -> bf16: c + 128 as the low byte of 2^23 + u in float32, minus
    2^23 + 128 (exact), then two packed conversions."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 u, m, a0, a1, a2, a3; xor.b32 u, $2, 0x80808080; mov.b32 m, 0x4B000000; "
        "prmt.b32 a0, u, m, 0x7540; prmt.b32 a1, u, m, 0x7541; prmt.b32 a2, u, m, 0x7542; "
        "prmt.b32 a3, u, m, 0x7543; sub.f32 a0, a0, 0f4B000080; sub.f32 a1, a1, 0f4B000080; "
        "sub.f32 a2, a2, 0f4B000080; sub.f32 a3, a3, 0f4B000080; "
        "cvt.rn.bf16x2.f32 $0, a1, a0; cvt.rn.bf16x2.f32 $1, a3, a2; }",
        "=r,=r,r", [c], dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def _load_planes(code_ptr, high_ptr, rows, ok, g, GPR: tl.constexpr, K_PAD: tl.constexpr, BITS: tl.constexpr,
                 GROUP: tl.constexpr, HIGH_BYTES: tl.constexpr):
    """Weight group `g` of `rows` as loaded (where `ok`, [BLOCK_N, 1]): code bytes [BLOCK_N, GROUP / 2]
    (W8: int8 codes [BLOCK_N, GROUP]) and the high plane (Q5: 8 bytes, Q6: 8 int16; else the codes
    again, unused). (Loading each code byte's high byte beside it, to keep every step elementwise, made
    the Q5/Q6 products 5-15x slower on the H200: run 29 call 3.)"""
    if BITS == 8:
        j = tl.arange(0, GROUP)
        b = tl.load(code_ptr + rows[:, None] * K_PAD + g * GROUP + j[None, :], mask=ok, other=0)
        hb = b
    else:
        j = tl.arange(0, GROUP // 2)
        b = tl.load(code_ptr + rows[:, None] * (K_PAD // 2) + g * (GROUP // 2) + j[None, :], mask=ok, other=0)
        h = tl.arange(0, 8)
        if BITS == 5:
            hb = tl.load(high_ptr + rows[:, None] * (GPR * HIGH_BYTES) + g * HIGH_BYTES + h[None, :], mask=ok, other=0)
        elif BITS == 6:
            hb = tl.load(high_ptr + rows[:, None] * (GPR * HIGH_BYTES // 2) + g * (HIGH_BYTES // 2) + h[None, :],
                         mask=ok, other=0)
        else:
            hb = b
    return b, hb


@triton.jit
def _scales(scale_ptr, rows, ok, g, GPR: tl.constexpr):
    """Group g's scales of `rows` [BLOCK_N, 1] (fp16)."""
    return tl.load(scale_ptr + rows[:, None] * GPR + g, mask=ok, other=0.0)


@triton.jit
def _codes(b, hb, BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr,
           DTYPE: tl.constexpr):
    """Loaded planes (_load_planes) -> exact codes q in DTYPE: nibble formats (even, odd) lanes
    [BLOCK_N, GROUP / 2]; W8 (codes, codes)."""
    if USE_ASM:
        if BITS == 8:
            even = _w8_bf16(b)
            odd = even
        elif BITS == 4:
            even = _q4_bf16(b, 0)
            odd = _q4_bf16(b, 1)
        else:
            ue, uo = unpack_group_bytes(b, hb, BITS, GROUP, BLOCK_N, USE_ASM)
            even = _unsigned_bf16(ue, BITS)
            odd = _unsigned_bf16(uo, BITS)
    else:  # plain integer ops (interpreter, or x not bf16)
        if BITS == 8:
            even = b.to(tl.int32).to(DTYPE)
            odd = even
        else:
            v = b.to(tl.int32)
            lo = v & 0xF
            hi = (v >> 4) & 0xF
            j = tl.arange(0, GROUP // 2)[None, :]
            if BITS == 5:  # lane l's fifth bit: bit l % 8 of high byte l / 8
                hbb = tl.reshape(tl.broadcast_to(hb.to(tl.int32)[:, :, None], (BLOCK_N, 8, 4)), (BLOCK_N, GROUP // 2))
                lo = lo | (((hbb >> (2 * (j % 4))) & 1) << 4)
                hi = hi | (((hbb >> (2 * (j % 4) + 1)) & 1) << 4)
            elif BITS == 6:  # lane l's bits 4-5: bits 2(l % 4), 2(l % 4) + 1 of high byte l / 4
                k = tl.arange(0, 4)[None, None, :]
                hbb = tl.reshape((hb.to(tl.int32)[:, :, None] >> (8 * (k // 2))) & 255, (BLOCK_N, GROUP // 2))
                lo = lo | (((hbb >> (4 * (j % 2))) & 3) << 4)
                hi = hi | (((hbb >> (4 * (j % 2) + 2)) & 3) << 4)
            sign: tl.constexpr = 1 << (BITS - 1)
            even = ((lo ^ sign) - sign).to(DTYPE)
            odd = ((hi ^ sign) - sign).to(DTYPE)
    return even, odd


@triton.jit
def _x_tiles(x_cols, ok_toks, k0, K, NIBBLES: tl.constexpr, lanes):
    """x^T tiles [lanes, BLOCK_T] of the group at lane k0: (even, odd) lanes, or (all, all) for W8."""
    xe = tl.load(x_cols + k0, mask=ok_toks & (k0 + lanes[:, None] < K), other=0.0)
    if NIBBLES:
        xo = tl.load(x_cols + k0 + 1, mask=ok_toks & (k0 + lanes[:, None] + 1 < K), other=0.0)
    else:
        xo = xe
    return xe, xo


@triton.jit
def _qgemm_rows_bf16_kernel(x_ptr, code_ptr, high_ptr, scale_ptr, y_ptr, T, N, K, stride_x, GROUPS_PER_SPLIT,
                            GPR: tl.constexpr, K_PAD: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                            HIGH_BYTES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                            USE_ASM: tl.constexpr, PREFETCH: tl.constexpr):
    """y^T [rows, toks] = sum over groups of scale * (codes . x^T): per weight group one tensor-core dot of
    the exact codes [BLOCK_N, lanes] with x^T [lanes, BLOCK_T], scaled in float32. PREFETCH: the next
    group's planes and x tiles are loaded before the current group's arithmetic (by hand: triton's
    pipeliner does not take loads that reach the dot through bit operations)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    toks = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < N
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    NIBBLES: tl.constexpr = BITS != 8
    WIDTH: tl.constexpr = GROUP // 2 if NIBBLES else GROUP  # lanes per dot
    STEP: tl.constexpr = 2 if NIBBLES else 1  # nibble formats: x's even and odd lanes meet the two nibbles
    lanes = STEP * tl.arange(0, WIDTH)
    x_cols = x_ptr + toks[None, :] * stride_x + lanes[:, None]  # [WIDTH, BLOCK_T]: x^T
    ok_toks = (toks < T)[None, :]
    g_begin = split * GROUPS_PER_SPLIT
    g_end = g_begin + GROUPS_PER_SPLIT
    pdl_wait()
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    if PREFETCH:
        b, hb = _load_planes(code_ptr, high_ptr, rows, row_ok[:, None], g_begin, GPR, K_PAD, BITS, GROUP, HIGH_BYTES)
        scale = _scales(scale_ptr, rows, row_ok[:, None], g_begin, GPR)
        xe, xo = _x_tiles(x_cols, ok_toks, g_begin * GROUP, K, NIBBLES, lanes)
        for g in range(g_begin, g_end):
            # a block-shaped condition: triton 3.9's interpreter rejects a scalar bool broadcast into a mask
            more = tl.full((1, 1), g + 1, tl.int32) < g_end
            nb, nhb = _load_planes(code_ptr, high_ptr, rows, row_ok[:, None] & more, g + 1, GPR, K_PAD, BITS, GROUP,
                                   HIGH_BYTES)
            nscale = _scales(scale_ptr, rows, row_ok[:, None] & more, g + 1, GPR)
            nxe, nxo = _x_tiles(x_cols, ok_toks & more, (g + 1) * GROUP, K, NIBBLES, lanes)
            even, odd = _codes(b, hb, BITS, GROUP, BLOCK_N, USE_ASM, DTYPE)
            d = tl.dot(even, xe)
            if NIBBLES:
                d = tl.dot(odd, xo, d)
            acc += d * scale.to(tl.float32)
            b, hb, scale, xe, xo = nb, nhb, nscale, nxe, nxo
    else:  # weight loads in the loop: triton pipelines them and converts the code bytes (not the bf16
        # codes) to the dot's layout; x's tiles (L2 hits, but a round trip each) one group ahead by hand
        xe, xo = _x_tiles(x_cols, ok_toks, g_begin * GROUP, K, NIBBLES, lanes)
        scale = _scales(scale_ptr, rows, row_ok[:, None], g_begin, GPR)
        for g in range(g_begin, g_end):
            more = tl.full((1, 1), g + 1, tl.int32) < g_end
            nxe, nxo = _x_tiles(x_cols, ok_toks & more, (g + 1) * GROUP, K, NIBBLES, lanes)
            nscale = _scales(scale_ptr, rows, row_ok[:, None] & more, g + 1, GPR)
            b, hb = _load_planes(code_ptr, high_ptr, rows, row_ok[:, None], g, GPR, K_PAD, BITS, GROUP, HIGH_BYTES)
            even, odd = _codes(b, hb, BITS, GROUP, BLOCK_N, USE_ASM, DTYPE)
            d = tl.dot(even, xe)
            if NIBBLES:
                d = tl.dot(odd, xo, d)
            acc += d * scale.to(tl.float32)
            xe, xo, scale = nxe, nxo, nscale
    out = y_ptr + split * T * N + toks[None, :] * N + rows[:, None]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & ok_toks)


def qgemm_rows_bf16(x: torch.Tensor, w, y: torch.Tensor, block_n: int, split: int, num_warps: int,
                    num_stages: int = 1, prefetch: bool = True) -> torch.Tensor:
    """y = x @ W^T for a block of rows of x on bf16 tensor cores (16 rows per program); x [T, K], y [T, N].
    x is bf16 on a GPU (float32 allowed under the interpreter)."""
    t, k = x.shape
    if w.groups_per_row % split:
        raise ValueError(f"qgemm_rows_bf16: {split} K-splits do not tile {w.groups_per_row} groups")
    use_asm = native_dp4a() and x.dtype == torch.bfloat16
    if not use_asm and x.is_cuda and x.dtype != torch.float32:
        x = x.float()  # plain conversions: codes and x meet as float32 (fp16 x would round codes' products)
    target = split_partials(y, split)
    bits = w.fmt.bits
    code = w.base.view(torch.int8) if bits == 8 else w.base.view(torch.uint8)
    high = w.base if w.high is None else (w.high.view(torch.int16) if bits == 6 else w.high)
    _qgemm_rows_bf16_kernel[(triton.cdiv(w.rows, block_n), split, triton.cdiv(t, 16))](
        x, code, high, w.scale, target, t, w.rows, k, x.stride(0), w.groups_per_row // split,
        GPR=w.groups_per_row, K_PAD=w.k_pad, BITS=bits, GROUP=w.fmt.group_size,
        HIGH_BYTES=w.fmt.high_bytes_per_group, BLOCK_T=16, BLOCK_N=block_n, USE_ASM=use_asm, PREFETCH=prefetch,
        num_warps=num_warps, num_stages=num_stages, **LAUNCH)
    return finish_splits(target, y)


def qgemm_rows_bf16_reference(x: torch.Tensor, w) -> torch.Tensor:
    """The exact product in float32 (weights dequantized by the torch unpacker), rounded to x's dtype."""
    from .qlinear import qlinear_reference

    return qlinear_reference(x, w)

