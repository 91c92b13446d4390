"""Where a CUDA-graph decode step's wall time goes, from the GPU's own timeline: kernels and copies of several
replayed steps (the graph the server runs, chained so no step waits for the host) recorded by the torch profiler,
then each microsecond of a step charged to exactly one thing — the kernel the stream is waiting on (the earliest
started one still running; a PDL-launched successor idling in its wait is not charged) or the idle gap before the
next kernel starts. The eager profile (bench/profile_decode.py) sums kernel durations, which under PDL overlap and
leave out launch gaps; issue 21 asks where a 27B step's time beyond its products goes, and this answers it.

    PYTHONPATH=. python bench/step_timeline.py qwen3.6-27b OUT.json [KV_DTYPE] [LANES] [STEPS]

Prints the step's period (and the same steps timed without the profiler, whose own cost shows against it), its
busy and idle time, idle gaps by size, and the charged time per kernel class and per kernel (calls a step, mean
duration in place, charged); OUT.json holds the same.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

TIMELINE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
# kernel name patterns -> class, first match wins (Triton kernels keep their function names)
CLASSES = [("products", r"qgemv|qgemm|fragment|gemv|gemm|nvjet|cutlass|sm90_xmma|dense_rows|expert"),
           ("norms", r"rmsnorm|norm"),
           ("gdn", r"gdn|recurr"),
           ("conv", r"conv"),
           ("attention", r"attention|combine|kv_append|rope"),
           ("sampling", r"argmax|sampl|topk|softmax"),
           ("copies", r"^Memcpy|^Memset|memcpy|memset")]
GAP_EDGES_US = (1.0, 2.0, 5.0, 20.0)


def kernel_spans(trace: dict) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every kernel, copy and memset in a chrome trace, by start."""
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), str(e.get("name", "?")))
             for e in trace.get("traceEvents", []) if e.get("cat") in TIMELINE_CATEGORIES and "dur" in e]
    return sorted(spans)


def kernel_class(name: str) -> str:
    for label, pattern in CLASSES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def timeline_summary(spans: list[tuple[float, float, str]], steps: int) -> dict:
    """Split the spans (one stream, time order) into `steps` steps of equal span count and charge each step's period:
    a span gets the time from max(its start, the latest end before it) to its end; the rest is idle. A step's period
    runs from its first span's start to the next step's (the last step: to its own latest end)."""
    if steps < 1 or not spans or len(spans) % steps:
        raise ValueError(f"step_timeline: {len(spans)} spans do not split into {steps} steps of equal count (a kernel "
                         "ran outside the replayed steps, or the profiler dropped events)")
    per = len(spans) // steps
    charged, calls, dur = defaultdict(float), defaultdict(int), defaultdict(float)
    gaps, periods, busy_total = [], [], 0.0
    for i in range(steps):
        step = spans[i * per:(i + 1) * per]
        end_of = spans[(i + 1) * per][0] if i + 1 < steps else max(e for _, e, _ in step)
        latest = step[0][0]
        for start, end, name in step:
            if start > latest:
                gaps.append(start - latest)
            got = max(0.0, end - max(start, latest))
            charged[name] += got
            busy_total += got
            calls[name] += 1
            dur[name] += end - start
            latest = max(latest, end)
        if end_of > latest:
            gaps.append(end_of - latest)
        periods.append(end_of - step[0][0])
    period = sum(periods) / steps
    idle = sum(gaps) / steps
    kernels = sorted(({"name": n, "calls_per_step": calls[n] / steps, "mean_us": dur[n] / calls[n],
                       "charged_us_per_step": charged[n] / steps, "class": kernel_class(n)} for n in charged),
                     key=lambda k: -k["charged_us_per_step"])
    classes = defaultdict(lambda: {"charged_us_per_step": 0.0, "calls_per_step": 0.0})
    for k in kernels:
        classes[k["class"]]["charged_us_per_step"] += k["charged_us_per_step"]
        classes[k["class"]]["calls_per_step"] += k["calls_per_step"]
    bins = [0] * (len(GAP_EDGES_US) + 1)
    binned = [0.0] * (len(GAP_EDGES_US) + 1)
    for g in gaps:
        b = sum(g >= edge for edge in GAP_EDGES_US)
        bins[b] += 1
        binned[b] += g
    labels = [f"< {GAP_EDGES_US[0]:g}"] + [f"{a:g}-{b:g}" for a, b in zip(GAP_EDGES_US, GAP_EDGES_US[1:])] + \
        [f">= {GAP_EDGES_US[-1]:g}"]
    return {"steps": steps, "spans_per_step": per, "period_us": period, "busy_us": busy_total / steps,
            "idle_us": idle, "idle_gaps": {lab: {"per_step": n / steps, "us_per_step": t / steps}
                                           for lab, n, t in zip(labels, bins, binned)},
            "classes": dict(sorted(classes.items(), key=lambda kv: -kv[1]["charged_us_per_step"])),
            "kernels": kernels}


def window_summary(spans: list[tuple[float, float, str]], steps: int) -> dict:
    """A window of `steps` steps whose spans need not split evenly (a server's steps, with its sampling and copies
    between them), charged as one step by timeline_summary: the window's period and busy time a step, and each
    kernel's summed duration and calls a step, most first."""
    if steps < 1 or not spans:
        raise ValueError("step_timeline: an empty window")
    whole = timeline_summary(spans, 1)
    kernels = sorted(({"name": k["name"], "us_per_step": k["mean_us"] * k["calls_per_step"] / steps,
                       "calls_per_step": k["calls_per_step"] / steps, "class": k["class"]} for k in whole["kernels"]),
                     key=lambda k: -k["us_per_step"])
    classes: dict[str, float] = defaultdict(float)
    for k in kernels:
        classes[k["class"]] += k["us_per_step"]
    return {"period_us": whole["period_us"] / steps, "busy_us": whole["busy_us"] / steps,
            "spans_per_step": len(spans) / steps, "classes": dict(sorted(classes.items(), key=lambda kv: -kv[1])),
            "kernels": kernels}


def print_summary(title: str, s: dict, top: int = 25) -> None:
    unprofiled = f" ({s['unprofiled_period_us']:.1f} unprofiled)" if "unprofiled_period_us" in s else ""
    print(f"{title}: period {s['period_us']:.1f} µs a step{unprofiled}, {s['spans_per_step']} kernels and copies; "
          f"charged {s['busy_us']:.1f}, idle {s['idle_us']:.1f}")
    print("  idle gaps (µs): " + ", ".join(f"{lab}: {g['per_step']:.0f} x = {g['us_per_step']:.1f}"
                                          for lab, g in s["idle_gaps"].items()))
    for label, c in s["classes"].items():
        print(f"  {label:10s} {c['charged_us_per_step']:9.1f} µs  {c['calls_per_step']:5.0f} calls")
    print("  charged µs  mean µs  calls  kernel")
    for k in s["kernels"][:top]:
        print(f"  {k['charged_us_per_step']:10.1f}  {k['mean_us']:7.2f}  {k['calls_per_step']:5.0f}  {k['name'][:90]}")


def main(shape: str, out: str, kv_dtype: str = "bf16", lanes: str = "1", steps: str = "8") -> None:
    import torch

    from format.shapes import write_shape_artifact
    from runtime.engine import Engine
    from runtime.memory_plan import PlanOptions

    counts, n_steps = [int(n) for n in lanes.split(",")], int(steps)
    art = write_shape_artifact(shape, Path(tempfile.mkdtemp()) / f"{shape}.nfer", "q4")
    eng = Engine(art, PlanOptions(max_context=8192 + 64, prefill_chunk=2048, kv_dtype=kv_dtype,
                                  max_concurrency=max(counts)), device="cuda", random_weights_seed=0)
    for lane in range(max(counts)):
        eng.prefill(lane, list(range(1 + lane, 4097 + lane)))
    results = {}
    for n in counts:
        lanes_n = list(range(n))

        def run(k: int, tokens: torch.Tensor) -> torch.Tensor:
            for _ in range(k):  # chained: each step's tokens picked on the device, no wait for the host
                tokens = eng.decode_step(lanes_n, None, device_tokens=tokens).argmax(-1)
            return tokens

        tokens = run(3, torch.ones(n, dtype=torch.long, device="cuda"))  # capture and warm up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        tokens = run(n_steps, tokens)
        end.record()
        torch.cuda.synchronize()
        unprofiled_us = start.elapsed_time(end) * 1000 / n_steps  # the profiler's own cost shows against this
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run(n_steps, tokens)
            torch.cuda.synchronize()
        trace = Path(tempfile.mkdtemp()) / "trace.json"
        prof.export_chrome_trace(str(trace))
        results[n] = timeline_summary(kernel_spans(json.loads(trace.read_text())), n_steps)
        results[n]["unprofiled_period_us"] = unprofiled_us
        if results[n]["spans_per_step"] < 20:
            print(f"step_timeline: only {results[n]['spans_per_step']} kernels a step recorded: this profiler does "
                  "not see the kernels inside CUDA graphs", file=sys.stderr)
        print_summary(f"{shape} {kv_dtype} {n} lane(s)", results[n])
    Path(out).write_text(json.dumps({"shape": shape, "kv_dtype": kv_dtype,
                                     "lanes": {str(n): s for n, s in results.items()}}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
