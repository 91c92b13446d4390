"""One memory plan for the engine's allocator and `ninfer fit` (byte-exact, no GPU needed).

Every resident byte lives in a named region of one of a few arenas; the engine allocates each
arena as a single device buffer of exactly the planned size, so what `fit` predicts is what the
allocator takes. Regions are 256-byte aligned inside their arena.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace

from format.binding import load_config, load_dflash2_config, mtp_layer_count
from format.container import Artifact
from format.layouts import align_up
from format.model_config import DFlash2Config, ModelConfig

from .kv.codecs import get_codec

PAGE_TOKENS = 64
REGION_ALIGN = 256
NATIVE_CONTEXT = 262_144
GRAPH_POOL_BYTES_PER_BATCH = 12 << 20  # CUDA-graph private pool allowance per captured batch size
# Arenas are padded to 2 MiB: torch's caching allocator then hands out exactly the requested size
# (its large-segment rounding is 2 MiB), so planned bytes == torch.cuda.memory_allocated().
ARENA_ALIGN = 2 << 20

# nvidia-smi totals (MiB) of common single cards; --vram overrides.
GPU_VRAM_MIB = {
    "rtx3090": 24576, "rtx4090": 24564, "rtx5090": 32607, "l40s": 46068, "rtx6000ada": 49140,
    "a100-40g": 40960, "a100-80g": 81920, "h100": 81559, "h100-nvl": 95830, "h200": 143771, "b200": 183359,
}
# MoE prefill: (token, expert) pairs sorted by expert, each expert's run padded to whole blocks of this many
# rows (runtime/kernels/moe.py); the workspace counts the padding rows
MOE_BLOCK_ROWS = 32


def moe_dense_chunk_rows(tokens: int, top_k: int) -> int:
    """The most pair rows one expert chunk of the dense-experts prefill multiplies at once (its temporary
    output), unless a single expert has more (at most `tokens`: an expert meets a token once)."""
    return max(tokens, -(-tokens * top_k // 4))


SPECS = ("none", "mtp", "dflash2")


class MemoryPlanError(ValueError):
    """The requested configuration does not fit, or its options are inconsistent."""


def parse_bytes(text: str) -> int:
    """'24G' / '1.3GiB' = binary units, '24GB' = decimal; plain numbers are bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b?)\s*", text.lower())
    if not m:
        raise MemoryPlanError(f"cannot read a byte size from {text!r}; write e.g. 24G, 1.3GiB, 80GB or 1048576")
    number, unit, suffix = float(m.group(1)), m.group(2), m.group(3)
    power = " kmgt".index(unit) if unit else 0
    base = 1000 if suffix == "b" else 1024
    return int(number * base ** power)


MIN_DRAFT_VOCAB = 256

# --prefill-chunk-shared auto: the decoding lanes' rows ride in prefill chunks of this many tokens, or of the shorter
# size where every layer product has a dense copy in memory (the weight cache: the riding forward no longer
# dequantizes, so shorter chunks cost less prefill). H200, 27B, 3 lanes decoding at 8K beside a 32K prefill (bench/
# RESULTS.md section 3): cache on, 512 tokens: their gap 8.7 plain steps, prefill at 0.77 of alone; 1,024: 16.4
# steps at 0.83; cache off, 512: 13.0 steps at 0.51, 1,024: 20.5 at 0.66.
SHARED_CHUNK = 1024
SHARED_CHUNK_WEIGHTS_CACHED = 512


def shared_chunk_for(opts: "PlanOptions", weights_cached: bool) -> int:
    """Tokens per prefill chunk while other lanes decode: the option's (0: the full chunk), or for auto (None)
    SHARED_CHUNK, SHARED_CHUNK_WEIGHTS_CACHED where every layer product is cached; never more than the full chunk."""
    size = opts.shared_prefill_chunk
    if size is None:
        size = SHARED_CHUNK_WEIGHTS_CACHED if weights_cached else SHARED_CHUNK
    return min(size or opts.prefill_chunk, opts.prefill_chunk)


@dataclass(frozen=True)
class PlanOptions:
    max_context: int
    max_concurrency: int = 1
    kv_dtype: str = "bf16"
    prefill_chunk: int = 1024
    # tokens per prefill chunk while other lanes decode (0: the full chunk; None: auto, see shared_chunk_for);
    # their next token waits for it
    shared_prefill_chunk: int | None = None
    spec: str = "none"
    draft_tokens: int = 3
    lm_head_draft: bool = False
    # draft with the output head's first N rows (token ids 0..N-1) instead of all of it: a view, no bytes of its own
    draft_vocab: int = 0
    vision: bool = False
    cuda_graphs: bool = True
    # "auto": dense copies of the layer products in memory the plan leaves spare (faster prefill); "off"
    weight_cache: str = "auto"

    @property
    def shared_chunk(self) -> int:
        """Tokens per prefill chunk while other lanes decode (never more than the full chunk); auto plans for
        the longer of its two sizes (shared_chunk_for)."""
        return shared_chunk_for(self, weights_cached=False)

    def validate(self, cfg: ModelConfig, components: tuple[str, ...]) -> None:
        if self.max_context < 1:
            raise MemoryPlanError("--max-context must be at least 1")
        if self.max_context > NATIVE_CONTEXT:
            raise MemoryPlanError(f"--max-context {self.max_context} exceeds the native context of {NATIVE_CONTEXT}")
        if not 1 <= self.max_concurrency <= 8:
            raise MemoryPlanError("--max-concurrency must be in 1..8")
        if self.prefill_chunk < 128 or self.prefill_chunk % 128:
            raise MemoryPlanError("--prefill-chunk must be a positive multiple of 128")
        if self.shared_prefill_chunk and self.shared_prefill_chunk < 16:
            raise MemoryPlanError("--prefill-chunk-shared must be 0 (the full chunk) or at least 16 tokens")
        if self.spec not in SPECS:
            raise MemoryPlanError(f"--spec must be one of {', '.join(SPECS)}")
        if self.spec != "none" and not 1 <= self.draft_tokens <= 15:
            raise MemoryPlanError("--draft-tokens must be in 1..15")
        if self.spec == "mtp" and "mtp" not in components:
            raise MemoryPlanError("--spec mtp needs an artifact with the mtp component (convert --version 3 --mtp)")
        if self.spec == "dflash2" and "dflash2" not in components:
            raise MemoryPlanError("--spec dflash2 needs an artifact with the dflash2 component (convert --dflash2 DIR)")
        if self.lm_head_draft and self.spec == "none":
            raise MemoryPlanError("--lm-head-draft needs --spec mtp or --spec dflash2")
        if self.lm_head_draft and "lm_head_draft" not in components:
            raise MemoryPlanError("--lm-head-draft needs an artifact with the lm_head_draft component")
        if self.draft_vocab and self.spec == "none":
            raise MemoryPlanError("--draft-vocab needs --spec mtp or --spec dflash2")
        if self.draft_vocab and self.lm_head_draft:
            raise MemoryPlanError("--draft-vocab and --lm-head-draft both choose the drafting head; give one")
        if self.draft_vocab and not MIN_DRAFT_VOCAB <= self.draft_vocab <= cfg.vocab_size:
            raise MemoryPlanError(f"--draft-vocab {self.draft_vocab}: give {MIN_DRAFT_VOCAB}..{cfg.vocab_size} token ids "
                                  "(drafts come from the output head's first N rows), or 0 for the whole head")
        if self.vision and "vision" not in components:
            raise MemoryPlanError("--vision needs an artifact that carries the vision tower")
        if self.weight_cache not in ("auto", "off"):
            raise MemoryPlanError(f"--weight-cache {self.weight_cache!r}: use auto or off")
        get_codec(self.kv_dtype)
        if cfg.head_dim % 64 and self.kv_dtype != "bf16":
            raise MemoryPlanError(f"head_dim {cfg.head_dim} is not a multiple of 64, which every KV codec needs")


@dataclass
class Region:
    name: str
    nbytes: int
    offset: int = 0


@dataclass
class Arena:
    name: str
    regions: list[Region] = field(default_factory=list)

    def add(self, name: str, nbytes: int) -> None:
        self.regions.append(Region(name, int(nbytes)))

    def layout(self) -> int:
        cursor = 0
        for r in self.regions:
            cursor = align_up(cursor, REGION_ALIGN)
            r.offset = cursor
            cursor += r.nbytes
        return cursor

    @property
    def nbytes(self) -> int:
        return self.layout()

    @property
    def allocated_bytes(self) -> int:
        """The arena's buffer size, and what the torch caching allocator reports for it."""
        return align_up(self.nbytes, ARENA_ALIGN) if self.nbytes else 0


# planned but not allocated up front: the activation workspace is a bound on what one phase's torch
# tensors take at run time (an arena of it was allocated and never read: a chunk's worth of memory lost)
HEADROOM_ARENAS = ("workspace",)


@dataclass
class MemoryPlan:
    options: PlanOptions
    pages_per_lane: int
    pages: int
    kv_bytes_per_token: int
    arenas: dict[str, Arena]
    graph_pool_bytes: int

    @property
    def total_bytes(self) -> int:
        return sum(a.allocated_bytes for a in self.arenas.values()) + self.graph_pool_bytes

    @property
    def resident_arenas(self) -> dict[str, Arena]:
        """The arenas allocated up front (DeviceMemory). The others are planned headroom, like the graph
        pools: activations are torch tensors the caching allocator hands out inside it while a chunk runs."""
        return {name: a for name, a in self.arenas.items() if name not in HEADROOM_ARENAS}

    def breakdown(self) -> dict[str, int]:
        out = {name: a.allocated_bytes for name, a in self.arenas.items()}
        out["cuda_graph_pools"] = self.graph_pool_bytes
        return out


def weight_cache_candidates(art: Artifact) -> list[tuple[str, int]]:
    """The layer products the weight cache may keep as dense bf16 copies (Engine._keep_dense_weights), in plan
    order, with their bytes: grouped-format matrices of the text layers, not the MoE experts (their prefill has
    its own path)."""
    from format.numeric import GroupedFormat, get_format

    out = []
    for name, e in art.objects.items():
        if e.kind == "tensor" and name.startswith("text/layers/") and "/experts_" not in name and len(e.shape) == 2 \
                and isinstance(get_format(e.format), GroupedFormat):
            out.append((name, e.shape[0] * e.shape[1] * 2))
    return out


def weight_cache_reserve(card_bytes: int) -> int:
    """Memory the weight cache leaves free beyond the plan: the allocator's fragmentation, kernels' modules and
    the odd temporary (2 GiB or 5 % of the card)."""
    return max(2 << 30, card_bytes // 20)


def weight_cache_picks(sizes: list[int], spare_bytes: int) -> list[bool]:
    """Which of matrices of these byte sizes the weight cache keeps in `spare_bytes`: in order, passing over
    one that no longer fits (a later, smaller one may)."""
    picks, left = [], spare_bytes
    for nbytes in sizes:
        picks.append(nbytes <= left)
        left -= nbytes if picks[-1] else 0
    return picks


def weight_cache_fit(art: Artifact, spare_bytes: int) -> tuple[int, int, int]:
    """(products kept, products in all, bytes kept) by the weight cache in `spare_bytes`, as the engine keeps
    them."""
    sizes = [nbytes for _, nbytes in weight_cache_candidates(art)]
    picks = weight_cache_picks(sizes, spare_bytes)
    return sum(picks), len(sizes), sum(n for n, kept in zip(sizes, picks) if kept)


def _resident_weight_names(art: Artifact, opts: PlanOptions) -> list[str]:
    names = []
    for name, e in art.objects.items():
        if e.kind != "tensor":
            continue
        comp = e.component
        keep = (comp == "text" or (comp == "mtp" and opts.spec == "mtp")
                or (comp == "dflash2" and opts.spec == "dflash2")
                or (comp == "lm_head_draft" and opts.lm_head_draft) or (comp == "vision" and opts.vision))
        if keep:
            names.append(name)
    return names


def dflash2_state_bytes(d: DFlash2Config, lanes: int, draft_tokens: int) -> dict[str, int]:
    """Per lane: each drafter layer's context K and V in a cyclic window (one spare slot takes the writes
    of rejected rows), the target position each slot holds, the verified rows' tapped hidden states that
    wait to be projected, and three counters (runtime/dflash2.py)."""
    slots = d.sliding_window + 1
    plane = d.num_layers * lanes * slots * d.kv_rows * 2
    return {"dflash2_context_keys": plane, "dflash2_context_values": plane,
            "dflash2_context_positions": lanes * slots * 4,
            "dflash2_pending_taps": lanes * (draft_tokens + 1) * d.tap_width * 2,
            "dflash2_counters": 3 * lanes * 4}


def dflash2_workspace_bytes(d: DFlash2Config, cfg: ModelConfig, opts: PlanOptions) -> int:
    """The drafter's temporaries: tapped rows of a prefill chunk (its last window) and their projection,
    one block forward (float32 conv and attention temporaries) and its proposal logits."""
    rows = opts.max_concurrency * (opts.draft_tokens + 1)
    tapped = max(min(opts.prefill_chunk, opts.max_context, d.sliding_window), rows)
    projection = tapped * (d.tap_width * 2 + 3 * d.hidden_size * 4 + 4 * d.kv_rows * 4)
    block = rows * (3 * d.intermediate_size + 8 * d.hidden_size + 2 * d.num_heads * d.head_dim) * 4
    scores = 2 * rows * d.num_heads * (d.sliding_window + opts.draft_tokens + 1) * 4 \
        + 2 * opts.max_concurrency * d.num_layers * (d.sliding_window + 1) * d.kv_rows * 4
    logits = rows * cfg.vocab_size * 4 + rows * d.selector_top_k * (d.selector_rank * 4 + 16)
    return projection + block + scores + logits


# kernels/prefill_attention_vendor.py's SEGMENT_KEYS, MIN_ROWS and SHAPE_STEP (a test keeps them equal)
ATTENTION_SEGMENT_KEYS = 32_768
ATTENTION_SEGMENT_MIN_ROWS = 256
ATTENTION_SHAPE_STEP = 256
RIDE_DEQUANT_SCRATCH = 64 << 20  # the prefill GEMM's dense scratch (kernels/qlinear.py GEMM_DEQUANT_BYTES)


# the lengths a prompt piece shorter than the shared chunk is padded to, each replayed from a CUDA graph of its own
# (engine.PIECE_GRAPHS)
PIECE_BUCKETS = (32, 64, 128, 256, 512)


def ride_pool_bytes(cfg: ModelConfig, opts: PlanOptions) -> int:
    """The one memory pool the prompt-piece and prefill-with-riders CUDA graphs share (Engine.run_step): the
    activations of a shared chunk plus one decode row per other lane, the dequantization scratch inside the graph,
    and the logits each graph keeps (its output buffer): at most two graphs a bucket and one whole shared chunk for
    each count r of riding lanes, 1 + r rows each (serve's warm-up captures them all)."""
    lanes = opts.max_concurrency
    rows = min(opts.shared_chunk, opts.max_context) + lanes - 1
    graphs_rows = sum((2 * len(PIECE_BUCKETS) + (r > 0)) * (1 + r) for r in range(lanes))
    return (sum(_phase_bytes(cfg, rows, lanes).values()) + RIDE_DEQUANT_SCRATCH
            + graphs_rows * cfg.vocab_size * 4)


def _phase_bytes(cfg: ModelConfig, tokens: int, logits_rows: int) -> dict[str, int]:
    """Activation bytes of one forward over `tokens` rows (and `logits_rows` rows of logits)."""
    h = cfg.hidden_size
    proj = max(cfg.q_gate_rows + 2 * cfg.kv_rows, cfg.gdn_conv_dim + cfg.gdn_value_dim)
    if cfg.is_moe:
        mlp = max(2 * cfg.shared_expert_intermediate_size, 2 * cfg.moe_intermediate_size * cfg.experts_per_token)
    else:
        mlp = 2 * cfg.intermediate_size
    inner = max(cfg.num_heads * cfg.head_dim, cfg.gdn_value_dim, mlp // 2)
    hv, dk = cfg.linear_num_value_heads, cfg.linear_key_head_dim
    return {
        "hidden": tokens * h * 2, "residual": tokens * h * 2, "normed": tokens * h * 2,
        "projection": tokens * max(proj, mlp) * 2, "inner": tokens * inner * 2,
        "gdn_fp32": tokens * hv * dk * 4 * 3,  # q, k (l2-normalized), gates in float32
        "logits": logits_rows * cfg.vocab_size * 4,
    }


def _workspace(cfg: ModelConfig, opts: PlanOptions) -> Arena:
    """Activation buffers shared by all phases; the size of the largest phase."""
    t = min(opts.prefill_chunk, opts.max_context)
    rows = 1 + (opts.draft_tokens if opts.spec != "none" else 0)
    lanes = opts.max_concurrency
    h = cfg.hidden_size
    hv, dk = cfg.linear_num_value_heads, cfg.linear_key_head_dim
    proj = max(cfg.q_gate_rows + 2 * cfg.kv_rows, cfg.gdn_conv_dim + cfg.gdn_value_dim)
    prefill = _phase_bytes(cfg, t, lanes)
    decode = _phase_bytes(cfg, lanes * rows, lanes * rows)
    arena = Arena("workspace")
    for key in prefill:
        arena.add(key, max(prefill[key], decode[key]))
    arena.add("sampling", lanes * rows * cfg.vocab_size * 4 + lanes * rows * 8)
    # attention split partials: at most ~1024 programs x (rows x D + 2) floats, prefill or decode
    group = cfg.num_heads // cfg.num_kv_heads
    splits_rows = max(lanes * rows * group * 1024, t * group * max(1, -(-opts.max_context // 256)))
    arena.add("attention_partials", min(splits_rows, 1024 * 64) * (cfg.head_dim + 2) * 4)
    if t >= 64:  # flash-linear-attention's chunked GDN temporaries (when installed; counted regardless)
        dv, blocks = cfg.linear_value_head_dim, -(-t // 64)
        arena.add("gdn_chunked", blocks * hv * dk * dv * 2  # per-block states (bf16)
                  + 4 * t * hv * max(dk, dv) * 2  # w, u, new v, output
                  + t * hv * 64 * 4 + t * hv * 4 * 2  # block-local matrices, cumulative gates
                  + 2 * t * cfg.linear_num_key_heads * dk * 2  # contiguous q, k
                  + 2 * lanes * hv * dk * dv * 4)  # initial and final states
    if cfg.is_moe and t > 16:  # prefill experts (either path): the phase terms hold T x k pair rows of gate_up
        # and SwiGLU output; fused: add the padding rows, the down output of every pair row, the sort's indices
        pairs = t * cfg.experts_per_token
        slots = -(-(pairs + cfg.num_experts * (MOE_BLOCK_ROWS - 1)) // MOE_BLOCK_ROWS) * MOE_BLOCK_ROWS
        fused = (slots - pairs) * 3 * cfg.moe_intermediate_size * 2 + slots * h * 2 + pairs * 8 * 6 + slots * 4 * 3
        # dense experts: gathered rows (later the down outputs), one chunk's output, sort indices, row bounds
        dense = (pairs + moe_dense_chunk_rows(t, cfg.experts_per_token)) * h * 2 + pairs * 8 * 5 \
            + cfg.num_experts * 8 * 2
        arena.add("moe_pairs", max(fused, dense))
    if t >= ATTENTION_SEGMENT_MIN_ROWS:  # a prefill chunk's attention through cuDNN, a key segment at a time:
        # the gathered segment (bf16 or decoded fp16 K and V, with room for a third copy: the causal block's
        # padded keys), the float32 running output, a segment's output and log-sum-exps, the queries padded to whole
        # shape steps (two copies: the prefix's and the causal block's). Attention layers run while the GDN layers'
        # temporaries are free: only what exceeds those is added
        rows = t + 2 * ATTENTION_SHAPE_STEP
        segments = 3 * ATTENTION_SEGMENT_KEYS * cfg.num_kv_heads * cfg.head_dim * 2 \
            + rows * cfg.num_heads * (cfg.head_dim * (4 + 2 + 2 * 2) + 3 * 4)
        gdn_only = sum(r.nbytes for r in arena.regions if r.name in ("gdn_fp32", "gdn_chunked"))
        arena.add("attention_segments", max(0, segments - gdn_only))
    if t > 16:  # prefill GEMMs dequantize weight row chunks to bf16
        widest = max(cfg.vocab_size, 2 * max(cfg.intermediate_size, cfg.shared_expert_intermediate_size), proj)
        if cfg.is_moe:  # the dense-experts prefill dequantizes runs of whole experts' gate_up (or down) rows
            widest = max(widest, cfg.num_experts * 2 * cfg.moe_intermediate_size)
        arena.add("gemm_dequant", min(64 << 20, widest * h * 2))
    return arena


def build_plan(art: Artifact, opts: PlanOptions) -> MemoryPlan:
    cfg = load_config(art)
    opts.validate(cfg, art.components)
    codec = get_codec(opts.kv_dtype)
    full_layers = sum(cfg.is_full_attention(i) for i in range(cfg.num_layers))
    gdn_layers = cfg.num_layers - full_layers
    per_layer_token = codec.bytes_per_token_head(cfg.head_dim) * cfg.num_kv_heads

    weights = Arena("weights")
    for name in _resident_weight_names(art, opts):
        weights.add(name, art.objects[name].nbytes)

    pages_per_lane = math.ceil(opts.max_context / PAGE_TOKENS)
    pages = pages_per_lane * opts.max_concurrency
    kv = Arena("kv_pool")
    for i in range(cfg.num_layers):
        if cfg.is_full_attention(i):
            for plane in codec.planes(cfg.head_dim):
                kv.add(f"layer{i}/{plane.name}", pages * PAGE_TOKENS * cfg.num_kv_heads * plane.width * plane.item_bytes)
    mtp_layers = 0
    if opts.spec == "mtp":
        mtp_layers = mtp_layer_count(art.objects)
        extra = opts.max_concurrency * math.ceil(opts.draft_tokens / PAGE_TOKENS)  # drafted tail pages
        for j in range(mtp_layers):
            for plane in codec.planes(cfg.head_dim):
                kv.add(f"mtp{j}/{plane.name}",
                       (pages + extra) * PAGE_TOKENS * cfg.num_kv_heads * plane.width * plane.item_bytes)
        kv.add("mtp_block_tables", (pages + extra) * 4)
    kv.add("block_tables", opts.max_concurrency * pages_per_lane * 4)

    state = Arena("sequence_state")
    # slot 0 committed, slots 1..K+1 verify snapshots (speculation), last slot: the turn checkpoint that
    # lets a returning conversation resume from the end of its previous prompt's history
    slots = (1 if opts.spec == "none" else opts.draft_tokens + 2) + 1
    lanes = opts.max_concurrency
    state.add("gdn_conv", gdn_layers * lanes * slots * (cfg.conv_kernel - 1) * cfg.gdn_conv_dim * 2)
    state.add("gdn_recurrent", gdn_layers * lanes * slots * cfg.linear_num_value_heads
              * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4)
    state.add("lane_tokens", lanes * (opts.max_context + opts.draft_tokens + 1) * 4)
    state.add("lane_context_lengths", lanes * 4)
    drafter = None
    if opts.spec == "dflash2":
        drafter = load_dflash2_config(art)
        if opts.draft_tokens + 1 > drafter.sliding_window:
            raise MemoryPlanError(f"--draft-tokens {opts.draft_tokens} does not fit the DFlash2 drafter's "
                                  f"sliding window of {drafter.sliding_window}")
        for name, nbytes in dflash2_state_bytes(drafter, lanes, opts.draft_tokens).items():
            state.add(name, nbytes)
    if opts.spec == "mtp":
        state.add("mtp_hidden_tail", lanes * (opts.draft_tokens + 2) * cfg.hidden_size * 2)  # + checkpoint row
        state.add("mtp_context_lengths", lanes * 4)

    workspace = _workspace(cfg, opts)
    if drafter is not None:
        workspace.add("dflash2", dflash2_workspace_bytes(drafter, cfg, opts))
    if opts.vision:
        workspace.add("vision", 16_384 * 1152 * 2 * 6)  # one 16K-patch image item through the tower
    arenas = {"weights": weights, "kv_pool": kv, "sequence_state": state, "workspace": workspace}
    # a graph pool per batch size of each step kind: decode, with --spec a round's draft and verify, with --vision
    # decode steps at shifted rotary positions
    batches = lanes * (1 + 2 * (opts.spec != "none") + opts.vision)
    graphs = GRAPH_POOL_BYTES_PER_BATCH * batches if opts.cuda_graphs else 0
    if opts.cuda_graphs and opts.spec == "none":  # prompt pieces replay from graphs with one lane too
        graphs += ride_pool_bytes(cfg, opts)
    kv_token = per_layer_token * (full_layers + mtp_layers)
    return MemoryPlan(opts, pages_per_lane, pages, kv_token, arenas, graphs)


@dataclass
class FitResult:
    budget_bytes: int
    max_context: int  # 0 when nothing fits
    plan: MemoryPlan | None
    fixed_bytes: int
    bytes_per_page_group: int  # growth per 64 tokens of context (all lanes)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def fit(art: Artifact, opts: PlanOptions, vram_bytes: int, reserve_bytes: int) -> FitResult:
    """Largest max_context (a multiple of 64, at most the native context) whose plan fits."""
    budget = vram_bytes - reserve_bytes
    if budget <= 0:
        raise MemoryPlanError(f"--vram-reserve {_gib(reserve_bytes)} leaves nothing of a {_gib(vram_bytes)} card; "
                              "give the card's memory with --vram (e.g. 24G) or a smaller --vram-reserve")

    def total(ctx: int) -> int:
        return build_plan(art, _with(opts, ctx)).total_bytes

    small = total(PAGE_TOKENS)
    far = max(opts.prefill_chunk, PAGE_TOKENS)  # past the chunk, growth is pure KV + token ids
    step = total(far + PAGE_TOKENS) - total(far)
    if small > budget:
        return FitResult(budget, 0, None, small, step)
    lo, hi = 1, NATIVE_CONTEXT // PAGE_TOKENS
    if total(hi * PAGE_TOKENS) <= budget:
        lo = hi
    while lo < hi:  # the largest page count that fits; total() is monotone in pages
        mid = (lo + hi + 1) // 2
        if total(mid * PAGE_TOKENS) <= budget:
            lo = mid
        else:
            hi = mid - 1
    best = lo * PAGE_TOKENS
    return FitResult(budget, best, build_plan(art, _with(opts, best)), small, step)


AUTO_PREFILL_CHUNK = 0  # PlanOptions.prefill_chunk for `--prefill-chunk auto`, resolved by resolve_prefill_chunk
PREFILL_CHUNK_CHOICES = (8192, 4096, 2048, 1024)
AUTO_CHUNK_SHARE = 32  # the auto chunk's activation workspace stays within 1/32 of the card


def parse_prefill_chunk(text: str | int) -> int:
    """`auto` -> AUTO_PREFILL_CHUNK, else a positive multiple of 128 tokens."""
    if str(text).strip().lower() == "auto":
        return AUTO_PREFILL_CHUNK
    try:
        chunk = int(text)
    except ValueError:
        chunk = -1
    if chunk < 128 or chunk % 128:
        raise MemoryPlanError(f"--prefill-chunk {text!r} is not valid; give a multiple of 128 tokens (e.g. 2048) or auto")
    return chunk


def resolve_prefill_chunk(art: Artifact, opts: PlanOptions, card_bytes: int | None) -> PlanOptions:
    """An explicit chunk passes through. `auto`: the largest of PREFILL_CHUNK_CHOICES whose activation workspace
    (at the native context, so the choice does not depend on --max-context) is at most 1/AUTO_CHUNK_SHARE of
    the card's memory: big chunks prefill much faster (run 24, 27B at 8K: 12,705 tok/s with 8,192-token
    chunks, 8,505 with 2,048), but on a 24 GB card their workspace would cost a third of the bf16 context.
    Decided from the card's size, not its free bytes, so `ninfer fit --gpu X` and the server on X agree.
    Without a card (CPU) the chunk is 1,024."""
    if opts.prefill_chunk != AUTO_PREFILL_CHUNK:
        return opts
    if card_bytes is None:
        return replace(opts, prefill_chunk=PREFILL_CHUNK_CHOICES[-1])
    cfg = load_config(art)
    for chunk in PREFILL_CHUNK_CHOICES:
        probe = replace(opts, prefill_chunk=chunk, max_context=NATIVE_CONTEXT)
        if _workspace(cfg, probe).allocated_bytes * AUTO_CHUNK_SHARE <= card_bytes:
            return replace(opts, prefill_chunk=chunk)
    return replace(opts, prefill_chunk=PREFILL_CHUNK_CHOICES[-1])


def _with(opts: PlanOptions, ctx: int) -> PlanOptions:
    return replace(opts, max_context=ctx)


def require_fit(art: Artifact, opts: PlanOptions, available_bytes: int) -> MemoryPlan:
    """Fail fast with exact numbers when the requested context does not fit."""
    plan = build_plan(art, opts)
    if plan.total_bytes > available_bytes:
        best = fit(art, opts, available_bytes, 0).max_context
        raise MemoryPlanError(
            f"--max-context {opts.max_context} needs {plan.total_bytes} bytes but only {available_bytes} are available "
            f"({plan.total_bytes - available_bytes} short); the largest context that fits is {best}"
            + (" (none: lower --max-concurrency or use a smaller --kv-dtype)" if best == 0 else ""))
    return plan
