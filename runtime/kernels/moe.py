"""MoE routing (softmax over all experts, top-k, renormalized), the expert GEMV over (token, expert)
pairs for decode and verify blocks, and the grouped expert GEMM for prefill chunks. All stay on the
device (no host sync), so a MoE decode step can be captured in a CUDA graph.

Prefill: the (token, expert) pairs are sorted by expert and each expert's run is padded to whole
BLOCK_M-row blocks; one launch per matrix runs every block against its expert's weights (dequantized
in registers, tensor-core dots), and one more weighs and sums each token's k outputs. The per-expert
loop it replaces synced the host for every active expert and launched ~8 kernels per expert: ~80K
launches per 8K-token chunk of the 35B-A3B (the run record (`git show 5d8956c:bench/RESULTS.md`) §7: prefill 0.44x transformers).

Long prefill chunks (at least DENSE_EXPERTS_MIN_PAIRS pairs per expert on average) take another path:
the sorted pairs' rows are gathered once, every expert's weights are dequantized to bf16 in chunks of
experts (the dense prefill GEMM's scratch) and torch's grouped GEMM multiplies each chunk's rows. The
fused kernel above dequantizes an expert's weights once per 32-row block, which left it at ~44 TFLOPS
on the H200 (§17); one host sync per layer (the experts' row bounds) is cheap at that length."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..memory_plan import MOE_BLOCK_ROWS, moe_dense_chunk_rows
from ..switches import setting
from .qgemv_int8 import INT8_BITS, _dot_rows_int8, _weight_tile, code_words, high_plane, native_dp4a
from .qlinear import (FRAGMENT_ORDERS, GEMM_DEQUANT_BYTES, GEMV_PATH, VEC_TUNING, PackedLinear, _dequant_block_dot,
                      _dot_rows, dequantize_rows)
from . import torch_path, tuning_from_env
from .launch import LAUNCH, pdl_wait
from .swiglu import swiglu as swiglu_rows


# The routing's top-k in one reduction a pick over int64 keys (score bits, expert index) instead of two: the 35B's
# gate/up launch at one token 8.8 -> 8.3 µs on an H100 (session 43). NINFER_TOPK_KEYED=0 restores two reductions.
_TOPK_KEYED = tl.constexpr(setting("NINFER_TOPK_KEYED") == "1")


@triton.jit
def _top_k(logits_ptr, t, E, stride_t, TOPK: tl.constexpr, BLOCK_E: tl.constexpr):
    """Token t's routing: (expert ids [TOPK] int32, weights [TOPK] float32 summing to 1)."""
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    logit = tl.load(logits_ptr + t * stride_t + e, mask=ok, other=float("-inf")).to(tl.float32)
    p = tl.exp(logit - tl.max(logit, axis=0))
    p = tl.where(ok, p / tl.sum(p, axis=0), -1.0)
    k = tl.arange(0, TOPK)
    picked_ids = tl.zeros((TOPK,), dtype=tl.int32)
    picked = tl.zeros((TOPK,), dtype=tl.float32)
    if _TOPK_KEYED:
        # one reduction a pick (each a cross-warp round trip, and every expert-GEMV program routes before it can load
        # a weight): a float32 >= 0 orders as its bits do, so (bits << 32 | BLOCK_E - 1 - e) as int64 orders by
        # probability, then by the lowest index among ties, like torch.topk; -1.0 (no expert) sorts below every p
        key = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - e).to(tl.int64)
        for j in tl.static_range(TOPK):
            top = tl.max(key, axis=0)
            idx = (BLOCK_E - 1 - (top & 0xFFFFFFFF)).to(tl.int32)
            best = (top >> 32).to(tl.int32).to(tl.float32, bitcast=True)
            picked_ids = tl.where(k == j, idx, picked_ids)
            picked = tl.where(k == j, best, picked)
            key = tl.where(e == idx, -1, key)
    else:  # two reductions a pick: the value, then the lowest index holding it (the default until timed)
        for j in tl.static_range(TOPK):
            best = tl.max(p, axis=0)
            idx = tl.min(tl.where(p == best, e, BLOCK_E), axis=0)
            picked_ids = tl.where(k == j, idx, picked_ids)
            picked = tl.where(k == j, best, picked)
            p = tl.where(e == idx, -1.0, p)
    return picked_ids, picked / tl.sum(picked, axis=0)


@triton.jit
def _routed_expert(logits_ptr, experts_ptr, weights_ptr, pair, E, stride_t, writes, TOPK: tl.constexpr,
                   BLOCK_E: tl.constexpr):
    """Pair `pair`'s expert (pair t * TOPK + j: token t's j-th pick), its token routed in the program (_top_k, no
    launch of its own); where `writes` (one program of the pair) the id goes to experts_ptr and, for the token's
    pair 0, the token's weights to weights_ptr."""
    token = pair // TOPK
    ids, weights = _top_k(logits_ptr, token, E, stride_t, TOPK, BLOCK_E)
    kk = tl.arange(0, TOPK)
    expert = tl.sum(tl.where(kk == pair % TOPK, ids, 0), axis=0)
    if writes:
        tl.store(experts_ptr + pair, expert)
        if pair % TOPK == 0:
            tl.store(weights_ptr + token * TOPK + kk, weights)
    return expert


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, weights_ptr, E, stride_t, TOPK: tl.constexpr, BLOCK_E: tl.constexpr):
    pdl_wait()
    t = tl.program_id(0)
    ids, weights = _top_k(logits_ptr, t, E, stride_t, TOPK, BLOCK_E)
    k = tl.arange(0, TOPK)
    tl.store(ids_ptr + t * TOPK + k, ids)
    tl.store(weights_ptr + t * TOPK + k, weights)


def route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (rows may be strided: the router's columns of a wider product) -> (expert ids
    [T, k] int32, weights [T, k] float32 summing to 1)."""
    if torch_path(router_logits):
        return route_reference(router_logits, top_k)
    t, e = router_logits.shape
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    ids = torch.empty(t, top_k, dtype=torch.int32, device=router_logits.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=router_logits.device)
    _route_kernel[(t,)](router_logits, ids, weights, e, router_logits.stride(0), TOPK=top_k,
                        BLOCK_E=triton.next_power_of_2(e), **LAUNCH)
    return ids, weights


def route_reference(router_logits, top_k):
    probs = torch.softmax(router_logits.float(), dim=-1)
    w, idx = torch.topk(probs, top_k, dim=-1)
    return idx.int(), w / w.sum(-1, keepdim=True)


@triton.jit
def _expert_rows(x_ptr, base_ptr, high_ptr, scale_ptr, rows, ok, K, GPR: tl.constexpr, K_PAD: tl.constexpr,
                 BITS: tl.constexpr, GROUP: tl.constexpr, HIGH_BYTES: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, INT8: tl.constexpr, USE_ASM: tl.constexpr, SWIGLU: tl.constexpr):
    """W[rows] @ x -> [BLOCK_N] float32, one GEMV tile of a packed matrix (SWIGLU: x = SwiGLU of a gate/up row,
    dp4a path only)."""
    if INT8:
        # expert matrices are small: each program quantizes its row of x (no extra launch)
        words, high, w_scale = _weight_tile(base_ptr, high_ptr, scale_ptr, rows, ok[:, None], 0, GPR, K_PAD, BITS,
                                            GROUP, HIGH_BYTES, BLOCK_K)
        y = _dot_rows_int8(x_ptr, base_ptr, high_ptr, scale_ptr, rows, ok, K, 0, K_PAD, words, high, w_scale, GPR,
                           K_PAD, BITS, GROUP, HIGH_BYTES, BLOCK_N, BLOCK_K, USE_ASM, False, SWIGLU)
    else:
        y = _dot_rows(x_ptr, base_ptr, high_ptr, scale_ptr, rows, ok, K, 0, K_PAD, GPR, K_PAD, BITS, GROUP, HIGH_BYTES,
                      BLOCK_N, BLOCK_K)
    return y


@triton.jit
def _expert_gemv_kernel(x_ptr, x_rows_ptr, experts_ptr, base_ptr, high_ptr, scale_ptr, s_base_ptr, s_high_ptr,
                        s_scale_ptr, y_ptr, ROWS_PER_EXPERT, K, stride_x, SHARED_FROM, SHARED_X0,
                        logits_ptr, weights_ptr, E, stride_logits,
                        GPR: tl.constexpr, K_PAD: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                        HIGH_BYTES: tl.constexpr, INT8: tl.constexpr, S_GPR: tl.constexpr, S_K_PAD: tl.constexpr,
                        S_BITS: tl.constexpr, S_GROUP: tl.constexpr, S_HIGH_BYTES: tl.constexpr,
                        S_INT8: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr,
                        PAIRS_PER_X_ROW: tl.constexpr, SWIGLU: tl.constexpr, ROUTE: tl.constexpr,
                        BLOCK_E: tl.constexpr):
    """PAIRS_PER_X_ROW > 0: pair p reads x row p // PAIRS_PER_X_ROW (x_rows_ptr unread). ROUTE (decode: the
    pairs of token t are t * PAIRS_PER_X_ROW + j): each program routes its token itself from the router's logits
    (the route kernel's top-k, recomputed per program: no launch of its own), and the first program of each
    pair writes its expert id to experts_ptr, of each token's pair 0 the token's weights to weights_ptr. Pairs from
    SHARED_FROM on are the shared expert's (its own matrix s_*, in its own format S_*): pair p reads x row
    p - SHARED_FROM + SHARED_X0. SWIGLU: x's rows are gate/up projections (2K wide) and the product is taken
    with silu(gate) * up, as the SwiGLU kernel would have written it."""
    pdl_wait()
    pair = tl.program_id(0)
    local = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = local < ROWS_PER_EXPERT
    if pair >= SHARED_FROM:
        y = _expert_rows(x_ptr + (pair - SHARED_FROM + SHARED_X0) * stride_x, s_base_ptr, s_high_ptr, s_scale_ptr,
                         local, ok, K, S_GPR, S_K_PAD, S_BITS, S_GROUP, S_HIGH_BYTES, BLOCK_N, BLOCK_K, S_INT8,
                         USE_ASM, SWIGLU)
    else:
        if ROUTE:
            expert = _routed_expert(logits_ptr, experts_ptr, weights_ptr, pair, E, stride_logits,
                                    tl.program_id(1) == 0, PAIRS_PER_X_ROW, BLOCK_E)
        else:
            expert = tl.load(experts_ptr + pair)
        if PAIRS_PER_X_ROW > 0:
            x_row = pair // PAIRS_PER_X_ROW
        else:
            x_row = tl.load(x_rows_ptr + pair)
        y = _expert_rows(x_ptr + x_row * stride_x, base_ptr, high_ptr, scale_ptr, expert * ROWS_PER_EXPERT + local,
                         ok, K, GPR, K_PAD, BITS, GROUP, HIGH_BYTES, BLOCK_N, BLOCK_K, INT8, USE_ASM, SWIGLU)
    tl.store(y_ptr + pair * ROWS_PER_EXPERT + local, y.to(y_ptr.dtype.element_ty), mask=ok)


# The expert GEMV's tile on the dp4a path, per product and for one token's pairs ("/one": at most ONE_TOKEN_PAIRS)
# or more: an expert's matrices are small (35B-A3B: gate/up 1,024 x 2,048, down 2,048 x 512), so a program's
# share of the bytes is small and launch latency weighs; "down" quantizes SwiGLU of its x row in every program,
# which wide tiles amortize once several tokens fill the GPU. Picked by `bench/moe_decode_tiles.py` (H100, session
# 29, µs per launch over L2-cold experts, old tile 16 x 512 x 4 warps): gate/up 10.4 -> 8.7 at one token, 63.3 ->
# 40.3 at 8; down 6.8 -> 6.0 at one token, 33.2 -> 25.3 at 8.
ONE_TOKEN_PAIRS = 16
EXPERT_TUNING = {"gate_up": {"block_n": 32, "block_k": 1024, "num_warps": 4},
                 "gate_up/one": {"block_n": 32, "block_k": 1024, "num_warps": 4},
                 "down": {"block_n": 128, "block_k": 256, "num_warps": 4},
                 "down/one": {"block_n": 32, "block_k": 512, "num_warps": 8}}


def expert_tile_variable(product: str) -> str:
    """The environment variable that sets one of EXPERT_TUNING's tiles for side-by-side runs, e.g.
    NINFER_EXPERT_TILE_DOWN_ONE=32,512,8 (BLOCK_N,BLOCK_K,WARPS) for "down/one"."""
    return "NINFER_EXPERT_TILE_" + product.upper().replace("/", "_")


def load_expert_tiles() -> None:
    """EXPERT_TUNING updated from the environment (tuning_from_env); a tile size that is not a power of two
    (Triton's ranges need them) stops with a one-line error."""
    for product, tile in EXPERT_TUNING.items():
        name = expert_tile_variable(product)
        tuning_from_env(name, ("block_n", "block_k", "num_warps"), tile)
        if not all(n > 0 and n & (n - 1) == 0 for n in tile.values()):
            raise SystemExit(f"ninfer: {name}: {tile} has sizes that are not powers of two; unset it for the defaults")


load_expert_tiles()


def shared_fusable(experts: PackedLinear, shared, rows_per_expert: int) -> bool:
    """Whether the shared expert's matrix (a PackedLinear, or anything else) can ride in the routed experts'
    launch: the same width, one expert's rows, planes in row-split order (any grouped format)."""
    return (isinstance(shared, PackedLinear) and shared.cols == experts.cols and shared.rows == rows_per_expert
            and shared.fragment is None and experts.fragment is None)


def expert_gemv(x: torch.Tensor, x_rows: torch.Tensor | int, experts: torch.Tensor, w: PackedLinear,
                rows_per_expert: int, shared: PackedLinear | None = None, shared_x0: int = 0,
                swiglu: bool = False, route_into: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """For each pair p: y[p] = W[experts[p]] @ x[x_rows[p]], with W stacked expert-major
    ([E * rows_per_expert, K] packed); `x_rows` an int n: x row p // n (a decode step's k pairs per token
    are n = k; the down product's own rows n = 1), without an index tensor to build per step. With `shared`
    (the shared expert's matrix, any grouped format: shared_fusable), the same launch also multiplies it with
    x rows shared_x0, shared_x0 + 1, ... to the end of x, after the routed pairs. With `swiglu`, x's rows are
    gate/up projections [*, 2K] and each product takes silu(gate) * up (in the launch itself on the dp4a path:
    no SwiGLU launch). With `route_into` = (router logits [T, E], weights [T, k] float32) and x_rows = k, the
    launch routes too: `experts` ([T * k] int32, written) and the weights are filled as route() would (no route
    launch). Returns [pairs (+ shared rows), rows_per_expert] in x's dtype. Rows of x are quantized per
    group as in the dp4a GEMV (see qgemv_int8) unless NINFER_GEMV=float."""
    if route_into is not None and (torch_path(x) or not isinstance(x_rows, int)):  # route first, then multiply
        ids, weights = route(route_into[0], x_rows)
        experts.copy_(ids.reshape(-1))
        route_into[1].copy_(weights)
        return expert_gemv(x, x_rows, experts, w, rows_per_expert, shared, shared_x0, swiglu)
    routed = experts.numel()
    s = shared if shared is not None else w
    int8, s_int8 = (GEMV_PATH == "int8" and m.fmt.bits in INT8_BITS for m in (w, s))
    if swiglu and (torch_path(x) or not (int8 and s_int8)):  # SwiGLU first (the torch path, float GEMVs)
        return expert_gemv(swiglu_rows(x), x_rows, experts, w, rows_per_expert, shared, shared_x0,
                           route_into=route_into)
    if shared is not None and not shared_fusable(w, shared, rows_per_expert):
        raise ValueError("expert_gemv: the shared expert's matrix differs from one routed expert's")
    extra = x.shape[0] - shared_x0 if shared is not None else 0
    if torch_path(x):  # the exact products, as qlinear's torch path, one matrix product per expert in use
        rows = torch.arange(routed) // x_rows if isinstance(x_rows, int) else x_rows.long()
        experts = experts.reshape(-1).long()
        y = torch.empty(routed + extra, rows_per_expert, dtype=x.dtype)
        for e in experts.unique().tolist():
            sel = (experts == e).nonzero(as_tuple=True)[0]
            y[sel] = (x.float()[rows[sel]] @ w.dense()[e * rows_per_expert : (e + 1) * rows_per_expert].t()).to(x.dtype)
        if extra:
            y[routed:] = (x.float()[shared_x0:] @ shared.dense().t()).to(x.dtype)
        return y
    y = torch.empty(routed + extra, rows_per_expert, dtype=x.dtype, device=x.device)
    product = ("down" if swiglu else "gate_up") + ("/one" if routed + extra <= ONE_TOKEN_PAIRS else "")
    tuning = EXPERT_TUNING[product] if int8 else VEC_TUNING
    block_n, block_k = tuning["block_n"], tuning["block_k"]
    while w.k_pad % block_k or s.k_pad % block_k:
        block_k //= 2
    x = x.contiguous()
    planes = []
    for m, m_int8 in ((w, int8), (s, s_int8)):
        if m_int8:
            planes += [code_words(m.base), high_plane(m), m.scale]
        else:
            planes += [m.base, m.high if m.high is not None else m.base, m.scale]
    per_row = x_rows if isinstance(x_rows, int) else 0
    x_rows = experts if per_row else x_rows.contiguous()  # unread when per_row
    if route_into is None:
        experts = experts.contiguous()
    elif not experts.is_contiguous():
        raise ValueError("expert_gemv: the expert ids the launch writes must be contiguous")
    logits, weights = route_into if route_into is not None else (experts, experts)  # unread without routing
    if route_into is not None and (logits.stride(1) != 1 or not weights.is_contiguous()):
        raise ValueError("expert_gemv: routing needs logits rows with unit column stride and contiguous weights")
    _expert_gemv_kernel[(routed + extra, triton.cdiv(rows_per_expert, block_n))](
        x, x_rows, experts, *planes, y, rows_per_expert, w.cols, x.stride(0), routed, shared_x0,
        logits, weights, logits.shape[1] if route_into is not None else 0,
        logits.stride(0) if route_into is not None else 0,
        GPR=w.groups_per_row, K_PAD=w.k_pad, BITS=w.fmt.bits, GROUP=w.fmt.group_size,
        HIGH_BYTES=w.fmt.high_bytes_per_group, INT8=int8, S_GPR=s.groups_per_row, S_K_PAD=s.k_pad, S_BITS=s.fmt.bits,
        S_GROUP=s.fmt.group_size, S_HIGH_BYTES=s.fmt.high_bytes_per_group, S_INT8=s_int8, BLOCK_N=block_n,
        BLOCK_K=block_k, USE_ASM=native_dp4a(), PAIRS_PER_X_ROW=per_row, SWIGLU=swiglu, ROUTE=route_into is not None,
        BLOCK_E=triton.next_power_of_2(logits.shape[1]) if route_into is not None else 1,
        num_warps=tuning["num_warps"], **LAUNCH)
    return y


def expert_gemv_reference(x, x_rows, experts, w: PackedLinear, rows_per_expert):
    from .qgemv_int8 import qgemv_int8_reference
    from .qlinear import qlinear_reference

    if GEMV_PATH == "int8" and w.fmt.bits in INT8_BITS:  # the same 14-bit activations, row by row
        dense_out = qgemv_int8_reference(x, w).float()
    else:
        dense_out = qlinear_reference(x, w).float()  # [T, E * rows]
    if isinstance(x_rows, int):
        x_rows = torch.arange(experts.numel()) // x_rows
    out = [dense_out[int(r), int(e) * rows_per_expert:(int(e) + 1) * rows_per_expert] for r, e in zip(x_rows, experts)]
    return torch.stack(out).to(x.dtype)


# pair rows per block (the memory plan's, which counts the padding): padding costs E x (BLOCK_M - 1) rows, weight
# dequantization is repeated per block (35B-A3B at 8K: 256 pairs per expert on average, ~12 % padding at 32)
EXPERT_BLOCK_M = MOE_BLOCK_ROWS
# 3 pipeline stages: 25-45 KB of shared memory in every order the kernel reads (sm_90 allows 227 KB a block; Q5
# fields took 254 KB until session 45 gathered each thread's five words once, and every launch failed on the GPU)
EXPERT_GEMM_TILE = {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 3}


@triton.jit
def _expert_gemm_kernel(x_ptr, x_rows_ptr, block_experts_ptr, base_ptr, high_ptr, scale_ptr, y_ptr, ROWS_PER_EXPERT,
                        K, stride_x, GPR: tl.constexpr, K_PAD: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                        HIGH_BYTES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, FRAGMENT: tl.constexpr):
    """One block of sorted pair rows (all of one expert, or padding: expert -1, no work) x BLOCK_N of that
    expert's output rows. Row i of the block reads x row x_rows[i] (-1: padding: x and y rows are zeros)."""
    pdl_wait()
    block = tl.program_id(0)
    local = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    expert = tl.load(block_experts_ptr + block)
    slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
    x_row = tl.load(x_rows_ptr + slots)
    tok_ok = x_row >= 0
    row_ok = local < ROWS_PER_EXPERT
    rows = tl.maximum(expert, 0) * ROWS_PER_EXPERT + local
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_end = tl.where(expert >= 0, K_PAD, 0)  # padding blocks run no iterations
    for k0 in range(0, k_end, BLOCK_K):
        acc = _dequant_block_dot(acc, x_ptr, tl.maximum(x_row, 0) * stride_x, tok_ok, base_ptr, high_ptr, scale_ptr,
                                 rows, row_ok, k0, K, GPR, K_PAD, BITS, GROUP, HIGH_BYTES, BLOCK_N, BLOCK_K, FRAGMENT)
    out = y_ptr + slots[:, None] * ROWS_PER_EXPERT + local[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[None, :])  # padding rows: zeros


def expert_gemm(x: torch.Tensor, x_rows: torch.Tensor, block_experts: torch.Tensor, w: PackedLinear,
                rows_per_expert: int, block_m: int = EXPERT_BLOCK_M) -> torch.Tensor:
    """Sorted pair rows: y[i] = W[expert of i's block] @ x[x_rows[i]] (x_rows -1: padding, zeros),
    with W stacked expert-major ([E * rows_per_expert, K] packed) and block_experts[b] the expert of
    rows [b * block_m, (b + 1) * block_m) (-1: padding). Returns [len(x_rows), rows_per_expert]."""
    slots = x_rows.numel()
    if slots != block_experts.numel() * block_m:
        raise ValueError(f"expert_gemm: {slots} pair rows are not {block_experts.numel()} blocks of {block_m}")
    y = torch.empty(slots, rows_per_expert, dtype=x.dtype, device=x.device)
    block_n, block_k = EXPERT_GEMM_TILE["block_n"], EXPERT_GEMM_TILE["block_k"]
    while w.k_pad % block_k:
        block_k //= 2
    x = x.contiguous()
    base, high, scale, fragment = w.base, w.high, w.scale, 0
    if w.fragment is not None:  # experts in fragment order (moe_fragment's decode launches): read in place
        if w.fmt.bits == 6:
            raise ValueError("expert_gemm: Q6 experts in fragment order (the dequantizer reads Q6 there only through "
                             "a copy back: row_planes)")
        base, high, scale = w.fragment.codes, w.fragment.high, w.fragment.scales
        fragment = FRAGMENT_ORDERS[w.fragment.order]
    _expert_gemm_kernel[(block_experts.numel(), triton.cdiv(rows_per_expert, block_n))](
        x, x_rows, block_experts, base, high if high is not None else base, scale, y, rows_per_expert,
        w.cols, x.stride(0), GPR=w.groups_per_row, K_PAD=w.k_pad, BITS=w.fmt.bits, GROUP=w.fmt.group_size,
        HIGH_BYTES=w.fmt.high_bytes_per_group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        FRAGMENT=fragment, num_warps=EXPERT_GEMM_TILE["num_warps"], num_stages=EXPERT_GEMM_TILE["num_stages"],
        **LAUNCH)
    return y


def sort_pairs(ids: torch.Tensor, experts: int, block_m: int = EXPERT_BLOCK_M):
    """Expert ids [T, k] -> (x_rows [S] int32: the token of each sorted pair row, -1 for padding;
    block_experts [S / block_m] int32; slot [T, k] int64: where pair (t, j) landed). Pairs are grouped
    by expert (stable: in token order), each expert's run padded to whole blocks; S is the bound
    T * k + experts * (block_m - 1) rounded up to a block, so nothing here waits for the device."""
    t, k = ids.shape
    pairs = ids.reshape(-1).long()
    order = torch.argsort(pairs, stable=True)
    counts = torch.zeros(experts, dtype=torch.long, device=ids.device).scatter_add_(0, pairs, torch.ones_like(pairs))
    padded = (counts + block_m - 1) // block_m * block_m
    run_start = torch.cumsum(padded, 0) - padded
    sorted_experts = pairs[order]
    rank = torch.arange(t * k, device=ids.device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    sorted_slot = run_start[sorted_experts] + rank
    total = -(-(t * k + experts * (block_m - 1)) // block_m) * block_m
    x_rows = torch.full((total,), -1, dtype=torch.int32, device=ids.device)
    x_rows[sorted_slot] = (order // k).int()
    block_experts = torch.full((total // block_m,), -1, dtype=torch.int32, device=ids.device)
    block_experts[sorted_slot // block_m] = sorted_experts.int()
    slot = torch.empty(t * k, dtype=torch.long, device=ids.device)
    slot[order] = sorted_slot
    return x_rows, block_experts, slot.view(t, k)


@triton.jit
def _combine_kernel(y_ptr, slot_ptr, weights_ptr, shared_ptr, gate_ptr, out_ptr, H, gate_stride, TOPK: tl.constexpr,
                    SLOTS: tl.constexpr, GATED: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = sum_j weights[t, j] * y[slot[t, j]] + sigmoid(gate[t]) * shared[t], in float32 and j order;
    without SLOTS, pair (t, j) is y row t * TOPK + j; without GATED, the shared output counts whole."""
    pdl_wait()
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for j in tl.static_range(TOPK):
        if SLOTS:
            s = tl.load(slot_ptr + t * TOPK + j)
        else:
            s = t * TOPK + j
        w = tl.load(weights_ptr + t * TOPK + j).to(tl.float32)
        acc += w * tl.load(y_ptr + s * H + cols, mask=ok, other=0.0).to(tl.float32)
    shared = tl.load(shared_ptr + t * H + cols, mask=ok, other=0.0).to(tl.float32)
    if GATED:
        shared = shared * tl.sigmoid(tl.load(gate_ptr + t * gate_stride).to(tl.float32))
    tl.store(out_ptr + t * H + cols, (acc + shared).to(out_ptr.dtype.element_ty), mask=ok)


def combine_experts(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor, slot: torch.Tensor | None = None,
                    shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """A MoE block's output in one launch: y [pairs, H] the routed experts' outputs, weights [T, k], shared
    [T, H] the shared expert's output, `slot` [T, k] the y row of pair (t, j) (None: t * k + j), `shared_gate`
    [T] or [T, 1] the shared expert's gate logits, any row stride (None: ungated). Returns [T, H] in shared's
    dtype."""
    if torch_path(shared):
        return combine_experts_reference(y, weights, shared, slot, shared_gate)
    t, k = weights.shape
    hid = shared.shape[1]
    out = torch.empty_like(shared)
    block_h = min(1024, triton.next_power_of_2(hid))
    slots = slot.contiguous() if slot is not None else weights
    gate = shared_gate.reshape(t, -1) if shared_gate is not None else shared  # a strided column stays a view
    _combine_kernel[(t, triton.cdiv(hid, block_h))](y, slots, weights.contiguous(), shared.contiguous(), gate, out,
                                                    hid, gate.stride(0), TOPK=k, SLOTS=slot is not None,
                                                    GATED=shared_gate is not None, BLOCK_H=block_h, **LAUNCH)
    return out


@dataclass
class ExpertPartials:
    """A MoE block's decode output not yet combined: routed [T * k, H] (pair (t, j) at row t * k + j), weights
    [T, k] float32, shared [T, H] (contiguous rows, the routed rows' width) and the shared expert's gate logits
    (a [T, 1] column of any row stride, or None). The RMSNorm after the block combines them itself
    (combine_experts' arithmetic), a launch less per MoE layer; `combined()` for any other consumer."""

    routed: torch.Tensor
    weights: torch.Tensor
    shared: torch.Tensor
    gate: torch.Tensor | None = None

    def gate_rows(self) -> torch.Tensor:
        return self.gate.reshape(self.weights.shape[0], -1)

    def fits_one_stride(self) -> bool:
        """Routed and shared rows read with one row stride, lanes contiguous (what the RMSNorm kernel takes)."""
        return (self.routed.stride(1) == 1 and self.shared.stride(1) == 1 and self.weights.is_contiguous()
                and self.routed.stride(0) == self.shared.stride(0))

    def combined(self) -> torch.Tensor:
        return combine_experts(self.routed, self.weights, self.shared, shared_gate=self.gate)


def combine_experts_reference(y, weights, shared, slot=None, shared_gate=None):
    t, k = weights.shape
    rows = slot.reshape(-1).long() if slot is not None else torch.arange(t * k)
    routed = (y.float()[rows].view(t, k, -1) * weights.float()[..., None]).sum(1)
    gate = torch.sigmoid(shared_gate.float().reshape(t, 1)) if shared_gate is not None else 1.0
    return (routed + gate * shared.float()).to(shared.dtype)


# average pairs per expert from which a prefill chunk takes the dense-experts path (dequantize every expert
# once, vendor grouped GEMM); below it the fused kernel, which touches only the experts in use. H200, one
# 35B-A3B layer (§17): fused 4.9 / 9.3 / 18.1 ms at 2K / 4K / 8K tokens (64 / 128 / 256 pairs per expert),
# dense ~5.3 ms up to 2K (bound by its ~100 launches after the host sync), 3.3 ms at 4K and 8K
DENSE_EXPERTS_MIN_PAIRS = 96


def expert_prefill(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: PackedLinear,
                   down: PackedLinear, inter: int, experts: int, shared: torch.Tensor, activation,
                   path: str | None = None, shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts of a prefill chunk plus the shared expert's output (gated by sigmoid(shared_gate)
    when given): h [T, H], ids / weights [T, k] -> [T, H]. `activation(gate_up, out=None)` maps gate_up rows
    [S, 2 * inter] to [S, inter] (SwiGLU). `path`: "fused" or "dense" (default: by the pairs per expert,
    see DENSE_EXPERTS_MIN_PAIRS)."""
    t, hid = h.shape
    if path not in (None, "fused", "dense"):
        raise ValueError(f"expert_prefill: path {path!r} is not 'fused' or 'dense'")
    if torch_path(h):  # decode's pair-by-pair products (each expert's rows in one product on this path)
        pairs = ids.reshape(-1)
        act = activation(expert_gemv(h, ids.shape[1], pairs, gate_up, 2 * inter))
        return combine_experts(expert_gemv(act, 1, pairs, down, hid), weights, shared, None, shared_gate)
    if path is None:
        path = "dense" if ids.numel() >= DENSE_EXPERTS_MIN_PAIRS * experts else "fused"
    if path == "dense":
        y, slot = _dense_experts(h, ids, gate_up, down, inter, experts, activation)
    elif path == "fused":
        x_rows, block_experts, slot = sort_pairs(ids, experts)
        act = activation(expert_gemm(h, x_rows, block_experts, gate_up, 2 * inter))
        own = torch.where(x_rows >= 0, torch.arange(x_rows.numel(), device=h.device, dtype=torch.int32), -1)
        y = expert_gemm(act, own, block_experts, down, hid)
    else:
        raise ValueError(f"expert_prefill: path {path!r} is not 'fused' or 'dense'")
    return combine_experts(y, weights, shared, slot, shared_gate)


def _dense_experts(h, ids, gate_up: PackedLinear, down: PackedLinear, inter: int, experts: int, activation):
    """Every pair's down output, in expert-sorted rows, and where each pair landed: (y [T * k, H], slot [T, k])."""
    t, k = ids.shape
    hid = h.shape[1]
    pairs = ids.reshape(-1).long()
    order = torch.argsort(pairs, stable=True)
    ends = torch.cumsum(torch.bincount(pairs, minlength=experts), 0, dtype=torch.int32)  # the vendor's offs dtype
    bounds = [0, *ends.tolist()]  # the one host sync: which rows each chunk of experts multiplies
    row_cap = moe_dense_chunk_rows(t, k)
    rows = h.index_select(0, order // k)
    act = torch.empty(pairs.numel(), inter, dtype=h.dtype, device=h.device)
    for e0, e1 in expert_chunks(bounds, _experts_per_chunk(gate_up, 2 * inter, h), row_cap):
        r0, r1 = bounds[e0], bounds[e1]
        w = dequantize_rows(gate_up, e0 * 2 * inter, (e1 - e0) * 2 * inter, h.dtype).view(e1 - e0, 2 * inter, hid)
        activation(grouped_matmul(rows[r0:r1], w, ends[e0:e1] - r0, bounds[e0:e1 + 1]), out=act[r0:r1])
    y = rows  # the gathered rows are spent: the down outputs take their place
    for e0, e1 in expert_chunks(bounds, _experts_per_chunk(down, hid, h), row_cap):
        r0, r1 = bounds[e0], bounds[e1]
        w = dequantize_rows(down, e0 * hid, (e1 - e0) * hid, h.dtype).view(e1 - e0, hid, inter)
        y[r0:r1] = grouped_matmul(act[r0:r1], w, ends[e0:e1] - r0, bounds[e0:e1 + 1])
    slot = torch.empty_like(pairs)
    slot[order] = torch.arange(pairs.numel(), device=h.device)
    return y, slot.view(t, k)


def _experts_per_chunk(w: PackedLinear, rows_per_expert: int, h: torch.Tensor) -> int:
    return max(1, GEMM_DEQUANT_BYTES // (rows_per_expert * w.cols * h.element_size()))


def expert_chunks(bounds: list[int], per_chunk: int, row_cap: int) -> list[tuple[int, int]]:
    """Runs of consecutive experts [e0, e1) with pair rows (bounds[e] = first row of expert e), at most
    `per_chunk` experts and `row_cap` rows each (a single expert may exceed the cap: it is never split)."""
    chunks, e0, experts = [], 0, len(bounds) - 1
    while e0 < experts:
        e1 = e0 + 1
        while e1 < experts and e1 - e0 < per_chunk and bounds[e1 + 1] - bounds[e0] <= row_cap:
            e1 += 1
        if bounds[e1] > bounds[e0]:
            chunks.append((e0, e1))
        e0 = e1
    return chunks


_VENDOR_REFUSED: set[str] = set()  # devices whose torch grouped GEMM raised once: the loop from then on


def _vendor_grouped_mm():
    import torch.nn.functional as F

    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_matmul(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """a [R, K] (rows grouped by expert) x w [G, N, K] -> [R, N]: rows [bounds[g], bounds[g + 1]) - bounds[0]
    times w[g]^T; `offs` [G] the groups' ends relative to bounds[0] on the device (the vendor kernel's input).
    torch's grouped GEMM where this torch has it (bf16 on CUDA; any dtype on the CPU), else one matmul per
    group; also when the vendor kernel refuses this GPU (older torch releases have it for Hopper only)."""
    vendor = _vendor_grouped_mm()
    where = str(a.device)
    if vendor is not None and (not a.is_cuda or a.dtype == torch.bfloat16) and where not in _VENDOR_REFUSED:
        try:
            return vendor(a, w.transpose(1, 2), offs=offs.to(torch.int32))  # a no-op for _dense_experts' offs
        except RuntimeError:
            _VENDOR_REFUSED.add(where)
    out = torch.empty(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)
    for g in range(w.shape[0]):
        lo, hi = bounds[g] - bounds[0], bounds[g + 1] - bounds[0]
        if hi > lo:
            torch.matmul(a[lo:hi], w[g].t(), out=out[lo:hi])
    return out
