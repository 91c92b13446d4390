"""Builds the whole server (engine, tokenizer, template, scheduler, app) from an artifact."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from format.container import open_artifact

from ..engine import Engine
from ..generate import load_chat_template, load_tokenizer, stop_token_ids
from ..memory_plan import MemoryPlanError, PlanOptions
from .app import Server, ServerConfig, build_app
from .scheduler import Scheduler


def warm_up_engine(engine: Engine) -> str:
    """Engine.warm_up before serving, as `ninfer serve` runs it: every CUDA graph serving can meet captured now
    (mid-serving, each would stop every lane: seconds for the first of a shape on a full-size model, which compiles
    its kernels). Returns ", N CUDA graphs captured in S s" for the start-up summary ("" without graphs); a warm-up
    that stops is named in one line and serving goes on, the graphs left captured on first use."""
    if not engine.use_graphs:
        return ""
    print("ninfer: warming up: capturing the CUDA graphs serving meets (--no-warm-up skips)", file=sys.stderr)
    started = time.perf_counter()
    try:
        return f", {engine.warm_up()} CUDA graphs captured in {time.perf_counter() - started:.1f} s"
    except Exception as exc:  # noqa: BLE001 - serving goes on: the graphs left are captured on first use
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        print(f"ninfer: the warm-up stopped ({type(exc).__name__}: {first}); the graphs it did not capture are "
              "captured on first use", file=sys.stderr)
        return ""


def build_server(path, options: PlanOptions, device: str = "cuda", model_id: str | None = None, api_key: str | None = None,
                 cors: bool = False, preserve_thinking: bool = False, max_pending: int = 64, pending_timeout_ms: int = 0,
                 request_log: str | None = None, allow_local_images: str | None = None, allow_remote_images: bool = False,
                 max_request_bytes: int = 8 << 20, on_fatal=None, reasoning_budget: int | None = None,
                 model_aliases: tuple[str, ...] = (), accept_any_model: bool = False, warm_up: bool = True):
    with open_artifact(path) as art:
        template = load_chat_template(art)
        if template is None:
            raise MemoryPlanError("the artifact carries no chat template, which the chat APIs need; re-convert it")
        tokenizer = load_tokenizer(art)
        stop = stop_token_ids(art, tokenizer)
    engine = Engine(path, options, device=device)
    warmed = warm_up_engine(engine) if warm_up else ""
    scheduler = Scheduler(engine, max_pending=max_pending, pending_timeout_ms=pending_timeout_ms, on_fatal=on_fatal)
    config = ServerConfig(model_id=model_id or Path(path).stem, max_context=options.max_context, api_key=api_key,
                          preserve_thinking=preserve_thinking, request_log=request_log, vision=options.vision,
                          allow_local_images=allow_local_images, allow_remote_images=allow_remote_images,
                          max_request_bytes=max_request_bytes, pending_timeout_ms=pending_timeout_ms,
                          reasoning_budget=reasoning_budget, model_aliases=tuple(model_aliases),
                          accept_any_model=accept_any_model)
    server = Server(engine, tokenizer, template, config, stop, scheduler)
    if warm_up:
        server.grammars.prepare()  # (~1 s at 248K tokens, else paid by the first request with a schema)
    plan = engine.plan
    summary = (f"serving {config.model_id}: {options.max_concurrency} lane(s) x {options.max_context} tokens, "
               f"KV {options.kv_dtype}, prefill chunk {engine.opts.prefill_chunk} ({engine.shared_chunk} beside decoding lanes), {plan.total_bytes / 2**30:.2f} GiB planned"
               + (f", {options.spec.upper()} with {options.draft_tokens} draft tokens" if options.spec != "none" else "")
               + (", vision on" if options.vision else "")
               + (f", {engine.fragment_order_products} products in fragment order" if engine.fragment_order_products
                  else "") + warmed)
    return build_app(server, cors=cors), summary
