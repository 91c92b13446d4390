"""Zero-centred RMSNorm, optionally fused with the residual add: h = x + r; y = norm(h) * (1 + w).
x may be a product's unsummed K-split partials (SplitPartials) or a MoE block's uncombined expert outputs
(ExpertPartials), and y may also be written in the dp4a words of the next quantized product (QuantizedX): the
launches before and after it fold in here.

A single decode row is spread over several programs: each reads the whole
row for its sum of squares (from L2), or (SPREAD_BARRIER) only its own chunk, sharing the sums with the row's other
programs at a barrier, and normalizes, stores and quantizes only its own chunk. One
program per 5,120-lane row took ~4.5 us on the H200, most of it the one-SM quantization of the whole
row (the run record (`git show 5d8956c:bench/RESULTS.md`) §14); the decode step runs 129 of these norms. Spread programs cannot update
the residual in place (another program may still be reading it), so they write a new residual tensor."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..switches import setting
from . import interpreted, torch_path, tuning_from_env
from .launch import LAUNCH, pdl_wait
from .moe import ExpertPartials
from .qgemv_int8 import QuantizedX, SplitPartials, producer_words, write_quantized_x

# Spread only single decode rows: spreading MTP3's 4-row verify forwards too (products split 8 ways along K,
# each spread program re-reading all 8 partials of its whole row) cost ~2.7 ms per round on the H200 (run 26,
# call 4: 218 vs 264 tok/s with spreading only for one row; 4 rows x 4 partials timed alone were faster)
SPREAD_MAX_ROWS = 1
# the T = 1 products hand over up to 6 K-split partials (the dp4a GEMV 4, the Q5 products in fragment order 6: with 4
# as the limit, every norm after those ran as one program per row, 4.9 us each on the H100, session 26's profile)
# side-by-side runs: NINFER_RMSNORM_SPREAD_SPLITS=4 (the limit before)
SPREAD_MAX_SPLITS = tuning_from_env("NINFER_RMSNORM_SPREAD_SPLITS", ("splits",), {"splits": 8})["splits"]
# lanes each spread program normalizes, stores and quantizes; H200 at 5,120 lanes with 4 partials (run 26):
# 256 -> 2.86 us, 512 -> 3.08, 1,024 -> 2.96, one program per row 4.24
SPREAD_CHUNK = 256
SUM_BLOCK = 1024  # lanes per step of a spread program's sum-of-squares pass
SPREAD_WARPS = 4  # warps of a spread program (module constants read at call time: bench/engine_ab.py sets them)
ROUTER_DOT_LANES: tl.constexpr = tl.constexpr(512)  # lanes per step of a router program's dot ([rows, 512] tiles)
# A MoE layer's router (and shared-expert gate) product in the norm before it, for decode and verify rows: extra
# programs of the norm's launch (per row) each normalize the whole row themselves and multiply it with `rows` router
# rows (the 35B-A3B's 257 x 2,048 bf16 product was its own cuBLAS launch: 129 us over 40 a one-lane step, and at 8
# lanes a GEMM plus its split-K reduction, 215 + 99 us, H100 profiles of sessions 37-38). Measured in one engine
# (H100, session 47, 8 rows a program): 2.219 / 3.559 ms a step at 1 / 8 lanes, where the router on the dense-rows
# kernel (the default since) takes 2.200 / 3.558: off (0) by default; NINFER_ROUTER_IN_NORM=rows turns it on.
ROUTER_IN_NORM_ROWS = tuning_from_env("NINFER_ROUTER_IN_NORM", ("rows",), {"rows": 0})["rows"]
# A spread row's programs share their chunks' sums of squares through global memory and wait for each other (a
# barrier of a few atomics) instead of each re-reading the whole row, every K-split partial of it, from L2. Safe only
# where every program of the launch is resident at once: a spread launch has 8-40 small programs, and under PDL the
# next kernel is released only after all of them passed their wait (launch.py). Never under the interpreter, which
# runs the programs one after another. Side by side in one engine (H100, session 48, bench/engine_ab.py, one lane):
# the 35B-A3B's rows of 8 chunks (2,048 lanes; a MoE block's 8 expert outputs and the shared one re-read per program)
# 2.053 against 2.071 ms a step (0.9 % faster; end to end 511.1 against 506.4 tok/s), the 27B's rows of 20 chunks
# 7.085 against 7.032 (0.8 % slower: there the atomics' round trips cost more than the re-reads). So by default
# (auto) rows of at most BARRIER_AUTO_CHUNKS chunks wait at the barrier; NINFER_RMSNORM_BARRIER=1 every spread row,
# 0 none. SPREAD_BARRIER: None (auto), True or False (bench/engine_ab.py sets it).
_BARRIER_MODES = {"auto": None, "1": True, "0": False}
SPREAD_BARRIER = _BARRIER_MODES[setting("NINFER_RMSNORM_BARRIER")]
BARRIER_AUTO_CHUNKS = 8
# True (default since session 49): a program counts itself out of the barrier after its stores (a relaxed atomic), so
# that round trip overlaps them instead of delaying the normalization. One engine a shape (H100, session 49,
# bench/engine_ab.py, one lane, median of 3): the 35B-A3B 1.957 ms a step against 1.972 counting out first (-0.8 %; all
# three rounds faster) and 1.994 without the barrier; the 27B, which stays without it, 7.461 against 7.487 counting out
# first and 7.413 without. False restores session 48's protocol (bench/engine_ab.py sets it).
BARRIER_LEAVE_LAST = True
BARRIER_ROWS, BARRIER_CHUNKS = 8, 64  # the barrier's scratch: rows and chunks a launch may have
# Rows a launch spreads with the barrier on. Spreading several rows lost without it (each program re-reading its row's
# partials, SPREAD_MAX_ROWS above); with it a program reads only its own chunk, so lanes and verify blocks may gain.
# Side-by-side runs set 4 or 8 (bench/engine_ab.py).
BARRIER_SPREAD_ROWS = 1
_barrier_scratch: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


@triton.jit
def _summed_row(x_ptr, res_ptr, y_ptr, row, cols, ok, stride_x, stride_r, split_stride, HAS_RESIDUAL: tl.constexpr,
                SPLITS: tl.constexpr, moe_w_ptr, moe_shared_ptr, moe_gate_ptr, gate_stride, TOPK: tl.constexpr,
                GATED: tl.constexpr):
    """h = x + residual at lanes `cols` of `row`, float32; with SPLITS, x is the float32 partials summed in
    split order and rounded to y's dtype as finish_splits would; with TOPK, x is a MoE block's routed outputs
    (row t's pairs at rows t * TOPK + j) combined with its weights and the (gated) shared expert's row and
    rounded to y's dtype as moe.combine_experts would."""
    if TOPK > 0:
        acc = tl.zeros(cols.shape, tl.float32)
        for j in tl.static_range(TOPK):
            w = tl.load(moe_w_ptr + row * TOPK + j).to(tl.float32)
            acc += w * tl.load(x_ptr + (row * TOPK + j) * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        shared = tl.load(moe_shared_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        if GATED:
            shared = shared * tl.sigmoid(tl.load(moe_gate_ptr + row * gate_stride).to(tl.float32))
        h = (acc + shared).to(y_ptr.dtype.element_ty).to(tl.float32)
    elif SPLITS == 0:
        h = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    else:
        h = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLITS):
            h += tl.load(x_ptr + s * split_stride + row * stride_x + cols, mask=ok, other=0.0)
        h = h.to(y_ptr.dtype.element_ty).to(tl.float32)
    if HAS_RESIDUAL:
        h += tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
    return h


@triton.jit
def _row_variance(x_ptr, res_ptr, y_ptr, row, H, stride_x, stride_r, split_stride, HAS_RESIDUAL: tl.constexpr,
                  SPLITS: tl.constexpr, moe_w_ptr, moe_shared_ptr, moe_gate_ptr, gate_stride, TOPK: tl.constexpr,
                  GATED: tl.constexpr, SUM_STEPS: tl.constexpr, SUM_LANES: tl.constexpr):
    """The whole row's mean square, summed SUM_LANES lanes a step (every spread program sums in this order)."""
    squares = tl.zeros((SUM_LANES,), tl.float32)
    for i in tl.static_range(SUM_STEPS):
        all_cols = i * SUM_LANES + tl.arange(0, SUM_LANES)
        hs = _summed_row(x_ptr, res_ptr, y_ptr, row, all_cols, all_cols < H, stride_x, stride_r, split_stride,
                         HAS_RESIDUAL, SPLITS, moe_w_ptr, moe_shared_ptr, moe_gate_ptr, gate_stride, TOPK, GATED)
        squares += hs * hs
    return tl.sum(squares, axis=0) / H


@triton.jit
def _router_rows(x_ptr, res_ptr, w_ptr, y_ptr, router_ptr, logits_ptr, row, r0, H, eps, E_ROUTER, stride_router,
                 stride_logits, stride_x, stride_r, split_stride, HAS_RESIDUAL: tl.constexpr, SPLITS: tl.constexpr,
                 moe_w_ptr, moe_shared_ptr, moe_gate_ptr, gate_stride, TOPK: tl.constexpr, GATED: tl.constexpr,
                 SUM_STEPS: tl.constexpr, SUM_LANES: tl.constexpr, ROUTER_ROWS: tl.constexpr):
    """logits[row, r0 .. r0 + ROUTER_ROWS) = router rows . the normed row as the norm stores it (rounded to y's
    dtype), float32 sums stored in the logits' dtype. The mean square is summed as the norm's programs sum it
    (SUM_STEPS x SUM_LANES: a spread row's steps, or one step over a one-program row's BLOCK); the dot goes
    ROUTER_DOT_LANES lanes a step."""
    var = _row_variance(x_ptr, res_ptr, y_ptr, row, H, stride_x, stride_r, split_stride, HAS_RESIDUAL, SPLITS,
                        moe_w_ptr, moe_shared_ptr, moe_gate_ptr, gate_stride, TOPK, GATED, SUM_STEPS, SUM_LANES)
    rows = r0 + tl.arange(0, ROUTER_ROWS)
    rows_ok = rows < E_ROUTER
    acc = tl.zeros((ROUTER_ROWS,), tl.float32)
    for i in tl.static_range((SUM_STEPS * SUM_LANES + ROUTER_DOT_LANES - 1) // ROUTER_DOT_LANES):
        cols = i * ROUTER_DOT_LANES + tl.arange(0, ROUTER_DOT_LANES)
        ok = cols < H
        h = _summed_row(x_ptr, res_ptr, y_ptr, row, cols, ok, stride_x, stride_r, split_stride, HAS_RESIDUAL, SPLITS,
                        moe_w_ptr, moe_shared_ptr, moe_gate_ptr, gate_stride, TOPK, GATED)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        y = (h * tl.rsqrt(var + eps) * (1.0 + w)).to(y_ptr.dtype.element_ty).to(tl.float32)
        r = tl.load(router_ptr + rows[:, None] * stride_router + cols[None, :], mask=rows_ok[:, None] & ok[None, :],
                    other=0.0).to(tl.float32)
        acc += tl.sum(r * y[None, :], axis=1)
    tl.store(logits_ptr + row * stride_logits + rows, acc.to(logits_ptr.dtype.element_ty), mask=rows_ok)


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, xq_ptr, H, eps, stride_x, stride_r, stride_y,
                    stride_ro, split_stride, moe_w_ptr, moe_shared_ptr, moe_gate_ptr, gate_stride,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr, TOPK: tl.constexpr,
                    GATED: tl.constexpr,
                    SPREAD: tl.constexpr, SUM_STEPS: tl.constexpr, SUM_LANES: tl.constexpr,
                    QUANT: tl.constexpr, ROW_INTS: tl.constexpr, K_PAD: tl.constexpr, QBITS: tl.constexpr,
                    GROUP: tl.constexpr, router_ptr, logits_ptr, E_ROUTER, stride_router, stride_logits, CHUNKS,
                    ROUTER_ROWS: tl.constexpr, sums_ptr, arrivals_ptr, BARRIER: tl.constexpr,
                    CHUNKS_POW2: tl.constexpr, LEAVE_LAST: tl.constexpr):
    """Program (row, chunk) normalizes lanes [chunk * BLOCK, chunk * BLOCK + BLOCK) of the row; with SPREAD
    its sum of squares comes from a pass over the whole row (SUM_STEPS x SUM_LANES lanes, unrolled so
    the loads go out together), else from its own lanes (BLOCK covers the row). ROUTER_ROWS: programs
    chunk >= CHUNKS take router rows (chunk - CHUNKS) * ROUTER_ROWS.. instead, multiplying them with the whole
    normed row (each program normalizing it itself, in the same order as the others) into logits."""
    pdl_wait()
    row = tl.program_id(0)
    # the router branch only where the launch has router programs: a branch over a runtime condition compiles both
    # sides, and ROUTER_ROWS = 0 has no router tile to compile (triton 3.6 failed the launch there)
    if ROUTER_ROWS > 0:
        if tl.program_id(1) >= CHUNKS:
            _router_rows(x_ptr, res_ptr, w_ptr, y_ptr, router_ptr, logits_ptr, row, (tl.program_id(1) - CHUNKS) *
                         ROUTER_ROWS, H, eps, E_ROUTER, stride_router, stride_logits, stride_x, stride_r,
                         split_stride, HAS_RESIDUAL, SPLITS, moe_w_ptr, moe_shared_ptr, moe_gate_ptr, gate_stride,
                         TOPK, GATED, SUM_STEPS, SUM_LANES, ROUTER_ROWS)
        else:
            _norm_chunk(x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, xq_ptr, row, H, eps, stride_x, stride_r, stride_y,
                        stride_ro, split_stride, moe_w_ptr, moe_shared_ptr, moe_gate_ptr, gate_stride, HAS_RESIDUAL,
                        BLOCK, SPLITS, TOPK, GATED, SPREAD, SUM_STEPS, SUM_LANES, QUANT, ROW_INTS, K_PAD, QBITS,
                        GROUP, sums_ptr, arrivals_ptr, CHUNKS, BARRIER, CHUNKS_POW2, LEAVE_LAST)
    else:
        _norm_chunk(x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, xq_ptr, row, H, eps, stride_x, stride_r, stride_y,
                    stride_ro, split_stride, moe_w_ptr, moe_shared_ptr, moe_gate_ptr, gate_stride, HAS_RESIDUAL,
                    BLOCK, SPLITS, TOPK, GATED, SPREAD, SUM_STEPS, SUM_LANES, QUANT, ROW_INTS, K_PAD, QBITS, GROUP,
                    sums_ptr, arrivals_ptr, CHUNKS, BARRIER, CHUNKS_POW2, LEAVE_LAST)


@triton.jit
def _shared_row_variance(own_squares, sums_ptr, arrivals_ptr, row, chunk, CHUNKS, H, CHUNKS_POW2: tl.constexpr,
                         LEAVE_LAST: tl.constexpr):
    """The row's mean square from every program's own chunk: each stores its sum of squares, counts itself in, waits
    until all CHUNKS programs of the row have, then sums the stored sums in chunk order (the same order in every
    program, so the row is normalized alike everywhere). Each then counts itself out (_barrier_leave) here, or with
    LEAVE_LAST after its stores, where the atomic's round trip overlaps them."""
    tl.store(sums_ptr + row * CHUNKS_POW2 + chunk, own_squares)
    tl.debug_barrier()  # every thread's store issued before the release below publishes them
    arrived = tl.atomic_add(arrivals_ptr + row * 2, 1, sem="acq_rel", scope="gpu") + 1
    while arrived < CHUNKS:
        arrived = tl.atomic_add(arrivals_ptr + row * 2, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
    idx = tl.arange(0, CHUNKS_POW2)
    sums = tl.load(sums_ptr + row * CHUNKS_POW2 + idx, mask=idx < CHUNKS, other=0.0, cache_modifier=".cg")
    total = tl.sum(sums, axis=0)
    if not LEAVE_LAST:
        _barrier_leave(arrivals_ptr, row, CHUNKS, False)
    return total / H


@triton.jit
def _barrier_leave(arrivals_ptr, row, CHUNKS, RELAXED: tl.constexpr):
    """Count this program out of the row's barrier (after it has read the stored sums); the last one out resets the
    row's two counters for the next launch, which waits for this one to finish before it touches them. RELAXED (after
    the stores): no release, which would first wait for every store of the program to land. It needs none: the count
    comes after this program's acquiring spin in program order, so the reset follows every program's spin, and the
    sums are rewritten only by a later launch."""
    tl.debug_barrier()  # every thread has read the sums before this program counts itself out
    if RELAXED:
        left = tl.atomic_add(arrivals_ptr + row * 2 + 1, 1, sem="relaxed", scope="gpu") + 1
    else:
        left = tl.atomic_add(arrivals_ptr + row * 2 + 1, 1, sem="acq_rel", scope="gpu") + 1
    if left == CHUNKS:
        tl.atomic_xchg(arrivals_ptr + row * 2, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(arrivals_ptr + row * 2 + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _norm_chunk(x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, xq_ptr, row, H, eps, stride_x, stride_r, stride_y,
                stride_ro, split_stride, moe_w_ptr, moe_shared_ptr, moe_gate_ptr, gate_stride,
                HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr, TOPK: tl.constexpr,
                GATED: tl.constexpr, SPREAD: tl.constexpr, SUM_STEPS: tl.constexpr, SUM_LANES: tl.constexpr,
                QUANT: tl.constexpr, ROW_INTS: tl.constexpr, K_PAD: tl.constexpr, QBITS: tl.constexpr,
                GROUP: tl.constexpr, sums_ptr, arrivals_ptr, CHUNKS, BARRIER: tl.constexpr, CHUNKS_POW2: tl.constexpr,
                LEAVE_LAST: tl.constexpr):
    """Lanes [chunk * BLOCK, chunk * BLOCK + BLOCK) of the row: summed, normalized, stored (and quantized)."""
    k0 = tl.program_id(1) * BLOCK
    cols = k0 + tl.arange(0, BLOCK)
    ok = cols < H
    h = _summed_row(x_ptr, res_ptr, y_ptr, row, cols, ok, stride_x, stride_r, split_stride, HAS_RESIDUAL, SPLITS,
                    moe_w_ptr, moe_shared_ptr, moe_gate_ptr, gate_stride, TOPK, GATED)
    if SPREAD and BARRIER:
        var = _shared_row_variance(tl.sum(h * h, axis=0), sums_ptr, arrivals_ptr, row, tl.program_id(1), CHUNKS, H,
                                   CHUNKS_POW2, LEAVE_LAST)
    elif SPREAD:
        var = _row_variance(x_ptr, res_ptr, y_ptr, row, H, stride_x, stride_r, split_stride, HAS_RESIDUAL, SPLITS,
                            moe_w_ptr, moe_shared_ptr, moe_gate_ptr, gate_stride, TOPK, GATED, SUM_STEPS, SUM_LANES)
    else:
        var = tl.sum(h * h, axis=0) / H
    if HAS_RESIDUAL:
        tl.store(res_out_ptr + row * stride_ro + cols, h.to(res_out_ptr.dtype.element_ty), mask=ok)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = (h * tl.rsqrt(var + eps) * (1.0 + w)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * stride_y + cols, y, mask=ok)
    if QUANT:  # the stored (rounded) values, as the product would quantize them from memory
        write_quantized_x(xq_ptr + row * ROW_INTS, y.to(tl.float32), k0, K_PAD, QBITS, GROUP, BLOCK)
    if SPREAD and BARRIER and LEAVE_LAST:
        _barrier_leave(arrivals_ptr, row, CHUNKS, True)


def rmsnorm(x: torch.Tensor | SplitPartials | ExpertPartials, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
            xq: QuantizedX | None = None, router: torch.Tensor | None = None,
            router_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, H] (or a product's SplitPartials, summed here, or a MoE block's ExpertPartials, combined here).
    With `residual`, returns
    (norm(x + residual), x + residual); the sum is written in place of `residual` when each row is one
    program, else into a new tensor (use the returned one). Without, returns (norm(x), None). With `xq`
    (made by QuantizedX.empty for the next product's weight), the normed rows are also written there as
    dp4a words. With `router` [E, H] (the next product's dense weight), router_out [T, E] receives
    norm(...) @ router.T: inside this launch with ROUTER_IN_NORM_ROWS, else by a product after it."""
    if isinstance(x, ExpertPartials) and (torch_path(x.shared) or not x.fits_one_stride()):
        x = x.combined()  # combine_experts' own path (the torch reference on a CPU)
    if torch_path(x.y if isinstance(x, SplitPartials) else x.shared if isinstance(x, ExpertPartials) else x):
        if isinstance(x, SplitPartials):
            x = x.parts.sum(0).to(x.y.dtype)
        y, res_out = rmsnorm_reference(x, weight, eps, residual)
        if out is not None:
            y = out.copy_(y)
        if xq is not None:
            xq.fill(y)
        if router is not None:
            torch.matmul(y, router.t(), out=router_out)
        return y, res_out
    splits, split_stride = 0, 0
    moe = None
    if isinstance(x, SplitPartials):
        parts, x = x.parts, x.y  # x: the unwritten product output, for shape and dtype
        splits, split_stride = parts.shape[0], parts.stride(0)
    elif isinstance(x, ExpertPartials):
        moe, x = x, x.shared  # the shared expert's rows: the combined block's shape and dtype
    t, h = x.shape
    y = out if out is not None else torch.empty_like(x)
    res = residual if residual is not None else x
    # a spread row's chunks cover the next product's padded lanes too (zeros), so its words are filled here
    spread_chunks = triton.cdiv(max(h, xq.k_pad if xq is not None else 0), SPREAD_CHUNK)
    wanted = spread_chunks <= BARRIER_AUTO_CHUNKS if SPREAD_BARRIER is None else SPREAD_BARRIER
    long_row = h > 2 * SPREAD_CHUNK
    barrier = (wanted and long_row and t <= min(BARRIER_ROWS, BARRIER_SPREAD_ROWS) and spread_chunks <= BARRIER_CHUNKS
               and not (router is not None and ROUTER_IN_NORM_ROWS) and not interpreted())
    spread = barrier or long_row and t <= SPREAD_MAX_ROWS and splits <= SPREAD_MAX_SPLITS
    if spread:
        block, chunks = SPREAD_CHUNK, spread_chunks
        sum_lanes = min(SUM_BLOCK, triton.next_power_of_2(h))
        res_out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device) if residual is not None else y
        num_warps = SPREAD_WARPS
    else:
        block, chunks, sum_lanes = triton.next_power_of_2(h), 1, 1
        res_out = res
        num_warps = min(16, max(4, block // 512))  # a one-program row: latency-bound
    fused, words, quant = producer_words(xq, y, t, h, block, block * chunks)
    source = parts if splits else moe.routed if moe is not None else x
    gate = moe.gate_rows() if moe is not None and moe.gate is not None else source
    router_rows = ROUTER_IN_NORM_ROWS if router is not None and router.stride(1) == 1 else 0
    if router_rows and not spread:  # the router programs sum a one-program row's squares as it does (one step),
        sum_lanes = block  # and read the residual while it runs: its sum goes to a new tensor, as spread rows' do
        if residual is not None:
            res_out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    router_programs = triton.cdiv(router.shape[0], router_rows) if router_rows else 0
    r_w, r_out = (router, router_out) if router_rows else (weight, y)  # unread without router rows
    sums, arrivals = _barrier_scratch_for(y.device) if barrier else (y, y)  # unread without the barrier
    _rmsnorm_kernel[(t, chunks + router_programs)](source, res, weight, y, res_out, words, h, eps,
                                 source.stride(1) if splits else source.stride(0), res.stride(0), y.stride(0),
                                 res_out.stride(0), split_stride,
                                 moe.weights if moe is not None else source, moe.shared if moe is not None else source,
                                 gate, gate.stride(0), HAS_RESIDUAL=residual is not None, BLOCK=block, SPLITS=splits,
                                 TOPK=moe.weights.shape[1] if moe is not None else 0,
                                 GATED=moe is not None and moe.gate is not None, SPREAD=spread,
                                 SUM_STEPS=triton.cdiv(h, sum_lanes), SUM_LANES=sum_lanes, **quant,
                                 router_ptr=r_w, logits_ptr=r_out, E_ROUTER=r_w.shape[0], stride_router=r_w.stride(0),
                                 stride_logits=r_out.stride(0), CHUNKS=chunks, ROUTER_ROWS=router_rows,
                                 sums_ptr=sums, arrivals_ptr=arrivals, BARRIER=barrier,
                                 CHUNKS_POW2=triton.next_power_of_2(chunks) if barrier else 1,
                                 LEAVE_LAST=barrier and BARRIER_LEAVE_LAST,
                                 num_warps=num_warps, **LAUNCH)
    if xq is not None and not fused:
        xq.fill(y)
    if router is not None and not router_rows:
        torch.matmul(y, router.t(), out=router_out)
    return y, (res_out if residual is not None else None)


def _barrier_scratch_for(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The spread barrier's sums of squares and (arrived, left) counters of a device, zeroed once and kept: each
    launch leaves its counters at zero. One set a device: the norms of a device run in one stream's order (the engine's
    step, its CUDA graphs' replays)."""
    key = str(device)
    if key not in _barrier_scratch:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("rmsnorm: the spread barrier's scratch must exist before CUDA graph capture "
                               "(run one eager step first)")
        _barrier_scratch[key] = (torch.zeros(BARRIER_ROWS * BARRIER_CHUNKS, dtype=torch.float32, device=device),
                                 torch.zeros(BARRIER_ROWS * 2, dtype=torch.int32, device=device))
    return _barrier_scratch[key]


def rmsnorm_reference(x, weight, eps, residual=None):
    h = x.float() + (residual.float() if residual is not None else 0)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    return y.to(x.dtype), (h.to(x.dtype) if residual is not None else None)
