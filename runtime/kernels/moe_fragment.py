"""The MoE decode's expert products (1-16 tokens) over routed experts laid out in fragment order.

Why: the dp4a expert GEMV (moe.expert_gemv) reads each (token, expert) pair's weights at 0.30-0.38 of copy for one
token and ~0.53 for 8 (bench/RESULTS.md §2, H100): it quantizes x in every program and its row-major tiles send L2
many short requests. Here each expert's slice of the stacked matrix is in fragment order (qgemm_fragment_layout:
a warp's chunk load is one 2,048-byte run) and every pair is a one-column product on the tensor cores, the
fragment-order kernel's group product over its own x row. Two launches a MoE layer, as before:

- gate/up: a program takes 16-row block b of an expert's gate rows and block b of its up rows (the expert's
  2 * inter rows are [gate; up]) and stores silu(gate) * up, so the down launch reads x as it is; each program
  routes its token itself from the router's logits and the first program of each pair writes the expert id (of each
  token's first pair, the token's weights): moe._routed_expert, as moe.expert_gemv does.
- down: a program takes BW 16-row blocks of its pair's expert; K (inter) is a few chunks, so one split.

Expert-major (2+ tokens, the experts routed beforehand by moe.route): only the first pair of each expert does work,
multiplying the expert with every token that picked it, one x column each (the mma's 8 columns, two tiles past 8
tokens), and storing each column to its pair's row; the other pairs' programs exit. An expert that several lanes
(or a verify block's rows) picked is read once, and no program spends its start on a top-k of its own.

The shared expert (any format the dp4a GEMV takes, its rows those of one routed expert) rides in both launches on
the dp4a tile path (moe._expert_rows), in the same row slices as the routed programs; its programs come first (a
tile quantizing x takes longer than a fragment share), its output rows after the routed pairs'.
The output rows are those of moe.expert_gemv: pair (t, j) at row t * k + j, then the shared rows, ready for
moe.ExpertPartials (the next RMSNorm combines them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..switches import setting
from . import interpreted, torch_path, tuning_from_env
from .launch import LAUNCH, pdl_wait
from .moe import _expert_rows, _routed_expert, route_reference
from .qgemm_fragment_layout import (CHUNK, HINTS, FragmentPlanes, _chunk_addresses, _chunk_load_asm, _chunk_loop,
                                    _load_chunk, _store_program, _store_swiglu, _sum_warp_shares, _swiglu_shares)
from .qgemm_rows_frag import _compute_asm, aligned_rows
from .qgemv_int8 import INT8_BITS, code_words, high_plane, native_dp4a
from .qlinear import GEMV_PATH, PackedLinear
from .swiglu import swiglu_reference

# Expert products in fragment order for MoE decode (the engine lays the routed experts' planes out at load). auto:
# on a GPU engine of several rows a step (lanes, speculation). H100, session 38, 35B-A3B at 8K (bench/RESULTS.md
# section 2): 2 / 4 / 8 lanes 2.76 / 2.94 / 3.59 ms a step against 3.25 / 3.99 / 5.52 on the dp4a pair (every lane
# routed alike; each its own token: 2.77 / 2.97 / 3.67 against 3.05 / 3.77 / 5.27), one lane 2.24-2.31 against
# 2.21, so a one-lane engine keeps the dp4a pair. on: every engine; off: never.
MOE_FRAGMENT = setting("NINFER_MOE_FRAGMENT")
MOE_FRAGMENT_OBJECTS = ("moe/experts_gate_up", "moe/experts_down")
# gate_ks: warps sharing K of each gate/up block pair (program: 2 x gate_ks warps); down_bw: 16-row blocks a down
# program takes (one warp each); hint: the code loads' cache hint (qgemm_rows_frag.HINTS).
# side-by-side runs: NINFER_MOE_FRAGMENT_TILE=gate_ks,down_bw,hint[,expert_major[,down_major]]
# expert_major: from this many tokens on, the launches go expert by expert (see the module; 0: never);
# down_major: from this many tokens the down launch does too (else pair by pair over the routed pairs; 0: never).
# Session 39 (H100, one layer, 8 tokens of random routing): down expert-major 23.4 us against 19.3 pair by pair,
# gate/up 34.0 against 42.7; with every token picking the same experts down 9.7 against 15.6 — kept at 2 until an
# engine run decides
MOE_FRAGMENT_TUNING = tuning_from_env("NINFER_MOE_FRAGMENT_TILE",
                                      ("gate_ks", "down_bw", "hint", "expert_major", "down_major"),
                                      {"gate_ks": 2, "down_bw": 4, "hint": 2, "expert_major": 2, "down_major": 2})
MAX_TOKENS = 16


def fragment_experts_supported(w, rows_per_expert: int, paired: bool) -> bool:
    """Whether a stacked expert matrix in fragment order (pair order, or Q5 fields) can take these launches: whole
    16-row blocks per expert (gate/up: 32, so the gate and up halves split at a block), K whole 512-lane chunk
    pairs."""
    fp = w.fragment
    return (isinstance(fp, FragmentPlanes) and (fp.pairs or fp.fields) and fp.fmt.bits in (4, 5)
            and rows_per_expert % (32 if paired else 16) == 0 and fp.rows % rows_per_expert == 0
            and (fp.groups // CHUNK) % 2 == 0)


def shared_rides(shared, rows_per_expert: int, cols: int) -> bool:
    """Whether the shared expert's matrix rides in the fragment launches (the dp4a tile path): a PackedLinear in
    row-split planes of a format the dp4a GEMV takes, one routed expert's shape."""
    return (isinstance(shared, PackedLinear) and shared.fragment is None and shared.fmt.bits in INT8_BITS
            and GEMV_PATH == "int8" and shared.rows == rows_per_expert and shared.cols == cols)


@triton.jit
def _pinned_thread_ids(like):
    """%tid.x per element, as qgemm_rows_frag._thread_ids but not pure, so the compiler may not rematerialize it in
    another layout (element i on another thread would read that thread's id). Session 37's wrong numbers on the H100
    came with pure ids; with these (and HAS_SHARED) every launch is right there (session 38), pure ones not retried."""
    return tl.inline_asm_elementwise("mov.u32 $0, %tid.x;", "=r,r", [like], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _expert_share(xa0, xa1, codes_ptr, high_ptr, scales_ptr, tid, zero, local, G: tl.constexpr, BLOCKS: tl.constexpr,
                  BW: tl.constexpr, KS: tl.constexpr, BITS: tl.constexpr, LOAD_ASM: tl.constexpr,
                  COMPUTE_ASM: tl.constexpr, SWIGLU: tl.constexpr):
    """One program's accumulators over its expert (the planes' pointers at the expert): blocks as the fragment-order
    kernel's program `local` of one split (SWIGLU: gate block `local` and its up block); xa0 / xa1 each thread's
    x addresses for its columns g and g + 8."""
    chunks: tl.constexpr = G // 4
    ca, sa, ha, first, count = _chunk_addresses(codes_ptr, scales_ptr, high_ptr, tid, local, 0, BLOCKS, chunks, G,
                                                BW, KS, SWIGLU, BITS)
    c0 = _load_chunk(ca, sa, ha, 0, zero < count, BITS, LOAD_ASM)
    c1 = _load_chunk(ca, sa, ha, 1, zero + 1 < count, BITS, LOAD_ASM)
    f = tl.zeros([32 * BW * KS], tl.float32)
    acc = (f, f, f, f, f, f, f, f)
    return _chunk_loop(acc, c0, c1, ca, sa, ha, zero, count, first, xa0, xa1, chunks // KS, chunks - 1, BITS,
                       LOAD_ASM, COMPUTE_ASM)


@triton.jit
def _expert_columns(experts_ptr, q, e, PAIRS, BLOCK_P: tl.constexpr):
    """The pairs that picked expert e (each token picks it at most once; pairs are in token order): whether pair
    q is the first of them (its programs multiply e for all), their count, and the pair of each of 16 columns."""
    p = tl.arange(0, BLOCK_P)
    hit = tl.load(experts_ptr + p, mask=p < PAIRS, other=-1) == e
    owner = tl.min(tl.where(hit, p, BLOCK_P), axis=0) == q
    rank = tl.cumsum(hit.to(tl.int32), axis=0) - 1
    n = tl.arange(0, 16)
    col_pair = tl.sum(tl.where(hit[None, :] & (rank[None, :] == n[:, None]), p[None, :], 0), axis=1)
    return owner, tl.sum(hit.to(tl.int32), axis=0), col_pair


@triton.jit
def _column_pair(col_pair, n):
    """col_pair [16] at each element of n (0 past the columns: a valid row)."""
    j = tl.arange(0, 16)
    out = n * 0
    for i in tl.static_range(16):  # elementwise over n: n keeps its layout (a 2-D lookup let the x addresses'
        out = tl.where(n == i, tl.sum(tl.where(j == i, col_pair, 0), axis=0), out)  # threads move, session 38)
    return out


@triton.jit
def _store_columns(out_ptr, acc, N, row0, c, col_pair, cols, NT: tl.constexpr):
    """qgemm_rows_frag._store_rows with column n stored to out row col_pair[n] (n < cols): accumulator i of a thread
    is row row0 + 8 * ((i % 4) // 2), column 2c + i % 2 + 8 * (i // 4)."""
    a0, a1, a2, a3, a4, a5, a6, a7 = acc
    ty = out_ptr.dtype.element_ty
    n0 = 2 * c
    ok0 = row0 < N
    ok1 = row0 + 8 < N
    r0 = _column_pair(col_pair, n0).to(tl.int64) * N + row0
    r1 = _column_pair(col_pair, n0 + 1).to(tl.int64) * N + row0
    tl.store(out_ptr + r0, a0.to(ty), mask=ok0 & (n0 < cols))
    tl.store(out_ptr + r1, a1.to(ty), mask=ok0 & (n0 + 1 < cols))
    tl.store(out_ptr + r0 + 8, a2.to(ty), mask=ok1 & (n0 < cols))
    tl.store(out_ptr + r1 + 8, a3.to(ty), mask=ok1 & (n0 + 1 < cols))
    if NT == 2:
        r8 = _column_pair(col_pair, n0 + 8).to(tl.int64) * N + row0
        r9 = _column_pair(col_pair, n0 + 9).to(tl.int64) * N + row0
        tl.store(out_ptr + r8, a4.to(ty), mask=ok0 & (n0 + 8 < cols))
        tl.store(out_ptr + r9, a5.to(ty), mask=ok0 & (n0 + 9 < cols))
        tl.store(out_ptr + r8 + 8, a6.to(ty), mask=ok1 & (n0 + 8 < cols))
        tl.store(out_ptr + r9 + 8, a7.to(ty), mask=ok1 & (n0 + 9 < cols))


@triton.jit
def _store_expert(out_ptr, acc, local, N, col_pair, cols, BW: tl.constexpr, KS: tl.constexpr, NT: tl.constexpr,
                  SWIGLU: tl.constexpr):
    """An expert-major program's accumulators to its columns' pair rows (_store_columns): SWIGLU as _store_swiglu,
    else as _store_program (the KS warps sharing each block's K summed first)."""
    if SWIGLU:
        y = _swiglu_shares(acc, KS, out_ptr.dtype.element_ty)
        threads = tl.arange(0, 32)
        _store_columns(out_ptr, y, N, local * 16 + threads // 4, threads % 4, col_pair, cols, NT)
    else:
        acc = _sum_warp_shares(acc, BW, KS)
        slot = tl.arange(0, 32 * BW)
        _store_columns(out_ptr, acc, N, (local * BW + slot // 32) * 16 + (slot % 32) // 4, slot % 4, col_pair, cols,
                       NT)


@triton.jit
def _moe_fragment_kernel(x_ptr, codes_ptr, high_ptr, scales_ptr, out_ptr, experts_ptr, logits_ptr, weights_ptr,
                         s_base_ptr, s_high_ptr, s_scale_ptr, N, K, E, stride_x, stride_logits, ROUTED, SHARED,
                         PROGRAMS_PER_PAIR, EXPERT_CODES, EXPERT_SCALES, EXPERT_HIGH,
                         G: tl.constexpr, BLOCKS: tl.constexpr, BW: tl.constexpr, KS: tl.constexpr,
                         BITS: tl.constexpr, LOAD_ASM: tl.constexpr, COMPUTE_ASM: tl.constexpr, SWIGLU: tl.constexpr,
                         TOPK: tl.constexpr, ROUTE: tl.constexpr, BLOCK_E: tl.constexpr,
                         S_GPR: tl.constexpr, S_K_PAD: tl.constexpr, S_BITS: tl.constexpr, S_GROUP: tl.constexpr,
                         S_HIGH_BYTES: tl.constexpr, S_BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr,
                         HAS_SHARED: tl.constexpr, EXPERT_MAJOR: tl.constexpr, NT: tl.constexpr,
                         BLOCK_P: tl.constexpr):
    """Program pid: slot pid // PROGRAMS_PER_PAIR, its share pid % PROGRAMS_PER_PAIR. Slots 0..SHARED-1 are the
    shared expert's rows of token t (their programs take longest, so they start first), slot SHARED + p routed
    pair p; out row p (p < ROUTED) and ROUTED + t. SWIGLU (the gate/up launch): pair p reads x row p // TOPK (its
    token), the shared row of token t row t, and out rows are silu(gate) * up (N = inter); else (the down launch)
    out row r reads x row r and is the product (N = the hidden width). ROUTE: routed programs take their token's
    top-k from the router's logits (see the module)."""
    pdl_wait()  # the expert ids come from the router's product: nothing to fetch before
    pid = tl.program_id(0)
    slot = pid // PROGRAMS_PER_PAIR
    local = pid % PROGRAMS_PER_PAIR
    ty: tl.constexpr = out_ptr.dtype.element_ty
    pair = slot - SHARED
    zero = tl.zeros([32 * BW * KS], tl.int32)
    if slot >= SHARED and EXPERT_MAJOR:  # the first pair of each expert multiplies it for every token that picked it
        expert = tl.load(experts_ptr + pair)
        owner, cols, col_pair = _expert_columns(experts_ptr, pair, expert, ROUTED, BLOCK_P)
        if owner:
            tid = _pinned_thread_ids(zero)
            g = (tid % 32) // 4  # the thread's x columns: g and g + 8
            x0 = _column_pair(col_pair, g)  # pair rows (the down launch's x rows); gate/up reads their tokens' rows
            x1 = _column_pair(col_pair, g + 8)
            if SWIGLU:
                x0 = x0 // TOPK
                x1 = x1 // TOPK
            xa0 = (x_ptr + x0.to(tl.int64) * stride_x + (tid % 4) * 16).to(tl.int64, bitcast=True)
            xa1 = (x_ptr + x1.to(tl.int64) * stride_x + (tid % 4) * 16).to(tl.int64, bitcast=True)
            e = expert.to(tl.int64)
            acc = _expert_share(xa0, xa1, codes_ptr + e * EXPERT_CODES, high_ptr + e * EXPERT_HIGH,
                                scales_ptr + e * EXPERT_SCALES, tid, zero, local, G, BLOCKS, BW, KS, BITS, LOAD_ASM,
                                COMPUTE_ASM, SWIGLU)
            _store_expert(out_ptr, acc, local, N, col_pair, cols, BW, KS, NT, SWIGLU)
    elif slot >= SHARED:
        if ROUTE:
            expert = _routed_expert(logits_ptr, experts_ptr, weights_ptr, pair, E, stride_logits, local == 0, TOPK,
                                    BLOCK_E)
        else:
            expert = tl.load(experts_ptr + pair)
        if SWIGLU:
            x_row = pair // TOPK
        else:
            x_row = pair
        e = expert.to(tl.int64)
        tid = _pinned_thread_ids(zero)
        xa = (x_ptr + x_row * stride_x + (tid % 4) * 16).to(tl.int64, bitcast=True)  # one column: all read the pair's x
        acc = _expert_share(xa, xa, codes_ptr + e * EXPERT_CODES, high_ptr + e * EXPERT_HIGH,
                            scales_ptr + e * EXPERT_SCALES, tid, zero, local, G, BLOCKS, BW, KS, BITS, LOAD_ASM,
                            COMPUTE_ASM, SWIGLU)
        out_pair = out_ptr + pair.to(tl.int64) * N
        if SWIGLU:
            _store_swiglu(out_pair, acc, local, 1, N, KS, 1)
        else:
            _store_program(out_pair, acc, local, 0, 1, N, BW, KS, 1)
    elif HAS_SHARED:  # the shared expert's rows of this share, on the dp4a tile path (compiled only with one)
        row = ROUTED + slot
        if SWIGLU:  # gate rows and their up rows in one tile (a [32, S_BLOCK_K] step)
            i = tl.arange(0, 32)
            out_rows = local * 16 + i % 16
            ok = out_rows < N
            y = _expert_rows(x_ptr + slot * stride_x, s_base_ptr, s_high_ptr, s_scale_ptr, out_rows + (i // 16) * N,
                             ok, K, S_GPR, S_K_PAD, S_BITS, S_GROUP, S_HIGH_BYTES, 32, S_BLOCK_K, True, USE_ASM, False)
            g, u = tl.split(tl.permute(tl.reshape(y.to(ty).to(tl.float32), (2, 16)), (1, 0)))
            rows = local * 16 + tl.arange(0, 16)
            tl.store(out_ptr + row.to(tl.int64) * N + rows, (g * tl.sigmoid(g) * u).to(ty), mask=rows < N)
        else:
            rows = local * (16 * BW) + tl.arange(0, 16 * BW)
            ok = rows < N
            y = _expert_rows(x_ptr + row * stride_x, s_base_ptr, s_high_ptr, s_scale_ptr, rows, ok, K, S_GPR,
                             S_K_PAD, S_BITS, S_GROUP, S_HIGH_BYTES, 16 * BW, S_BLOCK_K, True, USE_ASM, False)
            tl.store(out_ptr + row.to(tl.int64) * N + rows, y.to(ty), mask=ok)


def fragment_expert_gemv(x: torch.Tensor, experts: torch.Tensor, w, rows_per_expert: int, top_k: int,
                         gate_up: bool, shared=None,
                         route_into: tuple[torch.Tensor, torch.Tensor] | None = None,
                         expert_major: bool = False) -> torch.Tensor:
    """The MoE decode's two expert launches over routed experts in fragment order (see the module). gate_up: x is
    the layer's rows h [T, H], pair p (p < T * top_k) multiplies expert experts[p]'s [gate; up] rows with x row
    p // top_k and the result is silu(gate) * up [T * top_k (+ T), rows_per_expert / 2]; else x is that result
    and pair p multiplies its own row with expert experts[p]'s down rows: [T * top_k (+ T), rows_per_expert].
    `shared` (shared_rides): the shared expert's matrix, its rows after the routed pairs' (gate/up: x row t; down:
    x row T * top_k + t). `route_into` = (router logits [T, E], weights [T, top_k] float32), gate/up only: the
    launch routes, writing `experts` ([T * top_k] int32) and the weights as moe.route would. `expert_major` (the
    experts given, not routed here): the first pair of each expert multiplies it for every token that picked it,
    one x column each, so an expert that several tokens picked is read once (the same numbers)."""
    pairs = experts.numel()
    if expert_major and route_into is not None:
        raise ValueError("fragment_expert_gemv: expert_major takes the experts routed beforehand (moe.route)")
    tokens = x.shape[0] if gate_up else (x.shape[0] - pairs if shared is not None else 0)
    if shared is not None and not shared_rides(shared, rows_per_expert, x.shape[1]):
        raise ValueError("fragment_expert_gemv: the shared expert's matrix is not one routed expert's shape in a "
                         "format the dp4a GEMV takes")
    if not fragment_experts_supported(w, rows_per_expert, gate_up):
        raise ValueError(f"fragment_expert_gemv: [{w.rows}, {w.cols}] is not a stack of {rows_per_expert}-row "
                         "experts in fragment order (pair order, Q4/Q5, whole blocks)")
    if not 1 <= (x.shape[0] if gate_up else pairs // top_k) <= MAX_TOKENS:
        raise ValueError(f"fragment_expert_gemv: {x.shape[0]} rows (1-{MAX_TOKENS} tokens)")
    n_out = rows_per_expert // 2 if gate_up else rows_per_expert
    extra = tokens if shared is not None else 0
    if torch_path(x) or interpreted() and x.dtype != torch.bfloat16:  # (the interpreter's engines run float32)
        return _reference(x, experts, w, rows_per_expert, top_k, gate_up, shared, route_into)
    if x.dtype != torch.bfloat16:
        raise ValueError(f"fragment_expert_gemv: x is {x.dtype} (the tensor-core group product takes bf16)")
    fp = w.fragment
    y = torch.empty(pairs + extra, n_out, dtype=x.dtype, device=x.device)
    if gate_up:
        bw, ks = 2, MOE_FRAGMENT_TUNING["gate_ks"]
    else:
        bw, ks = MOE_FRAGMENT_TUNING["down_bw"], 1
    if ks not in (1, 2, 4) or bw not in (1, 2, 4, 8):
        raise SystemExit(f"ninfer: NINFER_MOE_FRAGMENT_TILE: gate_ks {ks} (1, 2 or 4), down_bw {bw} (1, 2, 4 or 8); "
                         "unset it for the defaults")
    chunks = fp.groups // CHUNK
    while chunks % (2 * ks):  # every warp's share an even count of chunks (the loop steps two)
        ks //= 2
    blocks = rows_per_expert // 16
    programs = blocks // 2 if gate_up else triton.cdiv(blocks, bw)
    s = shared if shared is not None else w
    s_planes = [code_words(s.base), high_plane(s), s.scale] if shared is not None else [fp.codes, fp.codes, fp.scales]
    s_block_k = min(1024, s.k_pad) if shared is not None else 64  # few K steps: the shared rows are the tail
    while shared is not None and s.k_pad % s_block_k:
        s_block_k //= 2
    x = aligned_rows(x)
    logits, weights = route_into if route_into is not None else (experts, experts)  # unread without routing
    if route_into is not None and (not gate_up or logits.stride(1) != 1 or not weights.is_contiguous()
                                   or not experts.is_contiguous()):
        raise ValueError("fragment_expert_gemv: routing (gate/up only) needs logits rows with unit column stride, "
                         "contiguous weights and expert ids")
    per_row = rows_per_expert * fp.groups
    high = fp.high if fp.high is not None else fp.codes
    high_per_row = 8 if fp.fmt.bits == 5 else 0
    columns = 2 if expert_major and pairs // top_k > 8 else 1  # x's 8-column tiles (an expert's tokens)
    _moe_fragment_kernel[((pairs + extra) * programs,)](
        x, fp.codes, high, fp.scales, y, experts if route_into is not None else experts.contiguous(), logits, weights,
        *s_planes, n_out, x.shape[1], logits.shape[1] if route_into is not None else 0,
        x.stride(0), logits.stride(0) if route_into is not None else 0, pairs, extra, programs,
        per_row * 32, per_row, per_row * high_per_row,
        G=fp.groups, BLOCKS=blocks, BW=bw, KS=ks, BITS=fp.fmt.bits,
        LOAD_ASM=_chunk_load_asm(fp.fmt.bits, HINTS[MOE_FRAGMENT_TUNING["hint"]]),
        COMPUTE_ASM=_compute_asm(fp.fmt.bits, columns, words=True, pairs=True, fields=fp.fields),
        SWIGLU=gate_up, TOPK=top_k,
        ROUTE=route_into is not None, BLOCK_E=triton.next_power_of_2(logits.shape[1]) if route_into is not None else 1,
        S_GPR=s.groups_per_row, S_K_PAD=s.k_pad, S_BITS=s.fmt.bits, S_GROUP=s.fmt.group_size,
        S_HIGH_BYTES=s.fmt.high_bytes_per_group, S_BLOCK_K=s_block_k, USE_ASM=native_dp4a(),
        HAS_SHARED=shared is not None, EXPERT_MAJOR=expert_major, NT=columns,
        BLOCK_P=triton.next_power_of_2(pairs), num_warps=bw * ks, **LAUNCH)
    return y


def _reference(x, experts, w, rows_per_expert, top_k, gate_up, shared, route_into):
    """The torch path (also the interpreter's float32 engines, where moe.expert_gemv would take its kernel): routing
    as moe.route, each pair's exact product over the dequantized experts, the shared expert's rows after the
    pairs', then SwiGLU for gate/up."""
    if route_into is not None:
        ids, weights = route_reference(route_into[0], top_k)
        experts.copy_(ids.reshape(-1))
        route_into[1].copy_(weights)
    pairs = experts.numel()
    dense = w.dense()
    x_rows = torch.arange(pairs) // top_k if gate_up else torch.arange(pairs)
    out = [x[x_rows[p]].float() @ dense[int(e) * rows_per_expert:(int(e) + 1) * rows_per_expert].t()
           for p, e in enumerate(experts.tolist())]
    if shared is not None:
        out += list(x.float()[0 if gate_up else pairs:] @ shared.dense().t())
    y = torch.stack(out).to(x.dtype)
    return swiglu_reference(y) if gate_up else y
