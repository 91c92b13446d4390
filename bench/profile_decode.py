"""Where one decode step's GPU time goes: kernel time per kernel name over eager decode steps of a
full-size random shape (the kernels are the same ones the CUDA graph replays).

    PYTHONPATH=. python bench/profile_decode.py qwen3.6-27b OUT.json [decode|prefill|mtp|dflash2] [KV_DTYPE] [LANES]

With `prefill`, profiles one cold 8,192-token prefill in 2,048-token chunks instead; with `ride`, lane 0's
512-token shared chunks (the first 4 of an 8,192-token prompt, per chunk) with 3 lanes at 4K riding in each (issue 20
item 4: where a riding forward's time goes beyond its GEMMs); with `mtp` / `dflash2`, one
batched speculative round per lane count (3 / 7 drafts, every draft forced accepted: drafting and the verify
block) instead of a decode step. LANES (e.g. `1,4`)
profiles a step over that many lanes each (4,096 tokens of context per lane), on one engine planned for
the most of them (so every count takes the kernels a server with that many lanes takes), and prints
the kernels side by side: what each added lane costs, and where.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

from format.shapes import write_shape_artifact
from runtime.engine import Engine
from runtime.memory_plan import PlanOptions


def _profile(eng: Engine, lanes: list[int], steps: int, prefill: list[int] | None = None) -> dict:
    tokens = [int(eng.decode_step(lanes, [1] * len(lanes))[row].argmax()) for row in range(len(lanes))]  # compile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        if prefill is not None:
            eng.prefill(0, prefill)
        else:
            for _ in range(steps):
                logits = eng.decode_step(lanes, tokens)
                tokens = logits.argmax(-1).tolist()
        torch.cuda.synchronize()
    return _kernel_times(prof, steps)


def _kernel_times(prof, steps: int) -> dict:
    """GPU time and launches per step of each kernel name a profile saw over `steps` steps."""
    rows = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0)
        if t:
            rows[ev.key] = {"us_per_step": t / steps, "calls_per_step": ev.count / steps}
    return rows


def _profile_ride(eng: Engine, chunks: int) -> dict:
    """Kernel time per riding shared chunk: lane 0 prefills while lanes 1-3 (4K context each) ride in its chunks."""
    from runtime.engine import Riders

    decoders, vocab = [1, 2, 3], eng.cfg.vocab_size - 1
    for lane in decoders:
        eng.prefill(lane, [1 + (i + lane) % vocab for i in range(4096)])
    prompt = [1 + i % vocab for i in range(8192)]

    def run(limit: int) -> None:
        eng.reset_lane(0)
        riders, tokens = Riders(), [1] * len(decoders)
        pieces = eng.prefill_chunks(0, prompt, riders=riders)
        for _ in range(limit):
            riders.offer(decoders, tokens)
            next(pieces)
            tokens = riders.logits.argmax(-1).tolist()
        pieces.close()

    run(2)  # compile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run(chunks)
        torch.cuda.synchronize()
    return _kernel_times(prof, chunks)


def _profile_rounds(eng: Engine, lanes: list[int], rounds: int) -> dict:
    """Kernel time per batched speculative round over `lanes` (drafts forced accepted), as _profile."""
    from runtime.bench import _synthetic_context

    spec, gen = eng.speculator, torch.Generator().manual_seed(0)
    for lane in lanes:
        _synthetic_context(eng, 4096, gen, lane)
    nxt, budget = [1] * len(lanes), [1 << 30] * len(lanes)
    nxt = [new[-1] for new in spec.round(lanes, nxt, budget)]  # compile
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            nxt = [new[-1] for new in spec.round(lanes, nxt, budget)]
        torch.cuda.synchronize()
    return _kernel_times(prof, rounds)


def main(shape: str, out: str, mode: str = "decode", kv_dtype: str = "bf16", lanes: str = "1", steps: int = 4) -> None:
    counts = [int(n) for n in lanes.split(",")]
    spec = mode if mode in ("mtp", "dflash2") else "none"
    drafts = {"mtp": 3, "dflash2": 7}.get(mode, 3)
    art = write_shape_artifact(shape, Path(tempfile.mkdtemp()) / f"{shape}.nfer", "q4", mtp=spec == "mtp",
                               dflash2=spec == "dflash2")
    if mode == "ride":
        counts = [4]
    eng = Engine(art, PlanOptions(max_context=8192 + 64, prefill_chunk=2048, kv_dtype=kv_dtype,
                                  max_concurrency=max(counts), spec=spec, draft_tokens=drafts,
                                  shared_prefill_chunk=512 if mode == "ride" else None),
                 device="cuda", cuda_graphs=False, random_weights_seed=0)
    if spec != "none":
        eng.speculator.forced_accept = drafts
        results = {n: _profile_rounds(eng, list(range(n)), steps) for n in counts}
    elif mode == "ride":
        results = {4: _profile_ride(eng, chunks=4)}
    elif mode == "prefill":
        prompt = list(range(1, 8193))
        eng.prefill(0, prompt)
        eng.reset_lane(0)
        results = {1: _profile(eng, [0], 1, prompt)}
    else:
        for lane in range(max(counts)):
            eng.prefill(lane, list(range(1 + lane, 4097 + lane)))
        results = {n: _profile(eng, list(range(n)), steps) for n in counts}
    totals = {n: sum(r["us_per_step"] for r in rows.values()) for n, rows in results.items()}
    what = {"prefill": "prefill of 8,192 tokens", "ride": "512-token shared chunk with 3 riders", "mtp": "MTP3 round",
            "dflash2": "DFlash2 K = 7 round"}.get(mode, "decode step")
    for n, rows in results.items():
        print(f"{shape} {mode} {n} lane(s): kernel time per {what} {totals[n] / 1000:.2f} ms over "
              f"{sum(r['calls_per_step'] for r in rows.values()):.0f} kernels")
    last = counts[-1]
    names = sorted(results[last], key=lambda k: -results[last][k]["us_per_step"])
    print("  ".join(f"{n} lane(s) us" for n in counts) + "  calls  kernel")
    for name in names[:30]:
        cells = "  ".join(f"{results[n].get(name, {}).get('us_per_step', 0.0):12.1f}" for n in counts)
        print(f"{cells}  {results[last][name]['calls_per_step']:5.0f}x  {name[:100]}")
    Path(out).write_text(json.dumps({"shape": shape, "mode": mode, "kv_dtype": kv_dtype,
                                     "lanes": {str(n): {"total_us": totals[n], "kernels": results[n]} for n in counts}},
                                    indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:6])
