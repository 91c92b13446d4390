"""The fast runtime: packed weights, paged KV in any codec, Triton kernels, chunked prefill,
CUDA-graph decode. Every resident byte comes from the memory plan's arenas.

Lanes are fixed slots (1..8); lane i owns pages [i·P, (i+1)·P) of the pool, so its block table is
static and decode can be captured once per batch shape.
"""

from __future__ import annotations

import copy
import functools
import sys
from dataclasses import dataclass, replace

import torch

from format.binding import load_config, require_runnable, token_limit
from format.container import open_artifact
from format.layouts import RowSplitGeometry
from format.numeric import FloatCodeFormat, GroupedFormat, get_format

from .allocator import DeviceMemory
from .kernels import embed_rows, tuning_from_env
from .kernels.attention_gate import AttentionGate
from .kernels.float_gemv import FloatCodes, dense_reference, float_codes, float_linear
from .kernels.conv1d import CONV_SECTIONS, causal_conv1d, causal_conv1d_lanes
from .kernels.dense_rows import MAX_ROWS as DENSE_ROWS_MAX_T, dense_rows
from .kernels.gdn_chunked import CHUNKED_MIN_TOKENS, chunked_probe, fla_available, gdn_chunked
from .kernels.gdn_fused import NORM_EPILOGUE as GDN_NORM_EPILOGUE, PROJECT_MAX_ROWS, GdnGate, gdn_fused
from .kernels.hadamard import rotate64
from .kernels.kv_append import SUPPORTED as KV_APPEND_KINDS
from .kernels.kv_append import append_keys_values
from .kernels.kv_slots import kv_slots
from .kernels.paged_attention import PAGE, paged_attention
from .kernels.moe import (DENSE_EXPERTS_MIN_PAIRS, ExpertPartials, combine_experts, expert_gemv, expert_prefill, route,
                          shared_fusable)
from .kernels.moe_fragment import MAX_TOKENS as MOE_FRAGMENT_MAX_TOKENS, MOE_FRAGMENT, MOE_FRAGMENT_OBJECTS, \
    MOE_FRAGMENT_TUNING, fragment_expert_gemv, shared_rides
from .kernels.qgemm_fragment_layout import ROWS_PER_BLOCK, fragment_rows, in_place_supported, layer_order, \
    takes_fragment_layout, to_fragment_layout
from .kernels.qgemv_int8 import QuantizedX
from .kernels.qlinear import (GEMV_MAX_T, PackedLinear, fragment_layout_enabled, gather_rows, keep_dense_copies, qlinear,
                             qlinear_conv, qlinear_swiglu, takes_quantized_x)
from .kernels.rmsnorm import ROUTER_IN_NORM_ROWS, rmsnorm
from .kernels.qk_norm_rope import attention_inputs, qk_norm_rope
from .kernels.sampling import SamplingParams, compile_every_variant, pick_token
from .kernels.swiglu import swiglu
from .kv.codecs import get_codec
from .memory_plan import (PIECE_BUCKETS, MemoryPlanError, PlanOptions, build_plan, require_fit,
                          resolve_prefill_chunk, shared_chunk_for, weight_cache_candidates, weight_cache_reserve)
from .reference_ops import apply_partial_rope, rope_cos_sin
from .switches import report_environment_once, setting
from .transfers import device_ints, staged_ints, to_device


# MoE decode (kernels/moe.py): "fused" (three launches per layer: the router and shared gate in one product, routing
# in the gate/up launch, the shared expert riding in the routed experts' launches, SwiGLU in the down launch, the
# combine in the next norm) or "separate" (ten, for side-by-side runs). H200, 35B-A3B at 8K: 454.6 against 381.6
# tok/s (session 27). Its engine test's 0.18 on the H200 (session 25) was a routing near tie of the tiny model (top-k
# gap 0.008 at that step), which the test now leaves out (tests/test_engine.py ROUTING_NEAR_TIE)
MOE_DECODE = setting("NINFER_MOE_DECODE")
# Fused MoE decode of at least this many rows (lanes, verify blocks; 0 = never): the shared expert leaves the routed
# experts' launches, where each row's program reads its matrices again (35B-A3B q4: W8, 3.3 MB a layer, 8 reads at
# 8 lanes, ~1 GB a step), for the layer products' row kernels (one read for every row; 3 launches more a layer).
# Opt-in (NINFER_MOE_SHARED_APART=4, say): with NINFER_DENSE_ROWS=on at 2 rows it did not gain on an H100 (session
# 32, bench/RESULTS.md §2): the three launches more cost what the rows' repeated reads of the shared matrices do.
MOE_SHARED_APART_ROWS = tuning_from_env("NINFER_MOE_SHARED_APART", ("rows",), {"rows": 0})["rows"]
# the output head in fragment order, in place (Engine._lays_out_head): auto, or off (the artifact's planes: the dp4a
# GEMV and the int8 row kernels) for side-by-side runs
HEAD_FRAGMENT = setting("NINFER_HEAD_FRAGMENT")
# dense copies of the layer products in the memory the plan leaves spare (Engine._keep_dense_weights);
# NINFER_WEIGHT_CACHE=off for side-by-side runs (as --weight-cache off)
WEIGHT_CACHE = setting("NINFER_WEIGHT_CACHE")

# the attention block's small launches: "fused" (norms, RoPE, rotations and KV append in one launch, the output gate
# in the combine) or "separate" (a launch each, for side-by-side runs)
ATTENTION_LAUNCHES = setting("NINFER_ATTENTION_LAUNCHES")
# Prompt pieces shorter than the shared chunk (a short prompt, the tail of a long one) run eagerly: ~100 ms of
# launches for the 27B whatever their length (H100, session 28), while decoding lanes wait. With
# NINFER_PIECE_GRAPHS=on such a piece is padded to the next of PIECE_BUCKETS and replayed from a CUDA graph per
# bucket: pad rows get GDN decay 1 and beta 0 (the recurrence skips them), the conv window is taken after the
# real rows, their K/V lands past the lane's length (overwritten later) and the logits are the last real row's.
# 4 streaming clients of the 27B (H100, session 29): first text 370 -> 125 ms, aggregate 2.47x -> 2.81x one client.
# NINFER_PIECE_GRAPHS=off runs the pieces eagerly (side-by-side runs).
PIECE_GRAPHS = setting("NINFER_PIECE_GRAPHS") == "on"
# MoE prompts too (padded pieces and riding shared chunks from CUDA graphs), where the chunk's experts take the
# fused prefill path, which waits for nothing on the host. The 35B-A3B server with 4 streaming clients (H100, session
# 32): 747.7 -> 912.7 tok/s aggregate (2.04x -> 2.35x one client), slowest first text 344 -> 100 ms.
# NINFER_MOE_PREFILL_GRAPHS=off runs MoE pieces eagerly (side-by-side runs).
MOE_PREFILL_GRAPHS = setting("NINFER_MOE_PREFILL_GRAPHS") == "on"
# A riding chunk's GEMMs multiply the prompt rows and the riders' rows together; the riders' rows come out of the
# prompt piece (509 prompt rows + 3 riders = 512 rows, not 515): the vendor GEMM runs some shapes far slower just past
# a whole tile (H100, 27B MLP gate_up with the weight cache: 512 rows 272 us, 515 rows 354; down 1,024 rows 259 us,
# 1,027 343). 32K prefill beside 3 decoding lanes (H100, session 40): 512-token chunks gap 64.2 -> 60.4 ms, prefill
# 0.73 -> 0.76 of alone; 1,024: 115.1 -> 106.8 ms, 0.82 -> 0.86. A short piece padded to a graph bucket leaves the
# riders' rows out of the bucket the same way (a 300-token tail: 509 rows + 3, not 512 + 3). NINFER_RIDE_ALIGN=off
# keeps the whole --prefill-chunk-shared (and bucket) of prompt rows (side-by-side runs).
RIDE_ALIGN = setting("NINFER_RIDE_ALIGN") == "on"
# A decode step's packed inputs are copied from pinned memory straight into its CUDA graph, which counts the lanes'
# context lengths itself: a chained step is two copies and a replay (session 47). False: copied to the device and
# counted before the replay, then copied into the graph (session 46), for side-by-side timing (bench/engine_ab.py).
STEP_INPUTS_IN_GRAPH = True
PAD_GATE = -1.0e4  # a pad row's alpha and beta projections: softplus and sigmoid of it are exactly 0 in float32


# Small bf16 products (the MoE router + shared gate) on kernels/dense_rows.py in one launch instead of the vendor's
# GEMV (one row) or split-K GEMM and its reduction (several). By default (auto) one row (its few-rows kernel: CUDA-core
# products, the first weight tile loaded before the PDL wait) and 8-16 rows. Side by side in one engine (H100,
# bench/engine_ab.py): one lane of the 35B-A3B 1.998 against cuBLAS's 2.071 ms a step (3.5 %, session 48; the tile
# kernel at one row was 2 % slower, session 47); 8 lanes 3.558 against 3.667 ms (3.0 %, session 47). 2-7 rows are not
# yet timed side by side (session 32 saw no gain at 2+ rows beside NINFER_MOE_SHARED_APART=2, 8 lanes 5.65 / 5.75 ms
# against 5.52 / 5.51). NINFER_DENSE_ROWS=on takes 2-16 rows, all 1-16, off none. Only small matrices: larger ones
# (draft heads) keep the vendor GEMM, which streams them well.
DENSE_ROWS_MODE = setting("NINFER_DENSE_ROWS")
DENSE_ROWS_MIN_T = {"off": DENSE_ROWS_MAX_T + 1, "auto": 8, "on": 2, "all": 1}[DENSE_ROWS_MODE]
DENSE_ROWS_ONE_ROW = DENSE_ROWS_MODE in ("auto", "all")  # one row on the kernel too (below DENSE_ROWS_MIN_T)
DENSE_ROWS_MAX_ELEMENTS = 1 << 21


class DenseLinear:
    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def __call__(self, x: torch.Tensor, xq: QuantizedX | None = None, defer_sum: bool = False) -> torch.Tensor:
        w = self.weight
        rows = x.shape[0]
        if (DENSE_ROWS_MIN_T <= rows <= DENSE_ROWS_MAX_T or rows == 1 and DENSE_ROWS_ONE_ROW) and x.is_cuda \
                and x.dtype == w.dtype == torch.bfloat16 \
                and w.numel() <= DENSE_ROWS_MAX_ELEMENTS and w.stride(1) == 1:
            return dense_rows(x, w)
        return x @ w.t()

    def rows(self, begin: int, end: int) -> "DenseLinear":
        return DenseLinear(self.weight[begin:end])

    def gather(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `tokens` (the embedding lookup), in `dtype`."""
        return self.weight[tokens].to(dtype)


class CodeLinear:
    """NVFP4 / FP8-row weights (upstream's nvfp4 profile), dequantized in-kernel (kernels/float_gemv.py)."""

    def __init__(self, codes: FloatCodes):
        self.codes = codes

    def __call__(self, x: torch.Tensor, xq: QuantizedX | None = None, defer_sum: bool = False) -> torch.Tensor:
        return float_linear(x, self.codes)

    def rows(self, begin: int, end: int) -> "CodeLinear":
        return CodeLinear(self.codes.rows_view(begin, end))

    def gather(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `tokens` decoded, in `dtype`."""
        return dense_reference(self.codes.take(tokens.reshape(-1))).view(*tokens.shape, self.codes.cols).to(dtype)


class QuantLinear:
    def __init__(self, packed: PackedLinear):
        self.packed = packed

    def __call__(self, x: torch.Tensor, xq: QuantizedX | None = None, defer_sum: bool = False):
        return qlinear(x, self.packed, xq=xq, defer_sum=defer_sum)

    def gather(self, tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `tokens` decoded, in `dtype` (a W8 table in one launch, kernels/embed_rows.py)."""
        if embed_rows.ONE_LAUNCH and embed_rows.takes(self.packed):
            return embed_rows.embed_w8(self.packed, tokens, dtype)
        return gather_rows(self.packed, tokens).to(dtype)

    def rows(self, begin: int, end: int) -> "QuantLinear":
        p = self.packed
        if p.fragment is not None:  # fragment order is block-major: views of whole 16-row blocks only
            if begin % ROWS_PER_BLOCK or end % ROWS_PER_BLOCK:
                raise ValueError(f"QuantLinear.rows: rows {begin}..{end} of planes in fragment order (whole blocks "
                                 f"of {ROWS_PER_BLOCK} rows only)")
            fp = fragment_rows(p.fragment, end, begin)
            view = PackedLinear(fp.codes, fp.high, fp.scales, end - begin, p.cols, p.fmt)
            view.fragment = fp
            return QuantLinear(view)
        g = p.groups_per_row
        f = p.fmt
        base = p.base.view(p.rows, -1)[begin:end].reshape(-1)
        high = p.high.view(p.rows, -1)[begin:end].reshape(-1) if p.high is not None else None
        scale = p.scale.view(p.rows, g)[begin:end].reshape(-1)
        return QuantLinear(PackedLinear(base, high, scale, end - begin, p.cols, f))


@dataclass
class EngineStats:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    reused_tokens: int = 0
    rider_tokens: int = 0  # decode tokens computed inside another lane's prefill chunk
    decode_steps: int = 0  # plain decode forwards
    decode_step_rows: int = 0  # their rows (over decode_steps: how many lanes a step carried)
    # CUDA graphs captured while serving (after warm_up): each stopped every lane for an eager forward and the
    # capture, and the first of a shape for the kernels it compiled
    graphs_captured_serving: int = 0


UNKNOWN_TOKEN = -1  # a chained step's token in lane_tokens until the host learns it (matches no prompt token)


class Riders:
    """Decode lanes a scheduler offers to a lane's next prefill chunk (Engine.prefill_chunks(riders=...)):
    `offer` them before asking for the chunk; afterwards `logits` [R, V] holds their next-token logits
    when they rode, else None (the chunk could not take them: decode them as usual)."""

    def __init__(self) -> None:
        self.offered: list[tuple[int, int]] = []  # (lane, its last token)
        self.logits: torch.Tensor | None = None
        self.advanced: list[int] = []  # lanes whose token the engine counted for this chunk

    def offer(self, lanes: list[int], tokens: list[int]) -> None:
        self.offered = list(zip(lanes, tokens))
        self.logits = None
        self.advanced = []

    def take(self) -> list[tuple[int, int]]:
        offered, self.offered = self.offered, []
        return offered


class Engine:
    def __init__(self, path, options: PlanOptions, device: str = "cuda", available_bytes: int | None = None,
                 cuda_graphs: bool = True, random_weights_seed: int | None = None):
        report_environment_once()  # a misspelled NINFER_* switch is named (the CLI has, if it built this engine)
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise MemoryPlanError(f"--device {device} was requested but no CUDA GPU is visible; use --device cpu "
                                  "(the Triton interpreter: correct but very slow)")
        self.art = open_artifact(path)
        require_runnable(self.art)
        self.cfg = load_config(self.art)
        self.token_limit = token_limit(self.art, self.cfg.vocab_size)
        on_gpu = self.device.type == "cuda"
        free, card_bytes = torch.cuda.mem_get_info(self.device) if on_gpu else (None, None)
        options = resolve_prefill_chunk(self.art, options, card_bytes)  # `auto` sized by the card, as in fit
        if on_gpu and available_bytes is None:
            available_bytes = free
        cuda_graphs = cuda_graphs and options.cuda_graphs  # either switch turns graphs off (the plan's is fit's)
        opts = options if on_gpu and cuda_graphs else _no_graphs(options)
        self.plan = require_fit(self.art, opts, available_bytes) if available_bytes else build_plan(self.art, opts)
        self.opts = opts
        self.shared_chunk = opts.shared_chunk  # the lanes bench varies it
        self.codec = get_codec(opts.kv_dtype)
        self.mem = DeviceMemory(self.plan, self.device)
        if random_weights_seed is None:
            self.mem.load_weights(self.art)
        else:  # benchmark of a shape-only artifact: weights are generated on the device
            self.mem.fill_random(self.art, random_weights_seed)
        self.act_dtype = torch.bfloat16 if on_gpu else torch.float32
        self.lanes = opts.max_concurrency
        # rows of x a decode step multiplies at most: the lanes' verify blocks when speculating
        self.rows_per_step = self.lanes * (1 + (opts.draft_tokens if opts.spec != "none" else 0))
        if HEAD_FRAGMENT not in ("auto", "off"):
            raise MemoryPlanError(f"NINFER_HEAD_FRAGMENT={HEAD_FRAGMENT!r} is not a head path; use auto or off (or "
                                  "unset it)")
        self._bind_weights()
        self._bind_state()
        self.vision = None
        if opts.vision:
            from .vision import VisionTower

            packed = {n: lin.packed for n, lin in self.lin.items() if n.startswith("vision/") and isinstance(lin, QuantLinear)}
            self.vision = VisionTower.from_artifact(self.art, self.device, self.act_dtype, resident=self.vec,
                                                    resident_packed=packed)
        self.stats = EngineStats()
        self.use_graphs = on_gpu and cuda_graphs
        self.piece_graphs = PIECE_GRAPHS and self.use_graphs  # padding only pays where a graph replays it
        # prefill GDN through fla's chunked kernel when it is installed (NINFER_GDN_PREFILL=recurrent: ours)
        self.chunked_gdn = on_gpu and fla_available() and setting("NINFER_GDN_PREFILL") != "recurrent"
        # MoE prefill experts (kernels/moe.py): NINFER_MOE_PREFILL=fused or dense forces one of expert_prefill's
        # paths (auto: by chunk length), loop: one GEMM per active expert (the path before them, for side-by-side runs)
        self.moe_prefill = setting("NINFER_MOE_PREFILL")
        if ATTENTION_LAUNCHES not in ("fused", "separate"):
            raise MemoryPlanError(f"NINFER_ATTENTION_LAUNCHES={ATTENTION_LAUNCHES!r} is not an attention path; use "
                                  "fused or separate (or unset it)")
        if WEIGHT_CACHE not in ("auto", "off"):
            raise MemoryPlanError(f"NINFER_WEIGHT_CACHE={WEIGHT_CACHE!r} is not a weight-cache mode; use auto or off "
                                  "(or unset it)")
        if MOE_DECODE not in ("fused", "separate"):
            raise MemoryPlanError(f"NINFER_MOE_DECODE={MOE_DECODE!r} is not a MoE decode path; use fused or separate "
                                  "(or unset it)")
        if self.chunked_gdn and self.cfg.num_layers > sum(map(self.cfg.is_full_attention, range(self.cfg.num_layers))):
            c = self.cfg
            why = chunked_probe(c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                                c.linear_value_head_dim, self.device)
            if why:
                print(f"ninfer: chunked GDN prefill unavailable for this model ({why}); using the recurrent kernel",
                      file=sys.stderr)
                self.chunked_gdn = False
        self._graphs: dict[tuple, tuple] = {}
        self._warmed_up = False  # warm_up ran: any later capture is a shape it missed
        self._eager_keys: set[tuple] = set()  # steps that cannot be captured (MoE prefill path syncs)
        self._ride_pool = None  # memory pool of the prefill-with-riders graphs
        self.weight_cache_bytes = 0
        if on_gpu and opts.weight_cache == "auto" and WEIGHT_CACHE != "off":
            self._keep_dense_weights(available_bytes - self.plan.total_bytes - weight_cache_reserve(card_bytes))

    def _keep_dense_weights(self, spare_bytes: int) -> None:
        """Memory the plan leaves unused (the context asked for is shorter than the card allows) holds dense
        copies of the layer products, so prefill chunks skip dequantizing them (kernels/qlinear.py
        keep_dense_copies). The longest context always wins: a plan that fills the card keeps none."""
        layer = [self.lin[name].packed for name, _ in weight_cache_candidates(self.art)
                 if isinstance(self.lin.get(name), QuantLinear)]
        kept = keep_dense_copies(layer, spare_bytes, self.act_dtype) if layer and spare_bytes > 0 else []
        self.weight_cache_bytes = sum(w.resident_dense.numel() * w.resident_dense.element_size() for w in kept)
        if kept and len(kept) == len(layer):  # --prefill-chunk-shared auto: shorter riding chunks (memory_plan)
            self.shared_chunk = shared_chunk_for(self.opts, weights_cached=True)
        if kept:
            print(f"ninfer: dense copies of {len(kept)} of {len(layer)} layer products in spare memory "
                  f"({self.weight_cache_bytes / 2**30:.1f} GiB): prefill skips their dequantization "
                  "(--weight-cache off keeps the memory free)", file=sys.stderr)

    # --- binding ------------------------------------------------------------------------

    def _lays_out_head(self, name: str, packed: PackedLinear) -> bool:
        """Whether the output head goes to fragment order (in place; NINFER_HEAD_FRAGMENT=auto): a Q6 head (the Q4 and
        Q5 recipes') wherever fragment order is on, at one row too (H100, session 35, the 27B head: one row 321.9
        against 350.5 us on the dp4a GEMV, 2-16 rows 324.8-400.9 against 477.3-671.5 on the int8 row kernels:
        `bench/gemv_compare.py OUT head`); a Q4/Q5 head as the layer products of that width."""
        if name != "text/output_head" or HEAD_FRAGMENT != "auto" or not in_place_supported(packed):
            return False
        return fragment_layout_enabled(self.rows_per_step if packed.fmt.bits != 6 else 2, packed.fmt.bits)

    def _lays_out_experts(self, name: str, packed: PackedLinear) -> bool:
        """Whether a MoE layer's stacked routed experts go to fragment order (in place; NINFER_MOE_FRAGMENT: auto on a
        GPU engine of several rows a step, or on): Q4/Q5 with whole 16-row blocks per expert (gate/up 32: its gate
        and up halves) and K whole 512-lane chunk pairs, for the decode's fragment expert launches (moe_fragment)."""
        c = self.cfg
        wanted = MOE_FRAGMENT == "on" or (MOE_FRAGMENT == "auto" and self.device.type == "cuda"
                                          and self.rows_per_step > 1)
        if not wanted or not c.is_moe or not name.endswith(MOE_FRAGMENT_OBJECTS) \
                or packed.fmt.bits not in (4, 5) or not in_place_supported(packed):
            return False
        return c.moe_intermediate_size % 512 == 0 and c.hidden_size % 512 == 0  # both products' K and blocks

    def _bind_weights(self) -> None:
        self.lin: dict[str, DenseLinear | QuantLinear] = {}
        routers: dict[str, torch.Tensor] = {}
        self.vec: dict[str, torch.Tensor] = {}
        for r in self.plan.arenas["weights"].regions:
            e = self.art.objects[r.name]
            raw = self.mem.raw("weights", r.name)
            fmt = get_format(e.format)
            if isinstance(fmt, GroupedFormat):
                geo = RowSplitGeometry(e.shape[0], e.shape[1], fmt)
                packed = PackedLinear(*geo.split(raw), geo.rows, geo.cols, fmt)
                rows = self.rows_per_step
                layer = fragment_layout_enabled(rows, fmt.bits, r.name) and takes_fragment_layout(r.name, packed, rows)
                experts = not layer and self._lays_out_experts(r.name, packed)
                if layer or experts or self._lays_out_head(r.name, packed):
                    # in place: the plan's bytes, permuted (a CPU reads them back)
                    to_fragment_layout(packed, layer_order(fmt.bits) if layer or experts else None)
                self.lin[r.name] = QuantLinear(packed)
                continue
            if isinstance(fmt, FloatCodeFormat):
                self.lin[r.name] = CodeLinear(float_codes(e.format, raw, e.shape[0], e.shape[1]))
                continue
            dtype = {"BF16": torch.bfloat16, "FP32": torch.float32, "I32": torch.int32}[e.format]
            t = raw.view(dtype).view(*e.shape) if e.shape else raw.view(dtype)
            if r.name.endswith("moe/router"):
                routers[r.name] = t
            if e.format == "BF16" and self.act_dtype != torch.bfloat16:
                t = t.to(self.act_dtype)  # CPU interpreter path computes in float32
            if len(e.shape) == 2 and e.component in ("text", "mtp", "lm_head_draft", "dflash2") \
                    and not r.name.endswith("convolution"):
                self.lin[r.name] = DenseLinear(t)
            self.vec[r.name] = t
        # a MoE layer's router and shared-expert gate (both [*, hidden] bf16) lie next to each other in the
        # plan: one product over both rows gives the routing logits and the gate logit (a launch less per layer)
        self.router_and_gate: dict[str, DenseLinear] = {}
        for name, router in routers.items() if MOE_DECODE == "fused" else ():
            prefix = name[: -len("router")]
            region = ("weights", prefix + "shared_gate")
            gate = self.mem.raw(*region) if region in self.mem.regions else None
            if gate is not None and gate.data_ptr() == router.data_ptr() + router.numel() * router.element_size() \
                    and gate.numel() == router.shape[1] * router.element_size():
                both = router.as_strided((router.shape[0] + 1, router.shape[1]), (router.shape[1], 1))
                self.router_and_gate[prefix] = DenseLinear(both.to(self.act_dtype))

    @property
    def fragment_order_products(self) -> int:
        """Layer products re-laid out in fragment order at bind (the server's start-up line and the benches say it)."""
        return sum(isinstance(lin, QuantLinear) and lin.packed.fragment is not None for lin in self.lin.values())

    def _bind_state(self) -> None:
        c, lanes = self.cfg, self.lanes
        ppl = self.plan.pages_per_lane
        self.block_table = self.mem.view("kv_pool", "block_tables", torch.int32, (lanes, ppl))
        self.block_table.copy_(torch.arange(lanes * ppl, dtype=torch.int32).view(lanes, ppl))
        self.pools: dict[int, dict[str, torch.Tensor]] = {}
        for i in range(c.num_layers):
            if c.is_full_attention(i):
                self.pools[i] = {
                    p.name: self.mem.view("kv_pool", f"layer{i}/{p.name}", p.dtype,
                                          (self.plan.pages, PAGE, c.num_kv_heads, p.width))
                    for p in self.codec.planes(c.head_dim)}
        gdn = [i for i in range(c.num_layers) if not c.is_full_attention(i)]
        self.slots = (1 if self.opts.spec == "none" else self.opts.draft_tokens + 2) + 1
        self.checkpoint_slot = self.slots - 1  # GDN state at the lane's turn checkpoint
        # slot stacks [gdn layers, lanes, slots, ...]: slot 0 is committed, slots 1.. hold verify snapshots
        self.conv_stack = self.mem.view("sequence_state", "gdn_conv", torch.bfloat16,
                                        (len(gdn), lanes, self.slots, c.conv_kernel - 1, c.gdn_conv_dim))
        self.rec_stack = self.mem.view("sequence_state", "gdn_recurrent", torch.float32,
                                       (len(gdn), lanes, self.slots, c.linear_num_value_heads, c.linear_key_head_dim,
                                        c.linear_value_head_dim))
        self.gdn_slot = {layer: j for j, layer in enumerate(gdn)}
        # gdn_fused's per-head counters for the output norm in its launch (GdnGate): zero between launches
        self.gdn_norm_counts = torch.zeros(lanes * c.linear_num_value_heads, dtype=torch.int32, device=self.device)
        self.ctx_len = self.mem.view("sequence_state", "lane_context_lengths", torch.int32, (lanes,))
        self.ctx_len.zero_()
        # the tokens whose KV and recurrent state each lane holds, for prefix reuse across requests
        self.lane_tokens: list[list[int]] = [[] for _ in range(lanes)]
        # MRoPE: after an image the rotary position of token i is i + rope_delta (text-only lanes: 0)
        self.rope_delta = [0] * lanes
        self.lane_has_images = [False] * lanes
        # tokens covered by the lane's turn checkpoint (0 = none): its KV prefix plus the GDN state
        # saved in checkpoint_slot, so a prompt that diverges later can resume there
        self.checkpoint_at = [0] * lanes
        # --draft-vocab: drafts from the output head's first rows (token ids 0..N-1; BPE ids run roughly from
        # frequent to rare), a view of its planes
        self.draft_head = None
        if self.opts.draft_vocab:
            head, n = self.lin["text/output_head"], min(self.opts.draft_vocab, self.token_limit)
            if getattr(head, "packed", None) is not None and head.packed.fragment is not None:
                n = max(n - n % ROWS_PER_BLOCK, ROWS_PER_BLOCK)  # whole 16-row blocks of fragment order
            self.draft_head = head.rows(0, n)
        # the speculative decoder (runtime/speculate.py), None without --spec
        self.speculator = None
        if self.opts.spec == "mtp":
            from .mtp import MtpState

            self.speculator = MtpState.bind(self)
        elif self.opts.spec == "dflash2":
            from .dflash2 import DFlash2State

            self.speculator = DFlash2State.bind(self)

    def reset_lane(self, lane: int) -> None:
        self.conv_stack[:, lane, 0].zero_()
        self.rec_stack[:, lane, 0].zero_()
        self.ctx_len[lane] = 0
        self.lane_tokens[lane] = []
        self.rope_delta[lane] = 0
        self.lane_has_images[lane] = False
        self.checkpoint_at[lane] = 0
        if self.speculator is not None:
            self.speculator.reset_lane(lane)

    def warm_up(self) -> int:
        """Capture, before serving, the CUDA graphs a server meets as requests come and go: a decode step of every
        batch size (with --vision at shifted rotary positions too, and the tower run once), with --spec a
        speculative round of every batch size, else every padded prompt piece and whole shared chunk, alone and with
        each count of riding decode rows. Captured mid-serving instead, each would stop every lane for an eager
        forward and the capture, and the first of a shape for the kernels it compiles (seconds on a full-size
        model). Runs the serving paths themselves over placeholder tokens on the free lanes, then clears every lane
        and the counts; returns the graphs captured. Only before any lane holds a request."""
        if not self.use_graphs:
            return 0
        if any(self.lane_tokens):
            raise RuntimeError("Engine.warm_up: a lane holds a request; warm up before serving")
        spec = self.speculator
        before = len(self._graphs)
        stats = copy.deepcopy((self.stats, spec.stats if spec is not None else None))
        try:
            for rows in range(1, self.lanes + 1):
                self.decode_step(list(range(rows)), [0] * rows)
                if self.vision is not None:  # lanes after an image: shifted rotary positions, graphs of their own
                    self.rope_delta[:rows] = [1] * rows
                    self.decode_step(list(range(rows)), [0] * rows)
                    self.rope_delta[:rows] = [0] * rows
            if spec is not None:  # a speculative round of every batch size: its draft and verify graphs
                for rows in range(1, self.lanes + 1):
                    lanes = list(range(rows))
                    for lane in lanes:
                        for _ in self.prefill_chunks(lane, [0] * 8):  # a current drafter state to draft from
                            pass
                    if all(spec.can_speculate(lane) for lane in lanes):
                        spec.round(lanes, [0] * rows, [spec.k + 1] * rows)
            else:  # (speculating engines prefill eagerly: nothing rides)
                for length, riding in self._warm_up_prompts():
                    self._warm_up_prompt(length, list(range(1, riding + 1)))
            if self.vision is not None:  # the tower's kernels, on a blank image of 2 x 2 merged patches
                from .vision import patchify

                side = 2 * self.vision.cfg.patch_size * self.vision.cfg.spatial_merge_size
                self.vision.encode(patchify(torch.zeros(3, side, side), self.vision.cfg))
            if self.device.type == "cuda":  # the sampler's variants too (a request's sampling settings pick one)
                compile_every_variant(self.cfg.vocab_size, self.device)
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            for lane in range(self.lanes):
                self.reset_lane(lane)
            self.stats = stats[0]
            if spec is not None:
                spec.stats = stats[1]
        self._warmed_up = True
        return len(self._graphs) - before

    def _warm_up_prompts(self) -> list[tuple[int, int]]:
        """(prompt length, riding lanes) pairs that meet every prompt graph prefill_chunks can pick: a piece padded
        to each bucket (the shortest length it takes, and with riders the longest that leaves them its last rows,
        RIDE_ALIGN, and the bucket itself) and, with riders, the whole shared chunk."""
        pairs = []
        for riding in range(self.lanes):
            lengths = {self.shared_chunk, self.shared_chunk - riding} if riding else set()
            if self.piece_graphs:
                for shorter, bucket in zip((0,) + PIECE_BUCKETS, PIECE_BUCKETS):
                    lengths |= {shorter + 1, bucket - riding, bucket}
            pairs += [(n, riding) for n in sorted(lengths) if 0 < n < self.opts.max_context - 1]
        return pairs

    def _warm_up_prompt(self, length: int, rider_lanes: list[int]) -> None:
        """Prefill a placeholder prompt of `length` tokens in lane 0 with `rider_lanes` offered to every chunk, as the
        scheduler offers its decoding lanes; then clear them all."""
        riders = Riders()
        chunks = self.prefill_chunks(0, [0] * length, riders=riders)
        while True:
            riders.offer(rider_lanes, [0] * len(rider_lanes))
            if next(chunks, StopIteration) is StopIteration:
                break
        for lane in [0] + rider_lanes:
            self.reset_lane(lane)

    @property
    def graphs_captured(self) -> int:
        """CUDA graphs captured so far: one a decode batch size, prompt-piece bucket or riding-chunk shape, each
        captured by warm_up or else on first use (a capture costs an eager forward and the capture)."""
        return len(self._graphs)

    def held_tokens(self, lane: int) -> int:
        """Tokens in the lane's cache once its prefill is done (== ctx_len, read without a device sync)."""
        return len(self.lane_tokens[lane])

    def reusable_prefix(self, lane: int, prompt: list[int]) -> int:
        """Tokens of `prompt` this lane can skip. Recurrent (GDN) state cannot be rewound, so either the
        lane's *whole* history is a strict prefix of the prompt, or the prompt agrees with it up to the
        lane's turn checkpoint, whose GDN state was saved."""
        return max(self._continuation(lane, prompt), self._checkpoint_match(lane, prompt))

    def _continuation(self, lane: int, prompt: list[int]) -> int:
        held = self.lane_tokens[lane]
        if self.lane_has_images[lane]:
            return 0  # placeholder ids do not identify the image they stood for
        if self.speculator is not None and not self.speculator.is_current(lane):
            return 0  # the drafter's state would have a gap; start over
        if held and len(held) < len(prompt) and prompt[: len(held)] == held:
            return len(held)
        return 0

    def _checkpoint_match(self, lane: int, prompt: list[int]) -> int:
        c = self.checkpoint_at[lane]
        if c == 0 or self.lane_has_images[lane] or len(prompt) <= c:
            return 0
        return c if prompt[:c] == self.lane_tokens[lane][:c] else 0

    # --- layers -------------------------------------------------------------------------

    @staticmethod
    def kv_slots(block_table, ctx_len, lanes_idx, t, positions):
        """Where this block's K/V rows go (page, slot) and the lanes' block tables and lengths; the same
        for every attention layer of a forward, so computed once per forward."""
        return kv_slots(block_table, ctx_len, lanes_idx, t, positions, PAGE)

    def _attention(self, p, pool, block_table, ctx_len, h, lanes_idx, t, positions, rope_positions=None,
                   slots=None, xq=None, host_ctx=None):
        """Full attention of weights under prefix `p` over `pool`; appends this block's K/V first.
        The result may be the output product's SplitPartials: pass it to rmsnorm, which sums them.
        The query row j of a lane sits at position ctx_len - t + j. `rope_positions` (shifted [n] or
        MRoPE [3, n]) replace `positions` for the rotary embedding only; `slots` = kv_slots(...); `host_ctx`: the
        lanes' ctx_len on the host (eager prefill chunks), see paged_attention."""
        c = self.cfg
        n = h.shape[0]
        qgkv = self.lin[p + "query_gate_key_value"](h, xq)
        qg, k, v = qgkv.split([c.q_gate_rows, c.kv_rows, c.kv_rows], dim=-1)
        rope = positions if rope_positions is None else rope_positions
        page, slot, lane_tables, lane_ctx, *ride = slots or self.kv_slots(block_table, ctx_len, lanes_idx, t, positions)
        if rope.dim() == 1 and self.codec.key in KV_APPEND_KINDS and self.codec.value in KV_APPEND_KINDS \
                and c.head_dim % 64 == 0 and ATTENTION_LAUNCHES == "fused":
            # norms, RoPE, the KV append and the rotations in one launch
            qr = attention_inputs(qgkv, c.num_heads, c.num_kv_heads, c.head_dim, self.vec[p + "query_norm"],
                                  self.vec[p + "key_norm"], c.rms_norm_eps, rope, c.rotary_dim, c.rope_theta,
                                  self.codec, self._planes(pool, "k"), self._planes(pool, "v"), page, slot)
            return self._attend(p, pool, qr, qg, n, lanes_idx, t, lane_tables, lane_ctx, ride, host_ctx)
        if rope.dim() == 1:  # norms and RoPE of the query and key heads in one launch
            q, k = qk_norm_rope(qgkv, c.num_heads, c.num_kv_heads, c.head_dim, self.vec[p + "query_norm"],
                                self.vec[p + "key_norm"], c.rms_norm_eps, rope, c.rotary_dim, c.rope_theta)
        else:  # 3-axis MRoPE (prefill chunks holding images): torch ops, once per image prompt
            q = qg.reshape(n, c.num_heads, 2 * c.head_dim)[..., : c.head_dim].contiguous()
            q, _ = rmsnorm(q.view(-1, c.head_dim), self.vec[p + "query_norm"], c.rms_norm_eps)
            k, _ = rmsnorm(k.contiguous().view(-1, c.head_dim), self.vec[p + "key_norm"], c.rms_norm_eps)
            cos, sin = rope_cos_sin(rope, c.rotary_dim, c.rope_theta, torch.float32, c.mrope_section)
            q = apply_partial_rope(q.view(n, c.num_heads, c.head_dim).float(), cos, sin).to(self.act_dtype)
            k = apply_partial_rope(k.view(n, c.num_kv_heads, c.head_dim).float(), cos, sin).to(self.act_dtype)
        v = v.reshape(n, c.num_kv_heads, c.head_dim)
        # append K/V into the lanes' pages at their positions
        self._append_kv(pool, k.view(n, c.num_kv_heads, c.head_dim), v, page, slot)
        qr = rotate64(q, self.act_dtype) if self.codec.rotate_keys else q  # keys are stored rotated
        return self._attend(p, pool, qr, qg, n, lanes_idx, t, lane_tables, lane_ctx, ride, host_ctx)

    def _planes(self, pool, side: str) -> list[torch.Tensor]:
        """The pool planes of keys ("k") or values ("v"), in the codec's plane order."""
        return [pool[pl.name] for pl in self.codec.planes(self.cfg.head_dim) if pl.name.startswith(side + "_")]

    def _attend(self, p, pool, qr, qg, n, lanes_idx, t, lane_tables, lane_ctx, ride, host_ctx=None):
        """Paged attention of the (rotated) queries, the output gate and the output product."""
        c = self.cfg
        main = len(lanes_idx) * t
        # times sigmoid(gate), rotated back from the value storage basis first when the codec rotates: in the
        # attention's combine launch (decode, verify, riders), after it for a prefill chunk's rows
        out_xq = self._quantized_input(p + "output", n)
        gate = AttentionGate(qg, self.codec.rotate_values, c.num_heads, c.head_dim, self.act_dtype, out_xq)
        fused = ATTENTION_LAUNCHES == "fused"
        out = paged_attention(qr[:main].view(len(lanes_idx), t, c.num_heads, c.head_dim), pool, self.codec,
                              lane_tables, lane_ctx, c.head_dim ** -0.5, gate=gate.part(0) if fused else None,
                              host_ctx=host_ctx)
        if not fused:
            gate.part(0).apply(out)
        if ride:  # riders: one decode row per lane after the chunk's rows
            rider_lanes, rider_tables, rider_ctx = ride[0]
            out = paged_attention(qr[main:].view(len(rider_lanes), 1, c.num_heads, c.head_dim), pool, self.codec,
                                  rider_tables, rider_ctx, c.head_dim ** -0.5, gate=gate.part(main) if fused else None)
            if not fused:
                gate.part(main).apply(out)
        return self.lin[p + "output"](gate.finish(), out_xq, defer_sum=True)  # summed by the next rmsnorm

    def _append_kv(self, pool, k, v, page, slot):
        """Encode K/V [n, HKV, D] into the pool: one kernel per side for the sub-codecs kv_append encodes
        (the integer ones and e8cube), the torch encoder for the others."""
        codec = self.codec
        if codec.key in KV_APPEND_KINDS and codec.value in KV_APPEND_KINDS:
            append_keys_values(k, v, codec, self._planes(pool, "k"), self._planes(pool, "v"), page, slot)
            return
        page, slot = page.long(), slot.long()
        for name, val in codec.encode(k.float(), v.float()).items():
            pool[name][page, slot] = val

    def _gdn(self, i, h, lanes_idx, t, snapshot=False, xq=None, riders=None, pad=None, real_rows=None):
        """Gated DeltaNet mixer of layer i; `xq`: h as the first product's dp4a words; `riders`: lanes with
        one decode row each after the chunk's rows (their products shared with it, their recurrence
        separate). The result may be the output product's SplitPartials: pass it to rmsnorm, which sums them."""
        c, p = self.cfg, f"text/layers/{i}/gdn/"
        qkvz_w = self.lin[p + "query_key_value_z"]
        qkvz = None
        if h.shape[0] == 1 and riders is None and pad is None and real_rows is None and not snapshot \
                and c.conv_kernel == 4 and isinstance(qkvz_w, QuantLinear):  # one decode row: the conv in its launch
            qkvz = qlinear_conv(h, qkvz_w.packed, self.conv_stack[self.gdn_slot[i]], lanes_idx,
                                self.vec[p + "convolution"], xq)
        conv_done = qkvz is not None
        if not conv_done:
            qkvz = qkvz_w(h, xq)
        qkv, z = qkvz.split([c.gdn_conv_dim, c.gdn_value_dim], dim=-1)
        alpha_w, beta_w = self.lin[p + "alpha_projection"], self.lin[p + "beta_projection"]
        projections = None
        if h.shape[0] <= PROJECT_MAX_ROWS and riders is None and pad is None and isinstance(alpha_w, DenseLinear) \
                and isinstance(beta_w, DenseLinear):
            # decode / verify: the recurrence kernel multiplies them itself (a launch less)
            alpha = beta = None
            projections = (h, alpha_w.weight, beta_w.weight)
        else:
            alpha, beta = alpha_w(h), beta_w(h)
        main = len(lanes_idx) * t
        n = h.shape[0]
        out_xq = self._quantized_input(p + "output", n)
        norm = GdnGate(z, self.vec[p + "norm"], c.rms_norm_eps,
                       torch.empty(n, z.shape[1], dtype=self.act_dtype, device=h.device), self.gdn_norm_counts, out_xq)
        # the output norm in the recurrence's launch, or (gate None) in its own
        gate = norm if GDN_NORM_EPILOGUE and riders is None and pad is None else None
        if pad is not None:  # padding rows: decay 1 (alpha -> softplus 0) and beta 0 leave the recurrence as it was
            alpha, beta = alpha.clone(), beta.clone()
            alpha[:main].masked_fill_(pad[:, None], PAD_GATE)
            beta[:main].masked_fill_(pad[:, None], PAD_GATE)
        o = self._gdn_mix(i, qkv[:main], alpha if alpha is None else alpha[:main], beta if beta is None else beta[:main],
                          lanes_idx, t, snapshot, projections, real_rows, conv_done, gate)
        if gate is not None:
            gated = o
        elif riders is None:
            gated = norm.apply(o)
        else:  # the chunk's rows and the riders' normed into one block, each where it lies (no join of the two)
            o_r = self._gdn_mix(i, qkv[main:], alpha[main:], beta[main:], riders, 1, False, None)
            for rows, part in ((slice(0, main), o), (slice(main, n), o_r)):
                norm.rows(rows).apply(part)
            gated = norm.out
        return self.lin[p + "output"](gated, out_xq, defer_sum=True)  # summed by the next rmsnorm

    def _gdn_mix(self, i, qkv, alpha, beta, lanes_idx, t, snapshot, projections, real_rows=None, conv_done=False,
                 gate=None):
        """Convolution and recurrence of layer i for `lanes_idx` with t rows each; returns o [B, T, HV, DV], or
        with `gate` (GdnGate) the output norm's rows gate.out [B*T, HV*DV].
        `real_rows` (one lane): rows past it are padding, so the conv window kept is the one after the real rows.
        `conv_done`: qkv is already the conv's output (qlinear_conv, its window moved on)."""
        c, p = self.cfg, f"text/layers/{i}/gdn/"
        b = len(lanes_idx)
        j = self.gdn_slot[i]
        conv_stack = self.conv_stack[j]
        weight = self.vec[p + "convolution"]
        window_before = conv_stack[lanes_idx, 0].clone() if real_rows is not None else None
        chunked = not snapshot and t >= CHUNKED_MIN_TOKENS and self.chunked_gdn and projections is None
        sections = None  # the conv's q, k, v as dense tensors, for the chunked kernel
        if conv_done:
            x = qkv.reshape(b, t, -1)
        elif c.conv_kernel == 4:
            # lane-indexed kernel: reads and writes the slot stack in place, snapshots included
            # inputs in the state's dtype (a no-op on the GPU), so carried and fresh rows round alike
            x = qkv.reshape(b, t, -1).to(conv_stack.dtype)
            if chunked and CONV_SECTIONS:
                sections = causal_conv1d_lanes(x, conv_stack, lanes_idx, weight, snapshot,
                                               split_keys=c.linear_num_key_heads * c.linear_key_head_dim)
            else:
                x = causal_conv1d_lanes(x, conv_stack, lanes_idx, weight, snapshot)
        else:
            conv_state = conv_stack[lanes_idx, 0]  # a small copy: W-1 rows per lane
            x_in = qkv.reshape(b, t, -1).to(conv_state.dtype)
            if snapshot:  # the conv window after each step, for rollback to any accepted prefix
                seq = torch.cat([conv_state, x_in], dim=1)
                w = c.conv_kernel - 1
                conv_stack[lanes_idx, 1 : t + 1] = torch.stack([seq[:, s + 1 : s + 1 + w] for s in range(t)], dim=1)
            x = causal_conv1d(x_in, conv_state, weight.to(conv_state.dtype))
            conv_stack[lanes_idx, 0] = conv_state
        if window_before is not None:  # the window after the real rows: inputs real_rows .. real_rows + W - 2 of
            # [window, x], gathered from whichever of the two holds each (W - 1 rows, not the whole block)
            w = window_before.shape[1]
            keep = real_rows + torch.arange(w, device=qkv.device)
            from_window = window_before.index_select(1, keep.clamp(max=w - 1))
            from_block = qkv.reshape(b, t, -1).index_select(1, (keep - w).clamp(min=0)).to(window_before.dtype)
            conv_stack[lanes_idx, 0] = torch.where((keep < w)[None, :, None], from_window, from_block)
        o = None
        if chunked:
            try:
                o = gdn_chunked(sections if sections is not None else x, alpha, beta, self.vec[p + "a_log"],
                                self.vec[p + "dt_bias"], self.rec_stack[j], lanes_idx, c.linear_num_key_heads)
            except Exception as exc:  # noqa: BLE001 - fla failed on this input: the recurrent kernel takes over
                print(f"ninfer: chunked GDN prefill failed ({type(exc).__name__}: {exc}); using the recurrent "
                      "kernel from now on", file=sys.stderr)
                self.chunked_gdn = False
                if sections is not None:  # the recurrent kernel reads the conv's output whole
                    x = torch.cat(sections, dim=-1)
        if o is None:
            return gdn_fused(x, alpha, beta, self.vec[p + "a_log"], self.vec[p + "dt_bias"], self.rec_stack[j],
                             lanes_idx, c.linear_num_key_heads, snapshot, projections=projections, gate=gate)
        return o if gate is None else gate.apply(o)  # the chunked kernel's rows, normed in their own launch

    def _ffn(self, p, h, xq=None, both_logits=None):
        """The MLP (dense) or MoE block of the layer under prefix `p`; `xq`: h as the gate/up product's
        dp4a words (dense MLP); `both_logits`: the router + shared gate's product of h, taken by the norm before
        (ROUTER_IN_NORM_ROWS). The result may be SplitPartials or ExpertPartials: pass it to rmsnorm, which
        sums or combines them."""
        c = self.cfg
        if not c.is_moe:
            down_xq = self._quantized_input(p + "mlp/down", h.shape[0])
            gate_up = self.lin[p + "mlp/gate_up"]
            act = None
            if down_xq is None and isinstance(gate_up, QuantLinear):  # one row: SwiGLU in the product's launch
                act = qlinear_swiglu(h, gate_up.packed, xq)
            if act is None:
                act = swiglu(gate_up(h, xq), xq=down_xq)
            return self.lin[p + "mlp/down"](act, down_xq, defer_sum=True)
        m = p + "moe/"
        n, k = h.shape[0], c.experts_per_token
        inter, hid = c.moe_intermediate_size, c.hidden_size
        gate_up, down = self.lin[m + "experts_gate_up"], self.lin[m + "experts_down"]
        shared_up, shared_down = self.lin[m + "shared_gate_up"], self.lin[m + "shared_down"]
        both = self.router_and_gate.get(m)
        if both is not None:  # one product: the routing logits, then the shared gate's (a strided column)
            logits = both(h) if both_logits is None else both_logits
            router_logits, shared_gate = logits[:, :-1], logits[:, -1:]
        else:  # the gate's logits: the combine applies the sigmoid
            router_logits, shared_gate = self.lin[m + "router"](h), self.lin[m + "shared_gate"](h)
        quantized = isinstance(gate_up, QuantLinear) and isinstance(down, QuantLinear)
        if quantized and n <= MOE_FRAGMENT_MAX_TOKENS and gate_up.packed.fragment is not None \
                and down.packed.fragment is not None:
            # decode / verify over experts in fragment order: two launches (SwiGLU in the first; routing too for
            # one token, else a route launch before them and expert by expert), the shared expert riding after the
            # routed pairs where it can (else its own products); the next RMSNorm weighs, gates and sums
            rides = all(isinstance(s, QuantLinear) and shared_rides(s.packed, rows, cols)
                        for s, rows, cols in ((shared_up, 2 * inter, hid), (shared_down, hid, inter)))
            expert_major = 0 < MOE_FRAGMENT_TUNING["expert_major"] <= n
            if expert_major:  # routed first: each expert's programs multiply it for every token that picked it
                ids, weights = route(router_logits, k)
                pairs, route_into = ids.reshape(-1), None
            else:
                pairs = torch.empty(n * k, dtype=torch.int32, device=h.device)
                weights = torch.empty(n, k, dtype=torch.float32, device=h.device)
                route_into = (router_logits, weights)
            act = fragment_expert_gemv(h, pairs, gate_up.packed, 2 * inter, k, True,
                                       shared=shared_up.packed if rides else None, route_into=route_into,
                                       expert_major=expert_major)
            down_major = expert_major and 0 < MOE_FRAGMENT_TUNING["down_major"] <= n
            y = fragment_expert_gemv(act, pairs, down.packed, hid, k, False,
                                     shared=shared_down.packed if rides else None, expert_major=down_major)
            if rides:
                return ExpertPartials(y[: n * k], weights, y[n * k :], shared_gate)
            return ExpertPartials(y, weights, shared_down(swiglu(shared_up(h))), shared_gate)
        if quantized and n <= GEMV_MAX_T and MOE_DECODE == "fused" and all(
                isinstance(s, QuantLinear) and shared_fusable(e.packed, s.packed, rows)
                for e, s, rows in ((gate_up, shared_up, 2 * inter), (down, shared_down, hid))):
            # decode / verify: every (token, expert) pair and the shared expert's rows (after the pairs') in
            # one launch per matrix (pair p reads x row p // k, then its own row; the down launch applies
            # SwiGLU as it reads), no host sync; the next RMSNorm weighs, gates and sums
            # the gate/up launch routes too (each program its token's top-k): no route launch
            pairs = torch.empty(n * k, dtype=torch.int32, device=h.device)
            weights = torch.empty(n, k, dtype=torch.float32, device=h.device)
            apart = 0 < MOE_SHARED_APART_ROWS <= n  # the shared expert read once for every row (see the setting)
            gate_up_rows = expert_gemv(h, k, pairs, gate_up.packed, 2 * inter,
                                       shared=None if apart else shared_up.packed, route_into=(router_logits, weights))
            if apart:
                y = expert_gemv(gate_up_rows, 1, pairs, down.packed, hid, swiglu=True)
                return ExpertPartials(y, weights, shared_down(swiglu(shared_up(h))), shared_gate)
            y = expert_gemv(gate_up_rows, 1, pairs, down.packed, hid, shared=shared_down.packed, shared_x0=n * k,
                            swiglu=True)  # SwiGLU inside the down launch
            # combined by the RMSNorm after the block (weights, gate, sum): no combine launch
            return ExpertPartials(y[: n * k], weights, y[n * k :], shared_gate)
        shared = shared_down(swiglu(shared_up(h)))
        if quantized and (n <= GEMV_MAX_T or self.moe_prefill != "loop"):
            ids, weights = route(router_logits, k)
            if n > GEMV_MAX_T:  # prefill: pairs sorted by expert, grouped products
                return expert_prefill(h, ids, weights, gate_up.packed, down.packed, inter, c.num_experts, shared,
                                      swiglu, path=None if self.moe_prefill == "auto" else self.moe_prefill,
                                      shared_gate=shared_gate)
            # decode / verify with a shared expert the launches above cannot take (dense, or in fragment order)
            pairs = ids.reshape(-1)
            act = swiglu(expert_gemv(h, k, pairs, gate_up.packed, 2 * inter))
            y = expert_gemv(act, 1, pairs, down.packed, hid)
            return combine_experts(y, weights, shared, shared_gate=shared_gate)
        shared = shared * torch.sigmoid(shared_gate)
        probs = torch.softmax(router_logits.float(), dim=-1)
        weights, idx = torch.topk(probs, k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(h.dtype)
        out = torch.zeros_like(h)
        for e in idx.unique().tolist():  # unquantized experts (or NINFER_MOE_PREFILL=loop): a GEMM per expert
            rows, slot = (idx == e).nonzero(as_tuple=True)
            y = down.rows(e * hid, (e + 1) * hid)(swiglu(gate_up.rows(e * 2 * inter, (e + 1) * 2 * inter)(h[rows].contiguous())))
            out.index_add_(0, rows, y * weights[rows, slot, None])
        return out + shared

    # --- forward ------------------------------------------------------------------------

    def _quantized_input(self, name: str, rows: int) -> QuantizedX | None:
        """Empty dp4a words for product `name`'s input when it reads x quantized: the kernel producing
        that input (a norm, the gate, SwiGLU) fills them, and the product skips its own quantization."""
        lin = self.lin.get(name)
        if isinstance(lin, QuantLinear) and takes_quantized_x(lin.packed, rows):
            return QuantizedX.empty(rows, lin.packed, self.device)
        return None

    def _first_product(self, i: int) -> str:
        c = self.cfg
        p = f"text/layers/{i}/"
        return p + ("attention/query_gate_key_value" if c.is_full_attention(i) else "gdn/query_key_value_z")

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lin["text/token_embedding"].gather(tokens, self.act_dtype)

    @torch.no_grad()
    def forward(self, lanes_idx: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                all_logits: bool = False, snapshot: bool = False, with_hidden: bool = False,
                rope_positions: torch.Tensor | None = None, image_rows: tuple | None = None,
                taps: tuple[int, ...] = (), tap_rows: int | None = None, riders: tuple | None = None,
                real_rows: torch.Tensor | None = None, host_ctx: tuple[int, ...] | None = None):
        """tokens [B, T] for lanes `lanes_idx` at positions [B, T]; returns fp32 logits of the last position
        [B, V] (or of every position [B, T, V] with `all_logits`), plus the final-normed hidden states
        [B, T, H] with `with_hidden`. ctx_len of those lanes must already count the new tokens. With
        `snapshot`, GDN layers also keep the state after every step (speculative verification).
        `image_rows` = (row mask [B*T], embeddings) puts vision-tower output in place of placeholders;
        `rope_positions` ([B*T] or [3, B*T]) are the rotary positions when they differ from `positions`.
        With `taps` (layer indices), returns (logits, tapped) instead: each listed layer's output (the
        residual stream after it; the final-normed state for the last layer) for the last `tap_rows`
        positions of each lane (default all), side by side: [B, tap_rows, len(taps) * H].
        `riders` = (lanes [R], tokens [R], positions [R]): decode lanes (not in `lanes_idx`, ctx_len already
        counting their token) whose one row each rides after this block's rows: every product reads its
        weights once for both; their logits follow the block's: [B + R, V] (not with `all_logits` or taps).
        `real_rows` ([1] on the device, one lane): the block's rows past it are padding (see PIECE_GRAPHS); the
        logits are those of its last real row. `host_ctx`: the lanes' ctx_len as host ints, where the caller
        runs this forward eagerly and knows them (lets a prefill chunk's attention take cuDNN's kernel)."""
        c = self.cfg
        b, t = tokens.shape
        pad = None
        if real_rows is not None:
            if b != 1 or all_logits or taps or with_hidden or snapshot or image_rows is not None:
                raise ValueError("padded rows come with one lane's plain text prefill piece only")
            pad = torch.arange(t, device=tokens.device) >= real_rows
        ids = tokens.reshape(-1)
        pos = positions.reshape(-1).to(torch.int32)
        if riders is not None:
            if all_logits or taps or with_hidden or snapshot or image_rows is not None or rope_positions is not None:
                raise ValueError("decode rows ride with plain text prefill chunks only")
            rider_lanes = riders[0]
            ids = torch.cat([ids, riders[1].reshape(-1)])
            pos = torch.cat([pos, riders[2].reshape(-1).to(torch.int32)])
        x = self.embed(ids)
        if image_rows is not None:
            x[image_rows[0]] = image_rows[1].to(x.dtype)
        residual = x
        n = x.shape[0]
        # each norm also writes its output as the next product's dp4a words (QuantizedX)
        xq = self._quantized_input(self._first_product(0), n)
        h, _ = rmsnorm(x, self.vec["text/layers/0/input_norm"], c.rms_norm_eps, xq=xq)
        slots = self.kv_slots(self.block_table, self.ctx_len, lanes_idx, t, pos[: b * t])
        if riders is not None:  # the riders' pages and slots follow the block's; their tables ride along
            r_page, r_slot, r_tables, r_ctx = self.kv_slots(self.block_table, self.ctx_len, rider_lanes, 1, pos[b * t :])
            slots = (torch.cat([slots[0], r_page]), torch.cat([slots[1], r_slot]), slots[2], slots[3],
                     (rider_lanes, r_tables, r_ctx))
        r = t if tap_rows is None else tap_rows
        tapped = torch.empty(b, r, len(taps), c.hidden_size, dtype=x.dtype, device=x.device) if taps else None
        for i in range(c.num_layers):
            p = f"text/layers/{i}/"
            if c.is_full_attention(i):
                mixed = self._attention(p + "attention/", self.pools[i], self.block_table, self.ctx_len, h,
                                        lanes_idx, t, pos, rope_positions, slots, xq, host_ctx)
            else:
                mixed = self._gdn(i, h, lanes_idx, t, snapshot, xq, rider_lanes if riders is not None else None,
                                  pad, real_rows)
            xq = None if c.is_moe else self._quantized_input(p + "mlp/gate_up", n)
            both = self.router_and_gate.get(p + "moe/") if ROUTER_IN_NORM_ROWS and n <= GEMV_MAX_T else None
            logits = None if both is None else torch.empty(n, both.weight.shape[0], dtype=h.dtype, device=h.device)
            h, residual = rmsnorm(mixed, self.vec[p + "post_attention_norm"], c.rms_norm_eps, residual=residual, xq=xq,
                                  router=None if both is None else both.weight, router_out=logits)
            y = self._ffn(p, h, xq, logits)
            last = i + 1 == c.num_layers
            nxt = self.vec["text/final_norm"] if last else self.vec[f"text/layers/{i + 1}/input_norm"]
            xq = None if last else self._quantized_input(self._first_product(i + 1), n)
            h, residual = rmsnorm(y, nxt, c.rms_norm_eps, residual=residual, xq=xq)
            if i in taps:
                tapped[:, :, taps.index(i)] = (h if last else residual).view(b, t, -1)[:, t - r :]
        block_last = h[: b * t].view(b, t, -1)[:, -1] if pad is None else h.index_select(0, real_rows - 1)
        if riders is not None:
            last = torch.cat([block_last, h[b * t :]])
            return self.head_logits(last.contiguous())
        hidden = h.view(b, t, -1)
        if all_logits:
            logits = self.head_logits(h).view(b, t, -1)
        else:
            logits = self.head_logits(block_last.contiguous())
        if taps:
            return logits, tapped.view(b, r, -1)
        return (logits, hidden) if with_hidden else logits

    # --- generation ---------------------------------------------------------------------

    def prefill(self, lane: int, prompt: list[int]) -> torch.Tensor:
        """Chunked prefill of one lane from position 0; returns the last token's logits [V]."""
        logits = None
        for logits in self.prefill_chunks(lane, prompt):
            pass
        return logits

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits of the output head; the padded rows past the tokenizer's ids are -inf."""
        logits = self.lin["text/output_head"](h).float()
        if self.token_limit < logits.shape[-1]:
            logits[..., self.token_limit :] = float("-inf")
        return logits

    def prefill_chunks(self, lane: int, prompt: list[int], reuse: bool = False, images=None,
                       checkpoint_at: int | None = None, riders: Riders | None = None):
        """Prefill one chunk per step (a scheduler interleaves these with other lanes' decode steps);
        yields None after each chunk but the last, then the last token's logits [V]. With `reuse`, a
        prefix the lane already holds (see reusable_prefix) is not computed again. With `checkpoint_at`
        (a token count, e.g. where the final assistant header starts), the GDN state there is saved so
        the next turn, whose rendering may differ after that point, resumes from it. With MTP on, each
        chunk's hidden states also run through the MTP layer (DFlash2: its tapped hidden states are projected
        into the drafter's context cache), so drafting starts with a filled drafter state. With `riders`,
        other lanes' decode rows offered before a chunk ride in its forward (see Riders), and the chunk
        is --prefill-chunk-shared tokens while any are offered."""
        if not prompt:
            raise MemoryPlanError("the prompt is empty")
        if len(prompt) >= self.opts.max_context:
            raise MemoryPlanError(f"prompt of {len(prompt)} tokens leaves no room in --max-context {self.opts.max_context}")
        held = self._continuation(lane, prompt) if reuse and not images else 0
        restore = self._checkpoint_match(lane, prompt) if reuse and not images else 0
        if restore > held:
            held = restore
            c = self.checkpoint_slot
            self.conv_stack[:, lane, 0] = self.conv_stack[:, lane, c]
            self.rec_stack[:, lane, 0] = self.rec_stack[:, lane, c]
            if self.speculator is not None:
                self.speculator.restore_checkpoint(lane, held)
        elif held == 0:
            self.reset_lane(lane)
        if images or not checkpoint_at or checkpoint_at > len(prompt) or checkpoint_at <= held:
            checkpoint_at = None
        if checkpoint_at is None and held < self.checkpoint_at[lane]:
            self.checkpoint_at[lane] = 0  # the old checkpoint's tokens are about to be overwritten
        self.stats.reused_tokens += held
        self.lane_tokens[lane] = list(prompt)
        lane_t = device_ints([lane], self.device)
        chunk = self.opts.prefill_chunk
        spec = self.speculator
        rope3 = embeds = None
        if images:
            if self.vision is None:
                raise MemoryPlanError("this prompt has images but the engine was started without --vision")
            image_token = self.vision.ids.image
            embeds = torch.cat([self.vision.encode(img) for img in images])
            if embeds.shape[0] != sum(1 for tok in prompt if tok == image_token):
                raise MemoryPlanError("image placeholders do not match the images' token counts")
            from .vision import mrope_positions

            rope3, self.rope_delta[lane] = mrope_positions(prompt, images, image_token, self.vision.cfg.spatial_merge_size)
            rope3 = rope3.to(self.device)
            self.lane_has_images[lane] = True
        used = 0
        start = held
        while start < len(prompt):
            # while other lanes decode, chunks shrink to --prefill-chunk-shared (their next token waits for
            # the chunk) and, where they can, their rows ride inside this chunk's forward
            offered = riders.take() if riders is not None else []
            ride = bool(offered) and rope3 is None and not self.rope_delta[lane] \
                and self.can_ride([r for r, _ in offered], lane)
            held_out = len(offered) if ride and RIDE_ALIGN else 0  # prompt rows left to the riders
            full = self.shared_chunk - held_out  # a whole shared piece
            size = min(full, chunk - len(offered)) if offered else chunk
            stop = min(start + size, len(prompt))
            if checkpoint_at is not None and start < checkpoint_at < stop:
                stop = checkpoint_at
            piece = prompt[start:stop]
            self.ctx_len[lane] = start + len(piece)
            toks = device_ints([piece], self.device)
            pos = torch.arange(start, start + len(piece), device=self.device)[None]
            extra = {}
            if rope3 is not None:
                mask = toks.reshape(-1) == image_token
                count = int(mask.sum())
                extra = {"rope_positions": rope3[:, start : start + len(piece)],
                         "image_rows": (mask, embeds[used : used + count]) if count else None}
                used += count
            elif self.rope_delta[lane]:
                extra = {"rope_positions": pos.reshape(-1) + self.rope_delta[lane]}
            if spec is not None:
                logits, aux = self.forward(lane_t, toks, pos, **spec.prefill_outputs(len(piece)), **extra,
                                           host_ctx=(stop,))
                spec.absorb_prefill(lane, prompt, start, stop, aux[0])
            elif (bucket := self._piece_bucket(lane, start, len(piece), rope3, full)):
                if len(piece) <= bucket - held_out:
                    bucket -= held_out  # the riders' rows complete the bucket, as in a whole riding piece
                logits = self._padded_piece(lane, piece, start, bucket, offered if ride else [], riders)
            elif ride:
                all_lanes, rider_toks, rider_pos = self._take_riders(lane, offered, riders)
                # a full shared chunk is a fixed shape: one CUDA graph per rider count (small chunks are
                # launch-bound when eager: ~140 ms for any chunk up to 1,024 tokens on the 27B, run 30)
                inputs = (all_lanes, toks, pos, rider_toks, rider_pos)
                if not self._graph_safe_rows(len(piece) + len(offered)) or len(piece) != full:
                    # MoE prefill paths with host syncs, odd tail pieces: eager
                    both = self._ride_forward(*inputs)
                else:
                    both = self.run_step(("ride", len(piece), len(offered)), self._ride_forward, *inputs)
                logits = both[:1].clone()
                riders.logits = both[1:].clone()
            else:
                logits = self.forward(lane_t, toks, pos, **extra, host_ctx=(stop,))
            self.stats.prefill_tokens += len(piece)
            if stop == checkpoint_at:
                c = self.checkpoint_slot
                self.conv_stack[:, lane, c] = self.conv_stack[:, lane, 0]
                self.rec_stack[:, lane, c] = self.rec_stack[:, lane, 0]
                self.checkpoint_at[lane] = stop
                if spec is not None:
                    spec.save_checkpoint(lane)
            start = stop
            yield logits[0] if stop == len(prompt) else None

    def _piece_bucket(self, lane: int, start: int, n: int, rope3, full: int | None = None) -> int | None:
        """The padded length a prompt piece of n tokens replays at (PIECE_GRAPHS), or None: run it as it is (a
        whole shared piece, `full` tokens, has graphs of its own)."""
        if not self.piece_graphs or rope3 is not None or self.rope_delta[lane] \
                or (self.use_graphs and n >= (self.shared_chunk if full is None else full)):
            return None
        bucket = next((size for size in PIECE_BUCKETS if size >= n), None)
        if bucket is None or start + bucket > self.plan.pages_per_lane * PAGE:  # pad K/V stays in the lane's pages
            return None
        return bucket if self._graph_safe_rows(bucket + self.lanes) else None

    def _graph_safe_rows(self, rows: int) -> bool:
        """Whether a prefill forward of `rows` rows can be captured in a CUDA graph: always for a dense model; for
        a MoE with NINFER_MOE_PREFILL_GRAPHS=on where its experts take the fused prefill path (no host sync)."""
        if not self.cfg.is_moe:
            return True
        if not MOE_PREFILL_GRAPHS or self.moe_prefill not in ("auto", "fused"):
            return False
        pairs = rows * self.cfg.experts_per_token
        return self.moe_prefill == "fused" or pairs < DENSE_EXPERTS_MIN_PAIRS * self.cfg.num_experts

    def _padded_piece(self, lane: int, piece: list[int], start: int, bucket: int, offered, riders) -> torch.Tensor:
        """Prefill `piece` padded to `bucket` rows (with the offered decode rows riding, if any) from one CUDA
        graph per (bucket, riders); returns the piece's last logits [1, V] and sets riders.logits."""
        n = len(piece)
        toks = device_ints([piece + [piece[-1]] * (bucket - n)], self.device)
        pos = torch.arange(start, start + bucket, device=self.device)[None]
        real = device_ints([n], self.device)
        self.ctx_len[lane] = start + bucket  # the block's rows sit at ctx_len - bucket .. ctx_len - 1
        if offered:
            all_lanes, rider_toks, rider_pos = self._take_riders(lane, offered, riders)
            both = self.run_step(("piece", bucket, len(offered)), self._ride_piece_forward, all_lanes, toks, pos,
                                 rider_toks, rider_pos, real)
            logits = both[:1].clone()
            riders.logits = both[1:].clone()
        else:
            logits = self.run_step(("piece", bucket, 0), self._piece_forward, device_ints([lane], self.device),
                                   toks, pos, real).clone()
        self.ctx_len[lane] = start + n
        return logits

    def _take_riders(self, lane: int, offered, riders: Riders) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Count the offered decode rows into this forward of `lane`'s prefill: returns the lanes [1 + R] (the
        prefilling one first), the riders' tokens [R] and positions [R] on the device."""
        rider_lanes, rider_tokens = [r for r, _ in offered], [tok for _, tok in offered]
        positions = self._advance(rider_lanes, rider_tokens)
        riders.advanced = rider_lanes  # counted: if the forward fails, their state is lost too
        self.stats.rider_tokens += len(rider_lanes)
        lengths = [p + 1 for p in positions]
        packed = device_ints([[lane] + rider_lanes, [0] + rider_tokens, [0] + positions, [0] + lengths], self.device)
        self._count_on_device(packed[0, 1:], packed[3, 1:])
        return packed[0], packed[1, 1:], packed[2, 1:]

    def _piece_forward(self, lanes_t, toks, pos, real):
        return self.forward(lanes_t, toks, pos, real_rows=real)

    def _ride_piece_forward(self, all_lanes, toks, pos, rider_toks, rider_pos, real):
        return self.forward(all_lanes[:1], toks, pos, riders=(all_lanes[1:], rider_toks, rider_pos), real_rows=real)

    def can_ride(self, lanes: list[int], prefilling: int) -> bool:
        """Whether these decode lanes' next rows can ride in a plain prefill chunk of lane `prefilling`."""
        return self.speculator is None and prefilling not in lanes and len(set(lanes)) == len(lanes) \
            and all(not self.rope_delta[r] and self.held_tokens(r) + 1 <= self.opts.max_context for r in lanes)

    def _advance(self, lanes: list[int], tokens: list[int] | None) -> list[int]:
        """Count one new token per lane (decode): returns their positions; the caller tells the device
        (_count_on_device). tokens None: they are still on the device (a chained step); record_fed_tokens
        fills them in."""
        if max(self.held_tokens(lane) for lane in lanes) + 1 > self.opts.max_context:
            raise MemoryPlanError(f"a lane reached --max-context {self.opts.max_context}")
        positions = [self.held_tokens(lane) for lane in lanes]
        self.stats.decode_tokens += len(lanes)
        for lane, token in zip(lanes, tokens if tokens is not None else [UNKNOWN_TOKEN] * len(lanes)):
            self.lane_tokens[lane].append(token)
        if self.speculator is not None:  # a plain step leaves the drafter behind: no more drafting here
            for lane in lanes:
                self.speculator.mark_stale(lane)
        return positions

    def _count_on_device(self, lanes_t: torch.Tensor, lengths_t: torch.Tensor) -> None:
        """ctx_len[lanes] = lengths, queued on the stream (no host sync)."""
        self.ctx_len.index_put_((lanes_t,), lengths_t.to(self.ctx_len.dtype))

    def decode_step(self, lanes: list[int], tokens: list[int] | None, device_tokens: torch.Tensor | None = None
                    ) -> torch.Tensor:
        """One token for each listed lane; returns logits [B, V] (a CUDA-graph replay when enabled).
        With `device_tokens` ([B] on the device, tokens None) the step is chained behind the one that picks
        them: nothing waits for the host, which tells the tokens afterwards (record_fed_tokens)."""
        positions = self._advance(lanes, None if device_tokens is not None else tokens)
        self.stats.decode_steps += 1
        self.stats.decode_step_rows += len(lanes)
        shifted = any(self.rope_delta[lane] for lane in lanes)  # after images: shifted rotary positions
        # a chained step's tokens come from the device: the host row is a placeholder, so both kinds of step share
        # one graph per batch size (the graphs' memory is planned per batch size)
        rows = [lanes, positions, [p + 1 for p in positions], tokens if device_tokens is None else [0] * len(lanes)]
        if shifted:
            rows.append([p + self.rope_delta[lane] for p, lane in zip(positions, lanes)])
        # one copy, queued (the step before may still run), straight into the step graph's input; the graph counts
        # the lanes' context lengths itself, so a chained step is this copy, its tokens' copy and the replay
        packed = staged_ints(rows, self.device)
        key = ("decode-shifted" if shifted else "decode", len(lanes), STEP_INPUTS_IN_GRAPH)
        fn = functools.partial(self._decode_forward, rope_row=shifted, count=STEP_INPUTS_IN_GRAPH)
        if not STEP_INPUTS_IN_GRAPH:  # session 46's way: copied and counted before the replay
            packed = to_device(packed, self.device)
            self._count_on_device(packed[0], packed[2])
        toks = packed[3][:, None] if device_tokens is None else device_tokens.long()[:, None]
        return self.run_step(key, fn, packed, toks).clone()

    def _decode_forward(self, packed: torch.Tensor, toks: torch.Tensor, rope_row: bool = False, count: bool = True
                        ) -> torch.Tensor:
        """One decode step of tokens `toks` [B, 1] from decode_step's packed rows [R, B]: lanes, positions, context
        lengths (counted here unless `count` is off), the host's tokens (read through `toks`) and, after images, the
        shifted rotary positions (last row)."""
        lanes_t, pos = packed[0], packed[1][:, None]
        if count:
            self._count_on_device(lanes_t, packed[2])
        if rope_row:
            return self.forward(lanes_t, toks, pos, rope_positions=packed[-1])
        return self.forward(lanes_t, toks, pos)

    def record_fed_tokens(self, lanes: list[int], tokens: list[int]) -> None:
        """The host's copy of the tokens a chained decode step fed these lanes (its last token each)."""
        for lane, token in zip(lanes, tokens):
            held = self.lane_tokens[lane]
            if held and held[-1] == UNKNOWN_TOKEN:
                held[-1] = token

    def _ride_forward(self, all_lanes, toks, pos, rider_toks, rider_pos):
        """A prefill chunk of lane all_lanes[0] with one decode row for each of all_lanes[1:]."""
        return self.forward(all_lanes[:1], toks, pos, riders=(all_lanes[1:], rider_toks, rider_pos))

    def run_step(self, key, fn, lanes_t, *inputs):
        """Run `fn(lanes_t, *inputs)`: eagerly, or as a CUDA graph captured on first use for `key`
        (a step kind and batch size: fixed shapes). Every kernel reads its lanes from the lanes tensor
        on the device, so one graph per batch size serves any set of lanes: their indices are copied
        into the graph's lanes tensor like any other input. Returns fn's outputs (static buffers when
        graphed). `lanes_t` may instead be a decode step's packed rows [R, B] (row 0 the lanes); it and the inputs
        may still be in pinned host memory: a replay copies them straight into the graph's inputs."""
        if not self.use_graphs or key not in self._graphs:
            lanes_t = to_device(lanes_t, self.device)
            inputs = tuple(to_device(x, self.device) for x in inputs)
            if not self.use_graphs or key in self._eager_keys:
                return fn(lanes_t, *inputs)
            prefill_sized = key[0] in ("ride", "piece")
            if prefill_sized and self._ride_pool is None:
                self._ride_pool = torch.cuda.graph_pool_handle()
            # ride and piece graphs (prefill-sized activations) share one memory pool: they replay one at a time
            try:
                self._graphs[key] = self._capture(fn, lanes_t, inputs, self._ride_pool if prefill_sized else None)
            except Exception as exc:  # noqa: BLE001 - a step that cannot be captured still runs, eagerly
                if not prefill_sized:
                    raise
                print(f"ninfer: prefill chunks with decode rows run without a CUDA graph ({type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:160] if str(exc) else ''})", file=sys.stderr)
                self._eager_keys.add(key)
                return fn(lanes_t, *inputs)
            self.stats.graphs_captured_serving += 1  # (warm_up puts the counts back)
            if self._warmed_up:  # a shape the warm-up did not meet: a gap in it, worth a line
                print(f"ninfer: captured a CUDA graph the warm-up had not ({key}): every lane waited for it",
                      file=sys.stderr)
        graph, static_lanes, static_inputs, outputs = self._graphs[key]
        # from pinned host memory these copies are queued: no stream sync
        static_lanes.copy_(lanes_t, non_blocking=True)
        for dst, src in zip(static_inputs, inputs):
            dst.copy_(src, non_blocking=True)
        graph.replay()
        return outputs

    def _capture(self, fn, lanes_t, inputs, pool=None):
        """Capture one step for this lane set. The warm-up run compiles every kernel; the lanes'
        committed GDN state is restored afterwards so the warm-up leaves no trace (its KV writes land
        in slots the real step overwrites)."""
        # every tensor the graph reads must outlive it: a freed input's memory would be reused and the
        # replay would read garbage (seen on the H200 as out-of-bounds lane indices)
        lanes_t = lanes_t.clone()
        lanes_idx = lanes_t if lanes_t.dim() == 1 else lanes_t[0]  # a decode step's packed rows: the lanes first
        saved = [(stack, stack[:, lanes_idx, 0].clone()) for stack in (self.conv_stack, self.rec_stack)]
        static_inputs = [x.clone() for x in inputs]
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                fn(lanes_t, *static_inputs)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs = fn(lanes_t, *static_inputs)
        finally:
            for stack, old in saved:
                stack[:, lanes_idx, 0] = old
        return graph, lanes_t, static_inputs, outputs  # lanes_t too: the graph reads it on every replay

    def generate(self, prompt: list[int], max_new_tokens: int, stop_ids=(), lane: int = 0,
                 params: SamplingParams | None = None, generator: torch.Generator | None = None,
                 images=None) -> list[int]:
        """Greedy by default; with `params`, the device sampler (penalties count this lane's output).
        With --spec, tokens come in speculative rounds; the output is the same as without.
        `images` (runtime.vision.ImageInput, in placeholder order) need --vision."""
        logits = None
        for logits in self.prefill_chunks(lane, prompt, images=images):
            pass
        counts = torch.zeros(1, self.cfg.vocab_size, dtype=torch.int32, device=self.device) if params else None
        nxt = pick_token(logits, params, counts, generator)
        out = [nxt]
        while nxt not in stop_ids and len(out) < max_new_tokens and len(prompt) + len(out) < self.opts.max_context:
            budget = min(max_new_tokens - len(out), self.opts.max_context - len(prompt) - len(out))
            if self.speculator is not None and self.speculator.can_speculate(lane):
                new = self.speculator.round([lane], [nxt], [budget], stop_ids, params, counts, generator)[0]
            else:
                new = [pick_token(self.decode_step([lane], [nxt])[0], params, counts, generator)]
            out += new
            nxt = new[-1]
        return out

    def close(self) -> None:
        self.art.close()


def _no_graphs(o: PlanOptions) -> PlanOptions:
    return replace(o, cuda_graphs=False)
