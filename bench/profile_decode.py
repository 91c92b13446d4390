"""Where one decode step's GPU time goes: kernel time per kernel name over eager decode steps of a
full-size random shape (the kernels are the same ones the CUDA graph replays).

    PYTHONPATH=. python bench/profile_decode.py qwen3.6-27b OUT.json [decode|prefill] [KV_DTYPE]

With `prefill`, profiles one cold 8,192-token prefill in 2,048-token chunks instead.
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


def main(shape: str, out: str, mode: str = "decode", kv_dtype: str = "bf16", steps: int = 4) -> None:
    art = write_shape_artifact(shape, Path(tempfile.mkdtemp()) / f"{shape}.nfer", "q4", mtp=False)
    eng = Engine(art, PlanOptions(max_context=8192 + 64, prefill_chunk=2048, kv_dtype=kv_dtype), device="cuda", cuda_graphs=False,
                 random_weights_seed=0)
    prompt = list(range(1, 8193)) if mode == "prefill" else list(range(1, 4097))
    logits = eng.prefill(0, prompt)
    tok = int(logits.argmax())
    for _ in range(2):  # compile
        tok = int(eng.decode_step([0], [tok])[0].argmax())
    torch.cuda.synchronize()
    if mode == "prefill":
        steps = 1
        eng.reset_lane(0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        if mode == "prefill":
            eng.prefill(0, prompt)
        else:
            for _ in range(steps):
                tok = int(eng.decode_step([0], [tok])[0].argmax())
        torch.cuda.synchronize()
    rows = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0)
        if t:
            rows[ev.key] = {"us_per_step": t / steps, "calls_per_step": ev.count / steps}
    total = sum(r["us_per_step"] for r in rows.values())
    top = sorted(rows.items(), key=lambda kv: -kv[1]["us_per_step"])
    print(f"{shape} {mode}: kernel time per {'prefill of 8,192 tokens' if mode == 'prefill' else 'decode step'} {total / 1000:.2f} ms over {sum(r['calls_per_step'] for r in rows.values()):.0f} kernels")
    for name, r in top[:25]:
        print(f"{r['us_per_step']:9.1f} us {r['calls_per_step']:6.0f}x  {name[:110]}")
    Path(out).write_text(json.dumps({"shape": shape, "total_us": total, "kernels": rows}, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:5])
