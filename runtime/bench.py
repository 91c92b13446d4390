"""`ninfer bench`: cold prefill at each depth, then decode at that depth; tok/s next to the
bandwidth roofline (bytes one decode token must read, over the copy bandwidth measured in the
same run). Depths beyond --prefill-limit get a synthetic context (KV of the right length, zeroed)
so decode at 200K can be timed without a minutes-long prefill; the result says so.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import torch

from .memory_plan import PlanOptions
from .speculate import SpecStats


@dataclass
class BenchOptions:
    depths: list[int]
    kv_dtypes: list[str]
    decode_tokens: int = 64
    spec: str = "none"
    draft_tokens: int = 3
    accepted_drafts: int | None = None  # force this many accepted drafts per round (random weights)
    lm_head_draft: bool = False
    prefill_chunk: int = 0  # 0 = auto (runtime.memory_plan.resolve_prefill_chunk)
    prefill_limit: int = 262_144
    random_weights_seed: int | None = None
    extra: dict = field(default_factory=dict)


def copy_bandwidth(device, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device copy_ of nbytes: (bytes read + written) / second."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    torch.cuda.synchronize(device)
    bw = 2 * nbytes * reps / (time.perf_counter() - t0)
    del a, b
    torch.cuda.empty_cache()
    return bw


def decode_bytes(engine, depth: int) -> int:
    """Bytes one plain decode token reads: resident text weights (one embedding row; for MoE only
    the routed share of the experts), the KV of every full-attention layer at `depth`, GDN state
    read and written."""
    c, art = engine.cfg, engine.art
    total = 0
    for r in engine.plan.arenas["weights"].regions:
        e = art.objects[r.name]
        if e.component != "text":
            continue
        if r.name == "text/token_embedding":
            total += r.nbytes // e.shape[0]
        elif "/moe/experts_" in r.name:
            total += r.nbytes * c.experts_per_token // c.num_experts
        else:
            total += r.nbytes
    full = sum(c.is_full_attention(i) for i in range(c.num_layers))
    kv_token = engine.codec.bytes_per_token_head(c.head_dim) * c.num_kv_heads * full
    gdn = c.num_layers - full
    state = gdn * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4 * 2
    return total + kv_token * depth + state


def _sync(engine):
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _synthetic_context(engine, depth: int, gen: torch.Generator) -> None:
    """Lane 0 holds `depth` tokens of zeroed KV and state: decode then reads exactly what it would
    after a real prefill of that length."""
    engine.reset_lane(0)
    engine.ctx_len[0] = depth
    engine.lane_tokens[0] = torch.randint(0, engine.cfg.vocab_size, (depth,), generator=gen).tolist()
    if engine.speculator is not None:
        engine.speculator.assume_context(0, depth)


def _decode(engine, first_token: int, n: int) -> tuple[int, float]:
    """Generate n tokens after the prefill (greedy); returns (tokens, seconds)."""
    nxt, produced = first_token, 0
    _sync(engine)
    t0 = time.perf_counter()
    while produced < n:
        if engine.speculator is not None and engine.speculator.can_speculate(0):
            new = engine.speculator.round([0], [nxt], [n - produced])[0]
        else:
            new = [int(torch.argmax(engine.decode_step([0], [nxt])[0]))]
        produced += len(new)
        nxt = new[-1]
    _sync(engine)
    return produced, time.perf_counter() - t0


def run_bench(path, opts: BenchOptions, device: str = "cuda", log=print) -> dict:
    from .engine import Engine

    gen = torch.Generator().manual_seed(0)
    results = {"artifact": str(path), "options": {k: v for k, v in opts.__dict__.items() if k != "extra"},
               "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu", "rows": []}
    bw = copy_bandwidth(device) if device.startswith("cuda") else 0.0
    results["copy_bandwidth_bytes_per_s"] = bw
    margin = opts.decode_tokens + opts.draft_tokens + 2
    max_context = -(-(max(opts.depths) + margin) // 64) * 64
    for kv in opts.kv_dtypes:
        plan_opts = PlanOptions(max_context=max_context, kv_dtype=kv, prefill_chunk=opts.prefill_chunk,
                                spec=opts.spec, draft_tokens=opts.draft_tokens, lm_head_draft=opts.lm_head_draft)
        resident_before = 0
        if device.startswith("cuda"):
            gc.collect()  # the previous engine (its MTP drafter refers back to it) and its graphs' pools
            torch.cuda.empty_cache()
            resident_before = torch.cuda.memory_allocated(device)  # not this engine's: left out of its peak
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        engine = Engine(path, plan_opts, device=device, random_weights_seed=opts.random_weights_seed)
        load_s = time.perf_counter() - t0
        if engine.speculator is not None and opts.accepted_drafts is not None:
            engine.speculator.forced_accept = opts.accepted_drafts
        engine.mem.buffers["kv_pool"].zero_()
        log(f"[{kv}] engine ready in {load_s:.1f} s; plan {engine.plan.total_bytes / 2**30:.2f} GiB; "
            f"prefill chunk {engine.opts.prefill_chunk}")
        # compile the prefill kernels (a full chunk and a short tail) outside the timing
        warm = torch.randint(0, engine.cfg.vocab_size, (min(engine.opts.prefill_chunk + 7, max_context - 1),),
                             generator=gen).tolist()
        engine.prefill(0, warm)
        warmed = False
        for depth in sorted(opts.depths):
            row = {"kv_dtype": kv, "depth": depth, "spec": opts.spec, "draft_tokens": opts.draft_tokens
                   if opts.spec != "none" else 0, "prefill_chunk": engine.opts.prefill_chunk}
            if depth <= opts.prefill_limit:
                prompt = torch.randint(0, engine.cfg.vocab_size, (depth,), generator=gen).tolist()
                _sync(engine)
                t0 = time.perf_counter()
                logits = engine.prefill(0, prompt)
                _sync(engine)
                secs = time.perf_counter() - t0
                row.update(prefill_s=secs, prefill_tok_s=depth / secs, context="prefilled")
                first = int(torch.argmax(logits))
            else:
                _synthetic_context(engine, depth, gen)
                row.update(prefill_s=None, prefill_tok_s=None, context="synthetic")
                first = 1
            if not warmed:  # capture the decode graphs (and compile kernels) outside the timing
                _decode(engine, first, 2 * (opts.draft_tokens + 1))
                warmed = True
                if row["context"] == "prefilled":
                    logits = engine.prefill(0, prompt)
                else:
                    _synthetic_context(engine, depth, gen)
            if engine.speculator is not None:
                engine.speculator.stats = SpecStats(accepted_at=[0] * engine.speculator.k)
            n, secs = _decode(engine, first, opts.decode_tokens)
            row.update(decode_tokens=n, decode_s=secs, decode_tok_s=n / secs)
            if engine.speculator is not None:
                row["spec_stats"] = engine.speculator.stats.as_dict()
            need = decode_bytes(engine, depth)
            row["decode_bytes_per_token"] = need
            if bw:
                row["roofline_tok_s"] = bw / need
                row["of_roofline"] = row["decode_tok_s"] / row["roofline_tok_s"]
            if device.startswith("cuda"):
                row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device) - resident_before
                row["resident_before_bytes"] = resident_before
            row["planned_bytes"] = engine.plan.total_bytes
            results["rows"].append(row)
            log(f"[{kv}] depth {depth}: " + (f"prefill {row['prefill_tok_s']:.0f} tok/s, " if row["prefill_tok_s"] else
                                           "synthetic context, ") + f"decode {row['decode_tok_s']:.1f} tok/s")
        engine.close()
        del engine
    return results


def plot(results: dict, out_png) -> bool:
    """tok/s vs depth per KV dtype (decode solid, roofline dashed). False when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    kvs = sorted({r["kv_dtype"] for r in results["rows"]})
    for kv in kvs:
        rows = sorted((r for r in results["rows"] if r["kv_dtype"] == kv), key=lambda r: r["depth"])
        xs = [r["depth"] for r in rows]
        line, = ax.plot(xs, [r["decode_tok_s"] for r in rows], marker="o", label=f"decode {kv}")
        if all("roofline_tok_s" in r for r in rows):
            ax.plot(xs, [r["roofline_tok_s"] for r in rows], linestyle="--", color=line.get_color(),
                    label=f"roofline {kv}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context depth (tokens)")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"{results['artifact'].rsplit('/', 1)[-1]} on {results['device']}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return True
