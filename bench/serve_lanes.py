"""`ninfer serve`'s aggregate speed with several lanes: the real server (app + lane scheduler + engine)
over a full-size random-weights shape on the GPU, driven by N concurrent streaming clients on
loopback, against one client alone. Tokens are counted from each response's usage.

    PYTHONPATH=. python bench/serve_lanes.py [qwen3.6-27b] [--lanes 4] [--tokens 256] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import socket
import tempfile
import threading
import time
from pathlib import Path


def _stream(url: str, prompt: str, tokens: int) -> dict:
    """One streaming chat completion; returns its token count and the seconds from request to last byte."""
    import httpx

    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, usage = None, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            first = first or time.perf_counter()
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    return {"tokens": usage["completion_tokens"], "seconds": end - t0, "ttft_s": (first or end) - t0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shape", nargs="?", default="qwen3.6-27b")
    ap.add_argument("--lanes", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--kv-dtype", default="bf16")
    ap.add_argument("--json", dest="json_out")
    args = ap.parse_args()

    import uvicorn

    from format.shapes import write_shape_artifact
    from format.tiny import CHAT_TEMPLATE, build_tokenizer
    from runtime.engine import Engine
    from runtime.memory_plan import PlanOptions
    from runtime.serve.app import Server, ServerConfig, build_app
    from runtime.serve.chat_template import ChatTemplate
    from runtime.serve.scheduler import Scheduler

    art = write_shape_artifact(args.shape, Path(tempfile.mkdtemp()) / f"{args.shape}.nfer", "q4", mtp=False)
    engine = Engine(art, PlanOptions(max_context=8192, max_concurrency=args.lanes, kv_dtype=args.kv_dtype),
                    random_weights_seed=0)
    tok = build_tokenizer(384)  # random weights: the text is noise, only token counts matter
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

    def together(n: int) -> dict:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            t0 = time.perf_counter()
            runs = list(pool.map(lambda p: _stream(url, p, args.tokens), prompts[:n]))
            wall = time.perf_counter() - t0
        total = sum(r["tokens"] for r in runs)
        return {"clients": n, "tokens": total, "wall_s": wall, "aggregate_tok_s": total / wall,
                "per_client_tok_s": [r["tokens"] / r["seconds"] for r in runs], "ttft_s": [r["ttft_s"] for r in runs]}

    for n in sorted({1, args.lanes}):  # warm-up: compile kernels, capture each batch size's graph
        together(n)
    one, many = together(1), together(args.lanes)
    result = {"shape": args.shape, "lanes": args.lanes, "kv_dtype": args.kv_dtype, "tokens_per_client": args.tokens,
              "one": one, "many": many, "speedup": many["aggregate_tok_s"] / one["aggregate_tok_s"]}
    print(json.dumps(result))
    print(f"serve {args.shape}: 1 client {one['aggregate_tok_s']:.1f} tok/s; {args.lanes} concurrent clients "
          f"{many['aggregate_tok_s']:.1f} tok/s aggregate = {result['speedup']:.2f}x")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    srv.should_exit = True
    scheduler.close()


if __name__ == "__main__":
    main()
