"""Where a DFlash2 round's time goes on a full-size random shape: CUDA-graph replay time of the draft step
and of the verify forward alone, then kernel time per name over eager draft steps.

    PYTHONPATH=. python bench/profile_draft.py qwen3.6-27b OUT.json [DRAFT_TOKENS] [KV_DTYPE] [lm-head-draft]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from format.shapes import write_shape_artifact
from runtime.engine import Engine
from runtime.memory_plan import PlanOptions


def _replay_ms(fn, n: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1000


def main(shape: str, out: str, draft_tokens: str = "7", kv_dtype: str = "bf16", head: str = "") -> None:
    k = int(draft_tokens)
    draft_head = head == "lm-head-draft"
    art = write_shape_artifact(shape, Path(tempfile.mkdtemp()) / f"{shape}.nfer", "q4", mtp=False, dflash2=True,
                               lm_head_draft=32768 if draft_head else 0)
    opts = PlanOptions(max_context=8192 + 64, prefill_chunk=2048, kv_dtype=kv_dtype, spec="dflash2", draft_tokens=k,
                       lm_head_draft=draft_head)
    eng = Engine(art, opts, device="cuda", random_weights_seed=0)
    spec = eng.speculator
    prompt = list(range(1, 8001))
    nxt = int(eng.prefill(0, prompt).argmax())
    lanes = torch.tensor([0], device="cuda")
    anchors, starts = torch.tensor([nxt], device="cuda"), torch.tensor([len(prompt)], device="cuda")
    tokens = torch.tensor([[nxt] * (k + 1)], device="cuda")
    positions = len(prompt) + torch.arange(k + 1, device="cuda")[None]
    eng.ctx_len[0] = len(prompt) + k + 1
    result = {"shape": shape, "draft_tokens": k, "kv_dtype": kv_dtype, "lm_head_draft": draft_head}
    result["draft_graph_ms"] = _replay_ms(lambda: eng.run_step(("draft", 1), spec._draft, lanes, anchors, starts))
    result["verify_graph_ms"] = _replay_ms(lambda: eng.run_step(("verify", 1), spec._verify, lanes, tokens, positions))
    result["decode_graph_ms"] = _replay_ms(lambda: eng.run_step(("decode", 1), eng.forward, lanes, tokens[:, :1],
                                                                positions[:, :1]))
    print({key: round(v, 3) for key, v in result.items() if key.endswith("_ms")})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(4):
            spec._draft(lanes, anchors, starts)
        torch.cuda.synchronize()
    rows = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0)
        if t:
            rows[ev.key] = {"us_per_step": t / 4, "calls_per_step": ev.count / 4}
    total = sum(r["us_per_step"] for r in rows.values())
    print(f"draft step (eager): {total / 1000:.2f} ms of kernel time over "
          f"{sum(r['calls_per_step'] for r in rows.values()):.0f} kernels")
    for name, r in sorted(rows.items(), key=lambda kv: -kv[1]["us_per_step"])[:30]:
        print(f"{r['us_per_step']:9.1f} us {r['calls_per_step']:6.0f}x  {name[:110]}")
    result.update(draft_kernel_us=total, kernels=rows)
    Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(*sys.argv[1:6])
