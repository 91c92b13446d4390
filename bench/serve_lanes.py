"""`ninfer serve`'s aggregate speed with several lanes: the real server (app + lane scheduler + engine)
over a full-size random-weights shape on the GPU, driven by N concurrent streaming clients on
loopback, against one client alone. Tokens are counted from each response's usage. The clients run in
processes of their own (as real clients do: they never share the server's interpreter lock).

With --paced-step-ms MS the engine is a stand-in whose decode step takes MS milliseconds (sleeping, as a
GPU step leaves the host free) and whose logits are random over the tiny tokenizer's vocabulary: the
server's own per-token cost (scheduler, detokenization, parsing, SSE) on any machine, no GPU needed.

The engine captures its CUDA graphs before the clients come, as `ninfer serve` does (--no-warm-up: on first use,
maybe inside a timed run). Beside each run's tok/s it reports each decode step's GPU time (CUDA events around the
call: the mean, median and slowest) and the host's own time inside the call, the CUDA graphs captured during the run,
and after the runs the same engine's chained steps timed with no server around them. --profile-host adds a cProfile
of the step calls; --gpu-profile one more run with the GPU's kernels recorded over 16 steady steps.

    PYTHONPATH=. python bench/serve_lanes.py [qwen3.6-27b] [--lanes 4] [--tokens 256] [--json OUT.json]
        [--no-warm-up] [--profile-host] [--gpu-profile]
    PYTHONPATH=. python bench/serve_lanes.py --paced-step-ms 8.8 --lanes 4 --tokens 256
"""

from __future__ import annotations

import argparse
import concurrent.futures
import cProfile
import io
import json
import multiprocessing
import pstats
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path


_client = None  # each client process keeps one connection pool, as SDK clients do (a new httpx client per
# request costs ~0.1 s of TLS context set-up, which would count as time to first token)


def _stream(url: str, prompt: str, tokens: int) -> dict:
    """One streaming chat completion; returns its token count and the seconds from request to last byte."""
    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, usage, text = None, None, []
    with _client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                said = choice["delta"].get("content") or choice["delta"].get("reasoning_content")
                if said:  # (the prompt opens a thinking block: reasoning first)
                    first = first or time.perf_counter()
                    text.append(said)
    end = time.perf_counter()
    return {"tokens": usage["completion_tokens"], "seconds": end - t0, "ttft_s": (first or end) - t0,
            "text": "".join(text)}


class PacedEngine:
    """An engine stand-in for the server's host-side cost: every decode step sleeps `step_s` (the
    host is free while a real GPU step runs) and returns random logits; a prefill is one such step."""

    def __init__(self, lanes: int, vocab: int, step_s: float, never: list[int], max_context: int = 8192):
        import torch

        from runtime.memory_plan import PlanOptions

        self.lanes, self.step_s, self.device, self.speculator = lanes, step_s, torch.device("cpu"), None
        # the CPU has no stream to chain steps on: the scheduler's step would wait here either way
        self.record_fed_tokens = lambda lanes, tokens: None
        self.opts = PlanOptions(max_context=max_context, max_concurrency=lanes)
        self.cfg = type("Config", (), {"vocab_size": vocab})()
        self.held = [0] * lanes
        self.random = torch.Generator().manual_seed(0)
        self.never = never  # special tokens (an end of turn would stop a client early)

    def _logits(self, rows: int):
        import torch

        time.sleep(self.step_s)
        logits = torch.randn(rows, self.cfg.vocab_size, generator=self.random)
        logits[:, self.never] = float("-inf")
        return logits

    def held_tokens(self, lane: int) -> int:
        return self.held[lane]

    def reusable_prefix(self, lane: int, prompt: list[int]) -> int:
        return 0

    def prefill_chunks(self, lane: int, prompt: list[int], reuse: bool = False, images=None, checkpoint_at=None,
                       riders=None):
        self.held[lane] = len(prompt)
        yield self._logits(1)[0]

    def decode_step(self, lanes: list[int], tokens: list[int] | None, device_tokens=None):
        for lane in lanes:
            self.held[lane] += 1
        return self._logits(len(lanes))


def _gpu_profile_step(timing: dict, rows: int) -> None:
    """Start the torch profiler after decode step state["first"] of the run, stop it after state["last"], and print
    where those steps' GPU time went (every kernel and copy on the timeline, the server's sampling and copies
    between steps included)."""
    import torch

    state, done = timing["gpu_profile"], timing["steps"]
    if done == state["first"] and "prof" not in state:
        state["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        state["prof"].start()
    elif done == state["last"] and "prof" in state and "printed" not in state:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        state["prof"].stop()
        state["printed"] = True
        from bench.step_timeline import kernel_spans, window_summary

        trace = Path(tempfile.mkdtemp()) / "server-trace.json"
        state["prof"].export_chrome_trace(str(trace))
        spans = kernel_spans(json.loads(trace.read_text()))
        if not spans:
            print("  GPU profile: no kernels recorded", file=sys.stderr)
            return
        w = window_summary(spans, state["last"] - state["first"])
        print(f"  GPU profile of {state['last'] - state['first']} decode steps of {rows} rows in the server: "
              f"{w['period_us']:.1f} µs a step, busy {w['busy_us']:.1f}, {w['spans_per_step']:.0f} kernels and copies "
              "a step; by class (µs a step): " + ", ".join(f"{k} {v:.0f}" for k, v in w["classes"].items()),
              file=sys.stderr)
        for k in w["kernels"][:12]:
            print(f"  {k['us_per_step']:9.1f} µs a step  {k['calls_per_step']:5.1f} calls  {k['name'][:90]}",
                  file=sys.stderr)


def _spread(run: dict) -> str:
    """' (median M, slowest S)' of a run's GPU step times, where it has them."""
    if run["engine_ms_median"] is None:
        return ""
    return f" (median {run['engine_ms_median']:.2f}, slowest {run['engine_ms_slowest']:.2f})"


def _ready(_: int) -> bool:
    global _client
    import httpx

    _client = _client or httpx.Client(timeout=600)
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="?", default="qwen3.6-27b")
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--kv-dtype", default="bf16")
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--chain", default="on", help="chained decode steps: on, off, or both (side by side, one server)")
    ap.add_argument("--paced-step-ms", type=float, help="a stand-in engine whose step takes this long (no GPU)")
    ap.add_argument("--gpu-profile", action="store_true",
                    help="after the timed runs, one more several-client run with the GPU's kernels recorded over 16 of "
                         "its decode steps (torch profiler): per kernel time a step and the steps' busy time")
    ap.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                    help="skip the engine's start-up capture of every decode batch size's and prompt piece's CUDA graph "
                         "(serve --no-warm-up): graphs are then captured on first use, maybe inside a timed run")
    ap.add_argument("--profile-host", action="store_true",
                    help="profile the host's side of every decode-step call (cProfile) in the timed runs; print the top")
    args = ap.parse_args()

    import uvicorn

    from format.shapes import write_shape_artifact
    from format.tiny import CHAT_TEMPLATE, build_tokenizer
    from runtime.engine import Engine
    from runtime.memory_plan import PlanOptions
    from runtime.serve.app import Server, ServerConfig, build_app
    from runtime.serve.chat_template import ChatTemplate
    from runtime.serve.launch import warm_up_engine
    from runtime.serve.scheduler import Scheduler

    tok = build_tokenizer(384)  # random weights: the text is noise, only token counts matter
    if args.paced_step_ms:
        engine = PacedEngine(args.lanes, tok.get_vocab_size(), args.paced_step_ms / 1000,
                             list(tok.get_added_tokens_decoder()))
        args.shape = f"paced {args.paced_step_ms} ms"
    else:
        art = write_shape_artifact(args.shape, Path(tempfile.mkdtemp()) / f"{args.shape}.nfer", "q4", mtp=False)
        engine = Engine(art, PlanOptions(max_context=8192, max_concurrency=args.lanes, kv_dtype=args.kv_dtype),
                        random_weights_seed=0)
        if args.warm_up:  # as `ninfer serve` does before it listens
            print(f"  start-up warm-up{warm_up_engine(engine) or ': none'}", file=sys.stderr)
    scheduler = Scheduler(engine, max_pending=16)
    server = Server(engine, tok, ChatTemplate(CHAT_TEMPLATE), ServerConfig("bench", 8192), {tok.token_to_id("<|im_end|>")},
                    scheduler)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(build_app(server), host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=srv.run, daemon=True).start()
    while not srv.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    prompts = [f"request number {i}: tell me something long" for i in range(args.lanes)]

    # the engine's share of the wall time: each decode step's GPU time from CUDA events around it (a sync
    # here would undo the scheduler's chaining of steps), against the steps' count over the whole run
    timing = {"steps": 0, "rows": 0, "engine_s": 0.0, "host_s": 0.0, "events": [], "profile": None,
              "gpu_profile": None}
    engine_step = engine.decode_step

    def timed_step(lanes, tokens, **kw):
        import torch

        cuda = engine.device.type == "cuda"
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t = time.perf_counter()
        if timing["profile"] is not None:
            timing["profile"].enable()
        logits = engine_step(lanes, tokens, **kw)
        if timing["profile"] is not None:
            timing["profile"].disable()
        host = time.perf_counter() - t
        timing["host_s"] += host  # the host's own time in the call (a GPU step is only queued there)
        if cuda:
            end.record()
            timing["events"].append((start, end))
        else:
            timing["engine_s"] += host
        timing["steps"] += 1
        timing["rows"] += len(lanes)
        if timing["gpu_profile"] is not None:
            try:
                _gpu_profile_step(timing, len(lanes))
            except Exception as exc:  # noqa: BLE001 - the profile is extra: the run goes on without it
                print(f"  GPU profile failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                timing["gpu_profile"] = None
        return logits

    engine.decode_step = timed_step
    if args.gpu_profile and engine.device.type == "cuda":
        # the profiler's first start initializes its tracer on the calling thread; the scheduler's thread starts it
        # later, so start it once here first
        import torch

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
            torch.zeros(1, device=engine.device).add_(1)
    clients = concurrent.futures.ProcessPoolExecutor(args.lanes, mp_context=multiprocessing.get_context("spawn"))
    list(clients.map(_ready, range(args.lanes)))  # every client process started and importing httpx

    def together(n: int, warm_up: bool = False, gpu_profile: bool = False) -> dict:
        first = max(4, min(64, args.tokens // 2 - 8))  # the profiled steps: steady state, every lane decoding
        timing.update(steps=0, rows=0, engine_s=0.0, host_s=0.0, events=[],
                      profile=cProfile.Profile() if args.profile_host and not warm_up else None,
                      gpu_profile={"first": first, "last": first + 16} if gpu_profile else None)
        graphs_before = len(getattr(engine, "_graphs", {}))  # (the keys below name each graph captured since)
        t0 = time.perf_counter()
        runs = list(clients.map(_stream, [url] * n, prompts[:n], [args.tokens] * n))
        wall = time.perf_counter() - t0
        # CUDA graphs captured during this run (a warm run captures none: a capture inside a timed step would
        # count its eager warm-up, and any kernel it compiles, as that step's time)
        captured = sorted(str(k) for k in list(getattr(engine, "_graphs", {}))[graphs_before:])
        step_ms = []
        for start, end in timing["events"]:
            end.synchronize()
            step_ms.append(start.elapsed_time(end))
        timing["engine_s"] += sum(step_ms) / 1000
        if timing["profile"] is not None:  # where the host's time inside the step calls went
            text = io.StringIO()
            pstats.Stats(timing["profile"], stream=text).sort_stats("tottime").print_stats(12)
            print(f"  host profile of the step calls, {n} client(s):\n" + "\n".join(
                line for line in text.getvalue().splitlines() if line.strip())[-1400:], file=sys.stderr)
        total = sum(r["tokens"] for r in runs)
        steps = max(1, timing["steps"])
        return {"clients": n, "tokens": total, "wall_s": wall, "aggregate_tok_s": total / wall, "texts": [r["text"] for r in runs],
                "per_client_tok_s": [r["tokens"] / r["seconds"] for r in runs], "ttft_s": [r["ttft_s"] for r in runs],
                "decode_steps": timing["steps"], "rows_per_step": timing["rows"] / steps,
                "engine_ms_per_step": 1000 * timing["engine_s"] / steps,
                "host_ms_in_step_call": 1000 * timing["host_s"] / steps,
                "wall_ms_per_step": 1000 * wall / steps, "graphs_captured": captured,
                # a mean over steps hides one slow step (a capture and its compiles): the median and the slowest
                "engine_ms_median": sorted(step_ms)[len(step_ms) // 2] if step_ms else None,
                "engine_ms_slowest": max(step_ms) if step_ms else None}

    for n in sorted({1, args.lanes}):  # warm-up: compile kernels, capture each batch size's graph
        warm = together(n, warm_up=True)
        print(f"  warm-up, {n} client(s): {warm['wall_s']:.2f} s, first text {max(warm['ttft_s']) * 1000:.0f} ms "
              f"(slowest; includes compiles and graph captures: {len(warm['graphs_captured'])} graphs)", file=sys.stderr)
    modes = ["off", "on"] if args.chain == "both" else [args.chain]
    results = []
    for mode in modes:
        scheduler.chain = mode == "on"
        one, many = together(1), together(args.lanes)
        result = {"shape": args.shape, "lanes": args.lanes, "kv_dtype": args.kv_dtype, "tokens_per_client": args.tokens,
                  "chain": mode, "one": one, "many": many, "speedup": many["aggregate_tok_s"] / one["aggregate_tok_s"]}
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k not in ("one", "many")}))
        print(f"serve {args.shape}, chained decode {mode}: 1 client {one['aggregate_tok_s']:.1f} tok/s; {args.lanes} "
              f"concurrent clients {many['aggregate_tok_s']:.1f} tok/s aggregate = {result['speedup']:.2f}x")
        for run in (one, many):
            print(f"  {run['clients']} client(s): {run['decode_steps']} decode steps of {run['rows_per_step']:.2f} rows, "
                  f"engine {run['engine_ms_per_step']:.2f} ms a step{_spread(run)} (host "
                  f"{run['host_ms_in_step_call']:.2f} ms in the call), wall {run['wall_ms_per_step']:.2f} ms a step, "
                  f"first text {max(run['ttft_s']) * 1000:.0f} ms (slowest); graphs captured in the run: "
                  f"{', '.join(run['graphs_captured']) or 'none'}")
    if args.gpu_profile and not args.paced_step_ms:  # a run of its own: the profiler slows the steps it watches
        together(args.lanes, gpu_profile=True)
    if not args.paced_step_ms and engine.device.type == "cuda":
        # the same engine's steps with no server around them (chained, as the bench times them): a step that is fast
        # here and slow above is the server's doing, not the kernels'
        import torch

        for n in sorted({1, args.lanes}):
            lanes, tokens = list(range(n)), torch.ones(n, dtype=torch.long, device=engine.device)
            for _ in range(3):
                tokens = engine_step(lanes, None, device_tokens=tokens).argmax(-1)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(32):
                tokens = engine_step(lanes, None, device_tokens=tokens).argmax(-1)
            end.record()
            end.synchronize()
            print(f"  the engine alone, {n} lane(s): {start.elapsed_time(end) / 32:.2f} ms a chained step")
    if len(results) == 2 and not args.paced_step_ms:  # greedy: the same answers either way (the stand-in's
        # logits are draws in call order, which chaining changes)
        same = all(a[k]["texts"] == b[k]["texts"] for a, b in [results] for k in ("one", "many"))
        print(f"  answers with chained decode on and off: {'identical' if same else 'DIFFERENT'}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results if len(results) > 1 else results[0], indent=1))
    clients.shutdown()
    srv.should_exit = True
    scheduler.close()


if __name__ == "__main__":
    main()
