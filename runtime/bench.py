"""`ninfer bench`: cold prefill at each depth, then decode at that depth; tok/s next to the
bandwidth roofline (bytes one decode token must read, over the copy bandwidth measured in the
same run). Depths beyond --prefill-limit get a synthetic context (KV of the right length, zeroed)
so decode at 200K can be timed without a minutes-long prefill; the result says so.
"""

from __future__ import annotations

import gc
import itertools
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
    draft_vocab: int = 0
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
    total = _routed_bytes(engine)
    for r in engine.plan.arenas["weights"].regions:
        e = art.objects[r.name]
        if e.component != "text" or _is_routed_expert(r.name):
            continue
        total += r.nbytes // e.shape[0] if r.name == "text/token_embedding" else r.nbytes
    full = sum(c.is_full_attention(i) for i in range(c.num_layers))
    kv_token = engine.codec.bytes_per_token_head(c.head_dim) * c.num_kv_heads * full
    return total + kv_token * depth + gdn_state_bytes(engine)


def _is_routed_expert(name: str) -> bool:
    return "/moe/experts_" in name


def gdn_state_bytes(engine) -> int:
    """One lane's GDN recurrent state (float32), read and written by every decode token."""
    c = engine.cfg
    gdn = c.num_layers - sum(c.is_full_attention(i) for i in range(c.num_layers))
    return gdn * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4 * 2


def _sync(engine):
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def _synthetic_context(engine, depth: int, gen: torch.Generator, lane: int = 0) -> None:
    """`lane` holds `depth` tokens of zeroed KV and state: decode then reads exactly what it would
    after a real prefill of that length."""
    engine.reset_lane(lane)
    engine.ctx_len[lane] = depth
    engine.lane_tokens[lane] = torch.randint(0, engine.cfg.vocab_size, (depth,), generator=gen).tolist()
    if engine.speculator is not None:
        engine.speculator.assume_context(lane, depth)


def _decode(engine, first_token: int, n: int, chained: bool = False) -> tuple[int, float]:
    """Generate n tokens after the prefill (greedy); returns (tokens, seconds). `chained` (plain decode on a GPU):
    as the server runs it (runtime/serve/scheduler.py), each step's token is picked on the device and feeds the next
    step at once, and the host reads it back a step behind while the GPU runs the next; else the host reads each
    token before it launches the next step. Either way the same tokens."""
    nxt, produced = first_token, 0
    _sync(engine)
    t0 = time.perf_counter()
    if chained and engine.speculator is None:
        from .transfers import HostCopy

        picked = engine.decode_step([0], [nxt]).argmax(-1)
        copy, produced = HostCopy.start(picked), 1
        while produced < n:
            picked = engine.decode_step([0], None, device_tokens=picked).argmax(-1)
            ahead = HostCopy.start(picked)
            engine.record_fed_tokens([0], copy.tolist())  # the step before: the GPU runs this one meanwhile
            copy, produced = ahead, produced + 1
        engine.record_fed_tokens([0], copy.tolist())
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
    margin = 2 * opts.decode_tokens + opts.draft_tokens + 2  # decode timed chained, then host-synced
    max_context = -(-(max(opts.depths) + margin) // 64) * 64
    for kv in opts.kv_dtypes:
        plan_opts = PlanOptions(max_context=max_context, kv_dtype=kv, prefill_chunk=opts.prefill_chunk,
                                spec=opts.spec, draft_tokens=opts.draft_tokens, lm_head_draft=opts.lm_head_draft,
                                draft_vocab=opts.draft_vocab)
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
            f"prefill chunk {engine.opts.prefill_chunk}; {engine.fragment_order_products} products in fragment order")
        results["fragment_order_products"] = engine.fragment_order_products  # which product layout ran
        results["kernel_switches"] = kernel_switches()
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
            n, secs = _decode(engine, first, opts.decode_tokens, chained=True)
            row.update(decode_tokens=n, decode_s=secs, decode_tok_s=n / secs)
            if engine.speculator is None:  # side by side: the host waiting on every token
                n_synced, secs_synced = _decode(engine, first, opts.decode_tokens)
                row["decode_tok_s_host_synced"] = n_synced / secs_synced
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
            row["weight_cache_bytes"] = engine.weight_cache_bytes  # part of the peak: dense copies in spare memory
            results["rows"].append(row)
            log(f"[{kv}] depth {depth}: " + (f"prefill {row['prefill_tok_s']:.0f} tok/s, " if row["prefill_tok_s"] else
                                           "synthetic context, ") + f"decode {row['decode_tok_s']:.1f} tok/s" + (
                f" ({row['decode_tok_s_host_synced']:.1f} with the host reading each token before the next step)"
                if "decode_tok_s_host_synced" in row else ""))
        engine.close()
        del engine
    return results


def _weight_and_lane_bytes(engine, depth: int) -> tuple[int, int]:
    """(bytes every decode step reads once whatever the lanes, bytes each lane adds: its KV at `depth`
    and its GDN state). For MoE the routed share of the experts counts once, with the shared bytes."""
    one = decode_bytes(engine, depth)
    per_lane = one - decode_bytes(engine, 0) + gdn_state_bytes(engine)
    return one - per_lane, per_lane


def _routed_bytes(engine) -> int:
    """The routed experts' bytes one token reads (its k of E experts in every MoE layer; 0 for a dense model)."""
    c = engine.cfg
    return sum(r.nbytes * c.experts_per_token // c.num_experts for r in engine.plan.arenas["weights"].regions
               if _is_routed_expert(r.name) and engine.art.objects[r.name].component == "text")


def _step_bytes(engine, shared: int, per_lane: int, n: int, distinct: bool) -> float:
    """Bytes a decode step of n lanes reads at least: the weights once (with lanes of distinct tokens, a MoE's
    routed experts as many as n independent top-k picks are expected to cover: E (1 - (1 - k/E)^n) of them a
    layer; with the same token every lane picks the same k), plus each lane's KV and state."""
    routed = _routed_bytes(engine)
    if distinct and routed:
        c = engine.cfg
        covered = c.num_experts * (1 - (1 - c.experts_per_token / c.num_experts) ** n) / c.experts_per_token
        shared += routed * (covered - 1)
    return shared + n * per_lane


def lane_tokens(n: int, distinct: bool, vocab: int) -> list[int]:
    """The token each of n lanes feeds every bench step: the same one, or distinct ones (so a MoE routes the
    lanes apart, as independent requests would be)."""
    return [1 + 7919 * i % (vocab - 1) for i in range(n)] if distinct else [1] * n


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def _spec_rounds(engine, ids: list[int], depth: int, rounds: int, gen, distinct: bool = False
                 ) -> tuple[float, int, float, float]:
    """Batched speculative rounds for lanes `ids` from `depth` tokens of synthetic context: two untimed (graph
    capture), then `rounds` timed; returns (seconds, tokens the lanes gained in the timed rounds, and a round's
    drafting and verify-forward ms by CUDA events)."""
    from .speculate import phase_ms

    spec = engine.speculator
    for lane in ids:
        _synthetic_context(engine, depth, gen, lane)
    nxt, budget = lane_tokens(len(ids), distinct, engine.cfg.vocab_size), [1 << 30] * len(ids)
    for _ in range(2):
        nxt = [new[-1] for new in spec.round(ids, nxt, budget)]
    spec.stats = SpecStats(accepted_at=[0] * spec.k)
    spec.phase_events = []
    _sync(engine)
    t0, gained = time.perf_counter(), 0
    for _ in range(rounds):
        emitted = spec.round(ids, nxt, budget)
        gained += sum(map(len, emitted))
        nxt = [new[-1] for new in emitted]
    _sync(engine)
    secs = time.perf_counter() - t0
    draft_ms, verify_ms = phase_ms(spec.phase_events)
    spec.phase_events = None
    return secs, gained, draft_ms, verify_ms


def run_lanes_bench(path, lanes: list[int], depth: int, kv_dtypes: list[str], steps: int = 32,
                    prefill_tokens: int = 0, prefill_chunk: int = 0, device: str = "cuda",
                    random_weights_seed: int | None = None, spec: str = "none", draft_tokens: int = 3,
                    accepted_drafts: int | None = None, lm_head_draft: bool = False, draft_vocab: int = 0,
                    distinct_tokens: bool = False, log=print) -> dict:
    """Decode with several lanes at once: each lane holds `depth` tokens (synthetic context), and one
    step decodes one token for every lane. Per lane count: step time, aggregate and per-lane tok/s,
    the step time over the one-lane step, and the ideal (one read of the weights serves every lane;
    each lane adds its own KV and state). With `prefill_tokens`, the concurrent-prefill mode: lane 0
    prefills that many tokens chunk by chunk while the other lanes decode, as the server interleaves
    them; the decoding lanes' inter-token gaps (p50/p99) and the prefill's tok/s against it alone.
    With `spec` (mtp / dflash2), each lane count also runs `steps` batched speculative rounds (every lane
    drafts, one verify forward for all; `accepted_drafts` forces acceptance on random weights): round time,
    tokens per lane per second and their ratio to the plain step's at the same lane count (issue 20: batched
    rounds keep one lane's ratio). `distinct_tokens`: every lane feeds its own token (a MoE then routes the lanes
    apart, as independent requests; the ideal counts the experts they are expected to cover), else all feed the
    same one (a MoE's lanes share their experts: the best case)."""
    from .engine import Engine

    gen = torch.Generator().manual_seed(0)
    top = max(lanes)
    results = {"artifact": str(path), "mode": "lanes", "lanes": lanes, "depth": depth, "steps": steps,
               "spec": spec, "draft_tokens": draft_tokens if spec != "none" else 0, "accepted_drafts": accepted_drafts,
               "lm_head_draft": lm_head_draft, "draft_vocab": draft_vocab,
               "lane_tokens": "distinct" if distinct_tokens else "same",
               "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu", "rows": []}
    bw = copy_bandwidth(device) if device.startswith("cuda") else 0.0
    results["copy_bandwidth_bytes_per_s"] = bw
    spec_room = (steps + 2) * (draft_tokens + 1) if spec != "none" else 0  # the rounds' tokens past the depth
    max_context = -(-(max(depth, prefill_tokens) + steps + spec_room + 64) // 64) * 64
    for kv in kv_dtypes:
        engine = Engine(path, PlanOptions(max_context=max_context, kv_dtype=kv, max_concurrency=top,
                                          prefill_chunk=prefill_chunk, spec=spec, draft_tokens=draft_tokens,
                                          lm_head_draft=lm_head_draft, draft_vocab=draft_vocab),
                        device=device, random_weights_seed=random_weights_seed)
        if engine.speculator is not None:
            engine.speculator.forced_accept = accepted_drafts
        engine.mem.buffers["kv_pool"].zero_()
        results["fragment_order_products"] = engine.fragment_order_products  # which product layout ran
        results["kernel_switches"] = kernel_switches()
        shared, per_lane = _weight_and_lane_bytes(engine, depth)
        base_step = None
        for n in sorted(lanes):
            ids = list(range(n))
            for lane in ids:
                _synthetic_context(engine, depth, gen, lane)
            tokens = lane_tokens(n, distinct_tokens, engine.cfg.vocab_size)
            for _ in range(3):  # capture this batch size's graph, compile kernels
                engine.decode_step(ids, tokens)
            _sync(engine)
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.decode_step(ids, tokens)
            _sync(engine)
            step = (time.perf_counter() - t0) / steps
            base_step = base_step or step
            row = {"kv_dtype": kv, "lanes": n, "depth": depth, "step_ms": step * 1e3, "aggregate_tok_s": n / step,
                   "per_lane_tok_s": 1 / step, "step_vs_one_lane": step / base_step,
                   "bytes_per_step": _step_bytes(engine, shared, per_lane, n, distinct_tokens)}
            if bw:
                row["ideal_aggregate_tok_s"] = n * bw / row["bytes_per_step"]
                row["of_ideal"] = row["aggregate_tok_s"] / row["ideal_aggregate_tok_s"]
            if engine.speculator is not None:
                secs, gained, draft_ms, verify_ms = _spec_rounds(engine, ids, depth, steps, gen, distinct_tokens)
                # issue 20: a verify block of K + 1 rows a lane against the plain step of as many lanes
                row.update(spec_draft_ms=draft_ms, spec_verify_ms=verify_ms,
                           spec_verify_vs_step=verify_ms / (step * 1e3),
                           spec_round_ms=secs / steps * 1e3, spec_round_vs_step=secs / steps / step,
                           spec_tokens_per_lane_round=gained / (steps * n), spec_per_lane_tok_s=gained / n / secs,
                           spec_aggregate_tok_s=gained / secs, spec_vs_plain=gained / n / secs * step,
                           spec_stats=engine.speculator.stats.as_dict())
                # against the fewest lanes measured (one lane when the list has it)
                fewest = next((r for r in results["rows"] if r["kv_dtype"] == kv), row)
                row["spec_vs_plain_of_one_lane"] = row["spec_vs_plain"] / fewest["spec_vs_plain"]
            results["rows"].append(row)
            log(f"[{kv}] {n} lane(s) at {depth}: step {row['step_ms']:.2f} ms ({row['step_vs_one_lane']:.2f}x one lane), "
                f"aggregate {row['aggregate_tok_s']:.0f} tok/s" + (
                    f"; {spec} rounds {row['spec_round_ms']:.2f} ms, {row['spec_per_lane_tok_s']:.1f} tok/s a lane "
                    f"({row['spec_vs_plain']:.2f}x plain)" if "spec_vs_plain" in row else ""))
        if prefill_tokens and top > 1:
            results.setdefault("concurrent_prefill", []).extend(_concurrent_prefill(engine, top, depth, prefill_tokens,
                                                                                    gen, kv, log))
        engine.close()
        del engine
        if device.startswith("cuda"):
            gc.collect()
            torch.cuda.empty_cache()
    return results


SHARED_CHUNKS = (256, 512, 1024, 2048)  # --prefill-chunk-shared values the concurrent-prefill mode compares


def _concurrent_prefill(engine, lanes: int, depth: int, prompt_len: int, gen, kv: str, log) -> list[dict]:
    """Lane 0 prefills `prompt_len` tokens while lanes 1..lanes-1 decode, side by side in one run: the
    old schedule (a full chunk, then a decode step for the others) and the server's (chunks of
    --prefill-chunk-shared tokens that the decoding lanes' rows ride) at several shared sizes. Per
    schedule: the decoding lanes' inter-token gaps and the prefill's speed against the same prefill alone."""
    from .engine import Riders

    prompt = torch.randint(0, engine.cfg.vocab_size, (prompt_len,), generator=gen).tolist()
    engine.prefill(0, prompt)  # compile the prefill kernels for these chunk shapes outside the timing
    _sync(engine)
    t0 = time.perf_counter()
    engine.prefill(0, prompt)
    _sync(engine)
    alone = time.perf_counter() - t0
    decoders = list(range(1, lanes))
    for lane in decoders:
        _synthetic_context(engine, depth, gen, lane)
    tokens = [1] * len(decoders)
    plain = []
    last = time.perf_counter()
    for _ in range(16):
        engine.decode_step(decoders, tokens)
        _sync(engine)
        now = time.perf_counter()
        plain.append(now - last)
        last = now
    plain_step = _percentile(plain, 0.5)
    full_chunk, shared_default = engine.opts.prefill_chunk, engine.shared_chunk
    schedules = [("alternate", full_chunk)] + [("ride", size) for size in SHARED_CHUNKS if size < full_chunk]
    rows = []
    for warm in (True, False):  # the first pass compiles each schedule's chunk shapes
        for schedule, size in schedules:
            riders = Riders() if schedule == "ride" else None
            engine.shared_chunk = size
            for lane in decoders:  # the decoders' context stays near `depth`
                engine.ctx_len[lane] = depth
                engine.lane_tokens[lane] = engine.lane_tokens[lane][:depth]
            _sync(engine)
            gaps, rode = [], 0
            t0 = last = time.perf_counter()
            chunks = engine.prefill_chunks(0, prompt, riders=riders)
            while True:
                if riders is not None:
                    riders.offer(decoders, tokens)
                try:
                    next(chunks)
                except StopIteration:
                    break
                if riders is None or riders.logits is None:
                    engine.decode_step(decoders, tokens)
                else:
                    rode += 1
                _sync(engine)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now
            mixed = time.perf_counter() - t0
            if warm:
                continue
            row = {"kv_dtype": kv, "schedule": schedule, "prefill_tokens": prompt_len, "prefill_chunk": size,
                   "decoding_lanes": len(decoders), "rode_chunks": rode, "gap_p50_ms": _percentile(gaps, 0.5) * 1e3,
                   "gap_p99_ms": _percentile(gaps, 0.99) * 1e3, "plain_step_ms": plain_step * 1e3,
                   "prefill_alone_tok_s": prompt_len / alone, "prefill_with_decoders_tok_s": prompt_len / mixed,
                   "decode_tok_s_during_prefill": len(gaps) * len(decoders) / mixed}
            row["gap_vs_plain_step"] = row["gap_p99_ms"] / row["plain_step_ms"]
            row["prefill_vs_alone"] = row["prefill_with_decoders_tok_s"] / row["prefill_alone_tok_s"]
            rows.append(row)
            log(f"[{kv}] lane 0 prefills {prompt_len} while {len(decoders)} decode, {schedule} {size}-token chunks: "
                f"gap p50 {row['gap_p50_ms']:.1f} ms, p99 {row['gap_p99_ms']:.1f} ms ({row['gap_vs_plain_step']:.1f}x "
                f"the plain step {row['plain_step_ms']:.1f} ms); prefill {row['prefill_with_decoders_tok_s']:.0f} tok/s "
                f"({row['prefill_vs_alone']:.2f} of {row['prefill_alone_tok_s']:.0f} alone)")
    engine.shared_chunk = shared_default
    return rows


def _plot(results: dict, out_png, x: str, y: str, ideal: str, labels: tuple[str, str], xlabel: str, ylabel: str,
          title: str, log_x: bool) -> bool:
    """One line per KV dtype: the measured `y` solid, the `ideal` dashed, against `x`. False when
    matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kv in sorted({r["kv_dtype"] for r in results["rows"]}):
        rows = sorted((r for r in results["rows"] if r["kv_dtype"] == kv), key=lambda r: r[x])
        xs = [r[x] for r in rows]
        line, = ax.plot(xs, [r[y] for r in rows], marker="o", label=f"{labels[0]} {kv}")
        if all(ideal in r for r in rows):
            ax.plot(xs, [r[ideal] for r in rows], linestyle="--", color=line.get_color(), label=f"{labels[1]} {kv}")
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{results['artifact'].rsplit('/', 1)[-1]} on {results['device']}{title}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    return True


def plot(results: dict, out_png) -> bool:
    """tok/s vs depth per KV dtype (decode solid, roofline dashed)."""
    return _plot(results, out_png, "depth", "decode_tok_s", "roofline_tok_s", ("decode", "roofline"),
                 "context depth (tokens)", "tokens / s", "", True)


def plot_lanes(results: dict, out_png) -> bool:
    """Aggregate decode tok/s vs lanes per KV dtype (measured solid, one weight read per step dashed)."""
    return _plot(results, out_png, "lanes", "aggregate_tok_s", "ideal_aggregate_tok_s",
                 ("aggregate", "one weight read per step"), "lanes decoding at once", "tokens / s (all lanes)",
                 f", {results['depth']} tokens per lane", False)


def kernel_switches() -> dict:
    """The side-by-side kernel switches in effect (NINFER_*), recorded with every bench result so a JSON file says
    which paths produced its numbers: the main ones as the runtime read them, and every switch the environment
    set (`environment`)."""
    from . import engine as engine_module
    from .kernels import qgemm_fragment_layout as fl
    from .kernels import qlinear as ql
    from .kernels import rmsnorm as rn
    from .kernels.paged_attention_frag import FRAG_ATTENTION
    from .switches import switches_set

    return {"gemv_frag": ql.FRAG_MODE, "fragment_pairs": fl.PAIR_ORDER, "fragment_int8": fl.FRAGMENT_INT8,
            "q5_fields": fl.Q5_FIELDS,
            "swiglu_epilogue": ql.SWIGLU_EPILOGUE, "attention_frag": FRAG_ATTENTION["mode"],
            "rmsnorm_spread_splits": rn.SPREAD_MAX_SPLITS, "moe_decode": engine_module.MOE_DECODE,
            "attention_launches": engine_module.ATTENTION_LAUNCHES, "weight_cache": engine_module.WEIGHT_CACHE,
            "fragment_tile": dict(fl.FRAGMENT_TUNING), "fragment_ks_rule": fl.FRAGMENT_KS_RULE,
            "swiglu_fragment": ql.SWIGLU_FRAGMENT_KS,
            "fragment_ks": {f"{r}x{c}": spans for (r, c), spans in fl.WARPS_SHARING_K.items()},
            "environment": switches_set()}


def graph_us(fn, reps: int = 20) -> float:
    """Microseconds per call of `fn` replayed from a CUDA graph of 10 calls (as the engine's decode step
    runs its kernels: no launch gaps in the time)."""
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (reps * 10) * 1e6


def distinct_products(path) -> dict[tuple[str, int, int], list[str]]:
    """The text model's quantized matrices grouped by (format, rows, columns): the products a decode step
    runs, each geometry once, with the names of every matrix that has it."""
    from format.container import open_artifact
    from format.numeric import GroupedFormat, get_format

    products: dict[tuple[str, int, int], list[str]] = {}
    with open_artifact(path) as art:
        tied = not art.has("text/output_head")  # the head multiplies by the embedding matrix
        for name, e in art.objects.items():
            if e.component != "text" or len(e.shape or ()) != 2 or not isinstance(get_format(e.format), GroupedFormat):
                continue
            if name == "text/token_embedding" and not tied:  # looked up row by row, never multiplied
                continue
            products.setdefault((e.format, e.shape[0], e.shape[1]), []).append(name)
    return products


def run_kernel_bench(path, row_counts: list[int], device: str = "cuda", l2_bytes: int = 256 << 20, log=print) -> dict:
    """Every distinct quantized product of the artifact's text model (format, rows, columns), with random
    codes of its geometry, at T = each of `row_counts` rows of x: microseconds, the fraction of the copy
    bandwidth its weight bytes allow, and the cost in one-row products; each weight in enough copies
    (cycled through by the replays) that no replay reads it from L2. Which kernel serves T rows is the
    runtime's own choice (qlinear)."""
    from format.layouts import RowSplitGeometry
    from format.numeric import get_format

    from .kernels.qgemm_fragment_layout import layer_order, takes_fragment_layout, to_fragment_layout
    from .kernels.qlinear import PackedLinear, fragment_layout_enabled, qlinear, rows_path, uses_frag

    products = distinct_products(path)
    bw = copy_bandwidth(device)
    results = {"artifact": str(path), "mode": "kernels", "device": torch.cuda.get_device_name(device),
               "copy_bandwidth_bytes_per_s": bw, "row_counts": row_counts, "rows": []}
    gen = torch.Generator(device).manual_seed(0)
    for (fmt_name, n, k), names in sorted(products.items(), key=lambda kv: -kv[0][1] * kv[0][2]):
        fmt = get_format(fmt_name)
        geo = RowSplitGeometry(n, k, fmt)
        copies = max(1, -(-l2_bytes // geo.total_bytes))
        weights = []
        for _ in range(copies):
            raw = torch.randint(0, 256, (geo.total_bytes,), dtype=torch.uint8, device=device, generator=gen)
            base, high, scale = geo.split(raw)
            scale.view(torch.float16).copy_((torch.rand(scale.numel() // 2, device=device, generator=gen) * 1e-3).half())
            w = PackedLinear(base, high, scale, n, k, fmt)
            # as an engine multiplying up to that many rows per step binds it
            rows = max(row_counts)
            if fragment_layout_enabled(rows, fmt.bits, names[0]) and takes_fragment_layout(names[0], w, rows):
                to_fragment_layout(w, layer_order(fmt.bits))
            weights.append(w)
        short = names[0].split("/layers/")[-1].split("/", 1)[-1] if "/layers/" in names[0] else names[0].split("/")[-1]
        row = {"matrix": short, "format": fmt_name, "N": n, "K": k, "bytes": geo.total_bytes, "per_step": len(names)}
        for t in row_counts:
            x = torch.randn(t, k, device=device, generator=gen).to(torch.bfloat16)
            y = torch.empty(t, n, device=device, dtype=torch.bfloat16)
            cycle = itertools.cycle(weights)
            us = graph_us(lambda: qlinear(x, next(cycle), out=y))
            row[f"t{t}_us"] = us
            row[f"t{t}_of_copy"] = geo.total_bytes / (us * 1e-6) / bw
            row[f"t{t}_kernel"] = ("GEMM" if t > 16 else "fragment order" if weights[0].fragment is not None
                                   else "fragment" if uses_frag(weights[0], t) else "decode GEMV" if t == 1
                                   else rows_path(fmt.bits, t))
            if row_counts[0] == 1:
                row[f"t{t}_vs_t1"] = us / row["t1_us"]
        results["rows"].append(row)
        log(f"{short} {fmt_name} {n}x{k}: " + ", ".join(f"T={t} {row[f't{t}_us']:.1f} us" for t in row_counts))
        del weights
        torch.cuda.empty_cache()
    return results
