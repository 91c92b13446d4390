"""Can decoding lanes and a long prompt's prefill run side by side instead of in turns (issue 20 item 4)? Today the
decoding lanes ride inside the prefill's chunks, so their next token waits for a whole chunk (7.4 steps at 512-token
chunks, the prefill at 0.77 of its speed alone: bench/RESULTS.md §3). A decode step is bandwidth-bound and a prefill
chunk mostly compute-bound, so running them concurrently could serve both — if the GPU lets the decode step's ~550
small kernels through while the prefill's GEMMs hold the SMs. This probe measures that on a stand-in: 27B decode steps
over 3 lanes (the engine's CUDA graph, each step's tokens read back by the host as a server does) beside a stream of
bf16 GEMMs of a 512-row prefill chunk's shapes, in these arrangements:

  alone       each by itself (the references)
  streams     two streams, same priority
  priority    the decode stream at the highest priority
  green:N     the GEMMs in a green context of the other SMs, N SMs left to the decode (its stream at high priority)

For each: the decode step (p50 / p90 ms, x alone) and the GEMMs' TFLOP/s (x alone). A green context the driver
refuses is reported, not fatal.

    PYTHONPATH=. python bench/overlap_probe.py OUT.json [MODES]      # default: alone,streams,priority,green:16,green:32
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

GEMM_SHAPES = [(5120, 16384), (5120, 34816), (17408, 5120), (6144, 5120)]  # (K, N): qkvz, gate_up, down, GDN out
CHUNK_ROWS = 512
DECODE_LANES = 3


def _gemm_load(torch):
    """The operands and a function queueing `rounds` passes over the chunk's four GEMM shapes on the current stream;
    returns the FLOPs queued."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    mats = [(torch.randn(CHUNK_ROWS, k, device="cuda", dtype=torch.bfloat16, generator=gen),
             torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen)) for k, n in GEMM_SHAPES]
    outs = [torch.empty(CHUNK_ROWS, n, device="cuda", dtype=torch.bfloat16) for _, n in GEMM_SHAPES]

    def queue(rounds: int) -> int:
        for _ in range(rounds):
            for (x, w), y in zip(mats, outs):
                torch.mm(x, w.t(), out=y)
        return rounds * sum(2 * CHUNK_ROWS * k * n for k, n in GEMM_SHAPES)

    return queue


def _decode_steps(torch, eng, stream, running=None, steps: int = 40) -> list[float]:
    """Decode steps of lanes 0..DECODE_LANES-1 on `stream`, each waited for by the host (its tokens read back), while
    `running()` (at least 5 steps) or `steps` steps. Returns each step's ms on the GPU."""
    lanes = list(range(DECODE_LANES))
    tokens = [1] * DECODE_LANES
    times = []
    with torch.cuda.stream(stream):
        while len(times) < steps:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            tokens = eng.decode_step(lanes, tokens).argmax(-1).tolist()  # the host waits, as the server does
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end))
            if running is not None and len(times) >= 5 and not running():
                break
    return times


def _gemms_beside(torch, queue, rounds: int, stream, green=None) -> dict:
    """Queue the GEMM load on `stream` from a thread of its own (the launch queue fills, and its launches block while
    the decode steps go on; torch releases the GIL inside them), in `green`'s context if given; returns what the
    thread saw: the GEMMs' ms and FLOPs, or its error."""
    import threading

    seen: dict = {"started": threading.Event()}

    def work() -> None:
        try:
            if green is not None:
                green.set_context()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                seen["started"].set()
                seen["flops"] = queue(rounds)
                end.record(stream)
            end.synchronize()
            seen["ms"] = start.elapsed_time(end)  # here: events belong to the context they were made in
            if green is not None:
                green.pop_context()
        except Exception as exc:  # noqa: BLE001 - reported by the caller
            seen["error"] = exc
        finally:
            seen["started"].set()

    seen["thread"] = threading.Thread(target=work, daemon=True)
    seen["thread"].start()
    seen["started"].wait()
    return seen


def main(out: str, modes: str = "alone,streams,priority,green:16,green:32") -> None:
    import torch

    from format.shapes import write_shape_artifact
    from runtime.bench import _percentile  # the lanes bench's gap percentiles
    from runtime.engine import Engine
    from runtime.memory_plan import PlanOptions

    art = write_shape_artifact("qwen3.6-27b", Path(tempfile.mkdtemp()) / "27b.nfer", "q4")
    eng = Engine(art, PlanOptions(max_context=8192 + 64, prefill_chunk=2048, kv_dtype="bf16",
                                  max_concurrency=DECODE_LANES + 1, weight_cache="off"), device="cuda",
                 random_weights_seed=0)  # no dense weight copies: the GEMM operands need the memory
    for lane in range(DECODE_LANES):
        eng.prefill(lane, list(range(1 + lane, 4097 + lane)))
    queue = _gemm_load(torch)
    default = torch.cuda.current_stream()
    _decode_steps(torch, eng, default, steps=5)  # capture the graph, warm up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    flops = queue(4)
    end.record()
    end.synchronize()
    round_ms = start.elapsed_time(end) / 4
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results = {"device": torch.cuda.get_device_name(), "sms": sms, "chunk_rows": CHUNK_ROWS,
               "decode_lanes": DECODE_LANES, "modes": {}}
    ref, rounds = {}, 0
    for mode in modes.split(","):
        row: dict = {}
        try:
            if mode == "alone":
                row["decode_ms"] = _decode_steps(torch, eng, default)
                start.record()
                flops = queue(20)
                end.record()
                end.synchronize()
                row["gemm_tflops"] = flops / (start.elapsed_time(end) * 1e-3) / 1e12
                ref = row
            else:
                # enough GEMM rounds to cover ~40 decode steps at 3x their time alone
                rounds = rounds or max(20, int(40 * 3 * _percentile(ref.get("decode_ms", [10.0]), 0.5) / round_ms))
                priority = 0 if mode == "streams" else torch.cuda.Stream.priority_range()[1]
                decode_stream = torch.cuda.Stream(priority=priority)
                green = None
                if mode.startswith("green:"):
                    from torch.cuda.green_contexts import GreenContext

                    green = GreenContext.create(num_sms=sms - int(mode.split(":")[1]))
                    gemm_stream = green.Stream()
                else:
                    gemm_stream = torch.cuda.Stream()
                torch.cuda.synchronize()
                seen = _gemms_beside(torch, queue, rounds, gemm_stream, green)
                row["decode_ms"] = _decode_steps(torch, eng, decode_stream, running=seen["thread"].is_alive)
                seen["thread"].join()
                if "error" in seen:
                    raise seen["error"]
                row["gemm_tflops"] = seen["flops"] / (seen["ms"] * 1e-3) / 1e12
                row["gemm_rounds"] = rounds
        except Exception as exc:  # noqa: BLE001 - a refused green context or stream is a result of the probe
            row = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
        if "decode_ms" in row:
            steps = row["decode_ms"]
            row.update(decode_p50_ms=_percentile(steps, 0.5), decode_p90_ms=_percentile(steps, 0.9), steps=len(steps))
            if ref and row is not ref:
                row.update(decode_x_alone=row["decode_p50_ms"] / ref["decode_p50_ms"],
                           gemm_x_alone=row["gemm_tflops"] / ref["gemm_tflops"])
        results["modes"][mode] = row
        shown = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items() if k != "decode_ms"}
        print(json.dumps({"mode": mode, **shown}), flush=True)
    Path(out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
