"""HTTP server: OpenAI Chat Completions + Responses, Anthropic Messages, health, models, metrics.

Every generation goes through the lane scheduler; request bodies are validated at the edge so each API
answers malformed input in its own error shape (unexpected failures too: a JSON 500, never plain text),
prompts are rendered and tokenized off the event loop, and nothing a client sends can stop the server.
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..kernels.sampling import SamplingParams
from .chat_template import (
    CUSTOM_INPUT,
    ChatTemplate,
    ImageSink,
    RequestError,
    normalize_anthropic_messages,
    normalize_anthropic_tools,
    normalize_openai_messages,
    normalize_openai_tools,
    normalize_responses_input,
    responses_tools,
    system_first,
)
from .metrics import ServerMetrics
from .output_parser import OutputParser
from .scheduler import SEED_MASK, GenerationRequest, QueueFull, Scheduler, SchedulerDead
from .structured import AnswerGrammar, GrammarCompiler, StructuredOutputError
from .schemas import (answer_schema, ChatRequest, CountTokensRequest, MessagesRequest, ResponsesRequest, ValidationError,
                      first_error)


@dataclass
class ServerConfig:
    model_id: str
    max_context: int
    api_key: str | None = None
    preserve_thinking: bool = False
    vision: bool = False
    allow_local_images: str | None = None  # the directory local image paths must lie under
    allow_remote_images: bool = False
    max_request_bytes: int = 8 << 20  # larger bodies: 413
    reasoning_budget: int | None = None  # default thinking budget in tokens (None: unlimited)
    model_aliases: tuple[str, ...] = ()  # other names clients may ask for (--served-model-name)
    accept_any_model: bool = False  # any model name is this model (--accept-any-model)
    pending_timeout_ms: int = 0  # queue wait before 503 (0 = forever)
    default_max_tokens: int = 4096
    request_log: str | None = None  # JSON lines: one record per finished generation
    stats: dict = field(default_factory=lambda: {"requests": 0, "errors": 0})


STORED_RESPONSES = 512  # finished Responses kept for previous_response_id / GET (memory only)
HEARTBEAT_S = 10.0  # streams send a keep-alive after this long without tokens
PING = SimpleNamespace(kind="ping")

# reasoning effort (OpenAI reasoning_effort, Responses reasoning.effort) -> thinking budget in tokens;
# "none" (and Responses' "minimal") switch thinking off
EFFORT_BUDGETS = {"minimal": 512, "low": 1024, "medium": 4096, "high": 16384}


class TokenizedPrompt(list):
    """Token ids (image placeholders already expanded), the images those placeholders stand for, and
    the turn checkpoint: where the final assistant header starts. Everything before it renders the
    same in the next turn, while the header and the reply may not (reasoning is dropped from history)."""

    images: list = []
    checkpoint_at: int | None = None


class ApiError(Exception):
    def __init__(self, status: int, kind: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.message, self.param = status, kind, message, param


RETRY_AFTER_S = "1"  # what 429 / 529 / 503 tell a client to wait before retrying


def _headers(e: ApiError) -> dict | None:
    return {"Retry-After": RETRY_AFTER_S} if e.status in (429, 503, 529) else None


# OpenAI's documented error types by status; the specific kind (context_length_exceeded, vision_disabled,
# request_too_large, ...) goes in `code`
_OPENAI_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
                503: "server_error"}


def _openai_error(e: ApiError) -> JSONResponse:
    kind = _OPENAI_TYPE.get(e.status, "server_error")
    return JSONResponse({"error": {"message": e.message, "type": kind, "param": e.param, "code": e.kind}}, e.status,
                        headers=_headers(e))


# Anthropic's documented error types by status
_ANTHROPIC_KIND = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                   503: "overloaded_error", 529: "overloaded_error"}


def _anthropic_error(e: ApiError) -> JSONResponse:
    kind = _ANTHROPIC_KIND.get(e.status, "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": e.message}}, e.status, headers=_headers(e))


def openai_tool_choice(value) -> tuple[str, str | None]:
    """OpenAI tool_choice (chat: {"type": "function", "function": {"name"}}; Responses: {"type":
    "function", "name"}) -> (auto | none | required | named, name)."""
    if value is None or value == "auto":
        return "auto", None
    if value in ("none", "required"):
        return value, None
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function") if isinstance(value.get("function"), dict) else value
        if isinstance(fn.get("name"), str):
            return "named", fn["name"]
    raise ApiError(400, "invalid_request_error", "tool_choice must be 'auto', 'none', 'required' or "
                   "{'type': 'function', 'function': {'name': ...}}", "tool_choice")


def anthropic_tool_choice(value) -> tuple[tuple[str, str | None], bool]:
    """Anthropic tool_choice -> ((auto | none | required | named, name), parallel calls allowed)."""
    if value is None:
        return ("auto", None), True
    parallel = not value.get("disable_parallel_tool_use", False)
    kind = value.get("type")
    if kind in ("auto", "none"):
        return (kind, None), parallel
    if kind == "any":
        return ("required", None), parallel
    if kind == "tool" and isinstance(value.get("name"), str):
        return ("named", value["name"]), parallel
    raise ApiError(400, "invalid_request_error", "tool_choice.type must be auto, any, tool (with a name) or none",
                   "tool_choice")


def parse(model, body: dict):
    """The body checked against the API's typed request model (schemas.py): a 400 naming the field."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        param, message = first_error(exc)
        raise ApiError(400, "invalid_request_error", message, param) from None


def drop_oldest_turns(conversation: list[dict], tokenize) -> tuple[list[dict], list[int]]:
    """Responses `truncation: "auto"`: the conversation and its prompt as they are if they fit, else with the
    fewest oldest turns left out that makes them fit — whole turns (a user message up to the next), so no tool
    result loses its call, and the system message always kept. The newest turn alone too long: the usual 400."""
    try:
        return conversation, tokenize(conversation)
    except ApiError as exc:
        if exc.kind != "context_length_exceeded":
            raise
        too_long = exc
    system = conversation[:1] if conversation and conversation[0]["role"] == "system" else []
    rest = conversation[len(system):]
    starts = [i for i, m in enumerate(rest) if m["role"] == "user" and i > 0]  # where a later turn begins
    lo, hi, best = 0, len(starts) - 1, None
    while lo <= hi:  # the fewest dropped turns that fit (fitting only gets easier with more dropped)
        mid = (lo + hi) // 2
        kept = system + rest[starts[mid]:]
        try:
            best = kept, tokenize(kept)
            hi = mid - 1
        except ApiError as exc:
            if exc.kind != "context_length_exceeded":
                raise
            lo = mid + 1
    if best is None:
        raise too_long
    return best


class Generation:
    """One request's tokens, decoded incrementally and parsed into reasoning / content / tool calls."""

    def __init__(self, server: "Server", prompt: list[int], max_tokens: int, params, stop: list[str], tools, thinking: bool,
                 seed: int | None, budget: int | None = None, api: str = "chat", controls: dict | None = None,
                 logprobs: int | None = None, grammar=None):
        self.server = server
        self.thinking = thinking
        self.api = api
        self.admitted_at = self.first_at = self.last_at = None  # monotonic seconds
        self.outcome = None
        self.queue: asyncio.Queue = asyncio.Queue()
        self.admitted = asyncio.Event()  # set once a lane holds the request (or it ended before that)
        loop = asyncio.get_running_loop()

        self.expired_in_queue = False  # the worker's own expiry can beat the wait_for below under load

        def put(item):
            if item[0] == "done" and item[1] == "timeout":
                self.expired_in_queue = True  # set before admitted, which the loop sees only after this
            if not loop.is_closed():
                loop.call_soon_threadsafe(self.queue.put_nowait, item)
                if not self.admitted.is_set():  # it ended (or produced) before admission was seen
                    loop.call_soon_threadsafe(self.admitted.set)

        def admit():
            self.admitted_at = time.monotonic()
            if not loop.is_closed():
                loop.call_soon_threadsafe(self.admitted.set)

        self.request = GenerationRequest(prompt, max_tokens, on_token=lambda t: put(("token", t)),
                                         on_done=lambda r, e: put(("done", r, e)), params=params,
                                         stop_ids=frozenset(server.stop_ids), seed=seed,
                                         images=getattr(prompt, "images", None) or None,
                                         checkpoint_at=getattr(prompt, "checkpoint_at", None), on_admit=admit,
                                         thinking_budget=budget if thinking else None, think_end=server.think_end,
                                         thinks=thinking, logprobs=logprobs, grammar=grammar, **(controls or {}))
        self.logprobs_sent = 0  # tokens whose logprobs a stream has already carried
        self.parser = OutputParser(tools=tools, thinking=thinking, stop=stop)
        self.ids: list[int] = []
        self.text = ""
        # ids[window_start:shown] were decoded into the tail of self.text; the next token's text is found by
        # decoding from window_start only (the whole answer per token is quadratic: ms per token at 8K tokens)
        self.window_start = self.shown = 0
        self.prompt_tokens = len(prompt)
        self.finish_reason = None
        try:
            server.scheduler.submit(self.request)
        except QueueFull as exc:
            raise ApiError(429, "rate_limit_error", f"server overloaded: {exc}; retry later") from None
        except SchedulerDead as exc:
            raise ApiError(503, "overloaded_error", str(exc)) from None

    async def admission(self, request: Request | None = None) -> None:
        """Wait until a lane holds the request; past --pending-timeout-ms with every lane busy it leaves
        the queue and the client gets a 503 (before a stream sends anything). A client that disconnects
        while it waits gives its place up within a scheduler step."""
        timeout = self.server.config.pending_timeout_ms / 1000 or None
        watcher = asyncio.create_task(self._watch(request)) if request is not None else None
        expired = ApiError(503, "overloaded_error", f"request timed out in the queue: no lane became free within "
                           f"{(timeout or 0) * 1000:.0f} ms (--pending-timeout-ms); retry later")
        try:
            await asyncio.wait_for(self.admitted.wait(), timeout)
        except asyncio.TimeoutError:
            if self.server.scheduler.expire(self.request):
                raise expired from None
            await self.admitted.wait()  # a lane is free: the worker admits it now
        except asyncio.CancelledError:
            self.server.scheduler.cancel(self.request)
            raise
        finally:
            if watcher is not None:
                watcher.cancel()
        if self.expired_in_queue and self.admitted_at is None:
            raise expired  # the worker expired it first: still a 503 before any stream bytes

    async def _watch(self, request: Request) -> None:
        """Cancel the generation as soon as its client is gone (polled: ASGI reports it only when asked)."""
        while True:
            await asyncio.sleep(0.1)
            if await request.is_disconnected():
                self.server.scheduler.cancel(self.request)
                return

    async def collect(self, request: Request) -> None:
        """Run a non-streaming generation to its end; a client that disconnects frees its lane (or its
        place in the queue) within a fraction of a second."""
        watcher = asyncio.create_task(self._watch(request))
        try:
            await self.admission()
            async for _ in self.events():
                pass
        finally:
            watcher.cancel()

    def _new_text(self) -> str | None:
        """The text the ids since the last call add to self.text (appended), or None while they end inside a
        UTF-8 sequence. Decodes the last shown token(s) and the new ones, not the whole answer; where that
        window decodes differently from its part already shown, the whole answer is decoded instead."""
        decode = self.server.tokenizer.decode  # markers like <tool_call> and </think> may be special: kept
        text = decode(self.ids[self.window_start:], skip_special_tokens=False)
        if text.endswith("\ufffd"):
            return None
        shown = decode(self.ids[self.window_start:self.shown], skip_special_tokens=False)
        if text.startswith(shown):
            delta = text[len(shown):]
        else:
            delta = decode(self.ids, skip_special_tokens=False)[len(self.text):]
        self.text += delta
        self.window_start, self.shown = self.shown, len(self.ids)
        return delta

    async def events(self, heartbeat: float | None = None):
        """Yields parser events; sets finish_reason ('stop', 'length', 'tool_calls', ...) at the end.
        With `heartbeat` (seconds), a PING event whenever nothing came for that long (a long prefill):
        streaming clients that give up on a silent connection see it is alive."""
        try:
            while True:
                try:
                    item = await asyncio.wait_for(self.queue.get(), heartbeat)
                except asyncio.TimeoutError:
                    yield PING
                    continue
                if item[0] == "token":
                    now = time.monotonic()
                    if self.last_at is not None:
                        self.server.metrics.inter_token.labels(self.api).observe(now - self.last_at)
                    self.first_at = self.first_at or now
                    self.last_at = now
                    self.ids.append(item[1])
                    delta = self._new_text()
                    if delta is None:
                        continue  # an incomplete UTF-8 sequence: wait for the next token
                    for ev in self.parser.feed(delta):
                        yield ev
                    if self.parser.result.stopped_by is not None:
                        self.server.scheduler.cancel(self.request)
                        self.finish_reason = "stop"
                        break
                    continue
                _, reason, error = item
                if reason == "error":
                    self.outcome = "error"
                    raise ApiError(500, "server_error", error or "generation failed")
                if reason == "timeout":
                    self.outcome = "timeout"
                if reason == "cancelled":
                    self.finish_reason = "cancelled"
                    break
                if reason == "timeout":
                    raise ApiError(503, "overloaded_error", f"request timed out in the queue: {error}")
                self.finish_reason = reason
                break
            text = self.server.tokenizer.decode(self.ids, skip_special_tokens=False)
            if text != self.text and self.parser.result.stopped_by is None:
                # the answer ended inside a UTF-8 sequence (a length stop): say it as decoded (U+FFFD), so the
                # text, the streamed deltas and the logprobs all carry its last token
                delta, self.text = text[len(self.text):], text
                for ev in self.parser.feed(delta):
                    yield ev
            for ev in self.parser.finish():
                yield ev
            if self.parser.result.tool_calls and self.finish_reason == "stop":
                self.finish_reason = "tool_calls"
        finally:
            if self.finish_reason is None:  # the client went away: free the lane
                self.server.scheduler.cancel(self.request)
            self._observe()
            self._log()

    def _observe(self) -> None:
        m, api, t0 = self.server.metrics, self.api, self.request.enqueued_at
        m.outcomes.labels(api, self.outcome or self.finish_reason or "disconnected").inc()
        if self.admitted_at is not None:
            m.queue_wait.labels(api).observe(self.admitted_at - t0)
        if self.first_at is not None:
            m.ttft.labels(api).observe(self.first_at - t0)
            m.e2e.labels(api).observe(self.last_at - t0)

    def answer(self, body: dict) -> JSONResponse:
        """A non-streaming reply with the request's timings also in the X-Ninfer-Timings header (any API)."""
        timings = body.get("timings") or self.timings()  # chat replies carry them already
        return JSONResponse(body, headers={"X-Ninfer-Timings": json.dumps(timings, separators=(",", ":"))})

    def timings(self) -> dict:
        """llama.cpp-style per-request timings: the prompt (prefill, from admission to the first token)
        and the generated tokens after it."""
        cached = self.request.cached_tokens
        start = self.admitted_at or self.request.enqueued_at
        first, last = self.first_at or start, self.last_at or start
        prompt_ms, predicted_ms = (first - start) * 1e3, (last - first) * 1e3
        computed, after_first = self.prompt_tokens - cached, max(0, self.completion_tokens - 1)
        return {"cache_n": cached, "prompt_n": computed, "prompt_ms": round(prompt_ms, 3),
                "prompt_per_second": round(computed / prompt_ms * 1e3, 2) if prompt_ms > 0 else None,
                "predicted_n": self.completion_tokens, "predicted_ms": round(predicted_ms, 3),
                "predicted_per_second": round(after_first / predicted_ms * 1e3, 2) if predicted_ms > 0 else None,
                "queue_ms": round((start - self.request.enqueued_at) * 1e3, 3),
                "draft_n": self.request.drafted, "draft_n_accepted": self.request.accepted}

    def _log(self) -> None:
        path = self.server.config.request_log
        if not path:
            return
        record = {"time": time.time(), "seconds": round(time.monotonic() - self.request.enqueued_at, 4),
                  "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                  "finish_reason": self.finish_reason or "cancelled", "tool_calls": len(self.parser.result.tool_calls)}
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    @property
    def completion_tokens(self) -> int:
        return len(self.ids)

    def logprob_entries(self, start: int = 0) -> list[dict]:
        """OpenAI `logprobs.content` entries of the tokens from `start` on (as far as received)."""
        tok = self.server.tokenizer
        entry = lambda i, lp: {"token": (t := tok.decode([i], skip_special_tokens=False)), "logprob": lp,  # noqa: E731
                               "bytes": list(t.encode("utf-8"))}
        out = []
        for token, (lp, top) in zip(self.ids[start:], self.request.logprob_sink[start:]):
            out.append({**entry(token, lp), "top_logprobs": [entry(i, v) for i, v in top]})
        return out

    def take_logprobs(self) -> dict | None:
        """The logprobs of the tokens a stream has not sent yet (None without logprobs)."""
        if self.request.logprobs is None:
            return None
        entries = self.logprob_entries(self.logprobs_sent)
        self.logprobs_sent += len(entries)
        return {"content": entries}

    def answer_logprobs(self) -> list[dict]:
        """Logprob entries of the answer's tokens (after the thinking block and its closing token) not yet
        taken: the Responses API's output_text logprobs."""
        first = self.reasoning_tokens + (1 if self.thinking and self.server.think_end in self.ids else 0)
        start = max(first, self.logprobs_sent)
        entries = self.logprob_entries(start)
        self.logprobs_sent = start + len(entries)
        return entries

    @property
    def reasoning_tokens(self) -> int:
        """Tokens of the thinking block (the prompt opened it): up to the end-of-thinking token."""
        if not self.thinking:
            return 0
        end = self.server.think_end
        return self.ids.index(end) if end in self.ids else len(self.ids)


def _sse(data: dict, event: str | None = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


class Server:
    def __init__(self, engine, tokenizer, template: ChatTemplate, config: ServerConfig, stop_ids, scheduler: Scheduler):
        self.engine, self.tokenizer, self.template, self.config = engine, tokenizer, template, config
        self.stop_ids, self.scheduler = set(stop_ids), scheduler
        self.think_end = tokenizer.token_to_id("</think>")  # None: the model has no thinking block
        vocab = engine.cfg.vocab_size if engine is not None else tokenizer.get_vocab_size()  # None: a scripted test server
        self.grammars = GrammarCompiler(tokenizer, vocab, sorted(self.stop_ids))
        self.metrics = ServerMetrics(self)
        self.stored: collections.OrderedDict[str, tuple[dict, list[dict]]] = collections.OrderedDict()

    # --- shared helpers -------------------------------------------------------------------

    def image_sink(self):
        """What normalization collects images into: an ImageSink with --vision, else False."""
        cfg = self.config
        return ImageSink(cfg.allow_local_images, cfg.allow_remote_images) if cfg.vision else False

    def tokenize(self, messages, tools, thinking: bool, sink=None, preserve_thinking: bool | None = None) -> list[int]:
        """`preserve_thinking`: keep earlier turns' reasoning (None: the server's --preserve-thinking)."""
        keep = self.config.preserve_thinking if preserve_thinking is None else preserve_thinking
        prompt = self.template.render(messages, tools, enable_thinking=thinking, preserve_thinking=keep)
        # encode_batch releases the GIL (encode holds it for seconds on a multi-megabyte prompt, which
        # would stall the event loop even from a worker thread)
        ids = TokenizedPrompt(self.tokenizer.encode_batch([prompt], add_special_tokens=False)[0].ids)
        if sink and sink.images:
            from ..vision import expand_image_tokens, preprocess

            tower = self.engine.vision
            images = []
            for n, data in enumerate(sink.images):
                try:
                    images.append(preprocess(data, tower.cfg))
                except ValueError as exc:
                    raise ApiError(400, "invalid_request_error", f"image {n + 1}: {exc}") from None
            try:
                ids = TokenizedPrompt(expand_image_tokens(ids, images, tower.ids.image))
            except ValueError as exc:
                raise ApiError(400, "invalid_request_error", f"{exc}; do not type image placeholder tokens") from None
            ids.images = images
        turn_start = self.tokenizer.token_to_id("<|im_start|>")
        if turn_start is not None and turn_start in ids:
            ids.checkpoint_at = len(ids) - 1 - ids[::-1].index(turn_start)
        if len(ids) >= self.config.max_context:
            # the wording agents parse to compact their history ("prompt is too long: N tokens > M maximum")
            raise ApiError(400, "context_length_exceeded",
                           f"prompt is too long: {len(ids)} tokens > {self.config.max_context - 1} maximum "
                           f"(--max-context {self.config.max_context}); shorten the conversation or restart the "
                           "server with a larger --max-context")
        return ids

    def max_tokens(self, value, prompt_len: int) -> int:
        room = self.config.max_context - prompt_len
        if value is None:
            return min(self.config.default_max_tokens, room)
        if type(value) is not int or value < 1:
            raise ApiError(400, "invalid_request_error", "max_tokens must be a positive integer", "max_tokens")
        return min(value, room)

    @staticmethod
    def sampling(body: dict) -> tuple[SamplingParams | None, int | None]:
        def num(key, default, lo, hi):
            v = body.get(key, default)
            if v is None:
                return default
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ApiError(400, "invalid_request_error", f"{key} must be a number", key)
            if isinstance(v, float) and not math.isfinite(v):
                raise ApiError(400, "invalid_request_error", f"{key} must be a finite number", key)
            if not lo <= v <= hi:
                raise ApiError(400, "invalid_request_error", f"{key} must be in [{lo}, {hi}]", key)
            return v

        temperature = num("temperature", 1.0, 0, 2)
        top_k = body.get("top_k")
        if top_k is not None and (type(top_k) is not int or not 0 <= top_k < 1 << 31):
            raise ApiError(400, "invalid_request_error", "top_k must be an integer in [0, 2^31)", "top_k")
        params = SamplingParams(temperature=float(temperature), top_k=top_k or 0, top_p=float(num("top_p", 1.0, 0, 1)),
                                min_p=float(num("min_p", 0.0, 0, 1)), presence_penalty=float(num("presence_penalty", 0.0, -2, 2)),
                                frequency_penalty=float(num("frequency_penalty", 0.0, -2, 2)),
                                repetition_penalty=float(num("repetition_penalty", 1.0, 0.01, 10)))
        seed = body.get("seed")
        if seed is not None and type(seed) is not int:
            raise ApiError(400, "invalid_request_error", "seed must be an integer", "seed")
        # any integer is a seed: reduced to the generator's 64 bits (the same seed always samples the same)
        return (None if params.temperature == 0 else params), None if seed is None else seed & SEED_MASK

    # a bias per token is added to the logits row on the host every step: bounded like OpenAI's own limit
    MAX_LOGIT_BIAS = 300

    def logit_bias(self, value) -> tuple[tuple[int, float], ...]:
        """Chat's logit_bias ({"token id": bias in [-100, 100]}) as (id, bias) pairs of the vocabulary; -100
        bans a token, +100 all but forces it (after penalties, before temperature and the filters)."""
        if not value:
            return ()
        if len(value) > self.MAX_LOGIT_BIAS:
            raise ApiError(400, "invalid_request_error", f"logit_bias has {len(value)} tokens; at most "
                           f"{self.MAX_LOGIT_BIAS} are allowed", "logit_bias")
        vocab = self.engine.cfg.vocab_size
        pairs = []
        for key, bias in value.items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10) or int(key) >= vocab:
                raise ApiError(400, "invalid_request_error", f"logit_bias: {key[:40]!r} is not a token id of this "
                               f"model (integers 0..{vocab - 1})", "logit_bias")
            pairs.append((int(key), float(bias)))
        return tuple(pairs)

    @staticmethod
    def stops(value) -> list[str]:
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise ApiError(400, "invalid_request_error", "stop must be a string or a list of strings", "stop")

    def start(self, body: dict, prompt: list[int], tools, thinking: bool, limit, stop, budget: int | None = None,
              api: str = "chat", choice: tuple[str, str | None] = ("auto", None), parallel: bool = True,
              logprobs: int | None = None, grammar=None) -> Generation:
        """Validate the sampling fields, length limit and stop strings, then queue the generation.
        `budget`: the request's thinking budget (None: the server's --reasoning-budget)."""
        params, seed = self.sampling(body)
        max_tokens = self.max_tokens(limit, len(prompt))
        budget = self.config.reasoning_budget if budget is None else budget
        controls = self.tool_controls(choice, tools, parallel, thinking)
        if api == "chat":  # the only one of the three APIs with the field
            controls["logit_bias"] = self.logit_bias(body.get("logit_bias"))
        return Generation(self, prompt, max_tokens, params, self.stops(stop), tools, thinking, seed, budget, api, controls,
                          logprobs, grammar)

    def tool_controls(self, choice: tuple[str, str | None], tools, parallel: bool, thinking: bool) -> dict:
        """tool_choice and parallel_tool_calls as decode-time controls (see GenerationRequest): "none"
        bans the call marker; "required" and a named tool emit the call's opening (after the thinking
        block) so the output is a call; no parallel calls: the generation ends with the first call."""
        mode, name = choice
        names = [t["function"]["name"] for t in tools or []]
        ids = lambda text: tuple(self.tokenizer.encode(text, add_special_tokens=False).ids)  # noqa: E731
        controls = {}
        if not parallel and tools:
            controls["stop_after"] = self.tokenizer.token_to_id("</tool_call>")
            controls["call_open"] = self.tokenizer.token_to_id("<tool_call>")
        if mode == "none":
            marker = self.tokenizer.token_to_id("<tool_call>")
            controls["banned_ids"] = () if marker is None else (marker,)
        elif mode in ("required", "named"):
            if not names:
                raise ApiError(400, "invalid_request_error", "tool_choice requires a tool call but no tools were given",
                               "tool_choice")
            if mode == "named" and name not in names:
                raise ApiError(400, "invalid_request_error", f"tool_choice names {name!r}, which is not among the "
                               f"tools ({', '.join(names)})", "tool_choice")
            if mode == "required" and len(names) == 1:
                name = names[0]
            opening = "<tool_call>\n<function=" + (f"{name}>\n" if name else "")
            controls["forced"] = ids(("\n\n" if thinking else "") + opening)
        return controls

    def remember(self, response: dict, messages: list[dict] | None) -> None:
        """Keep a finished response (and the conversation it answered, with its own output as the
        assistant turn) for previous_response_id and GET /v1/responses/{id}; the oldest go first."""
        if messages is None:
            return
        text, reasoning, calls = "", None, []
        for item in response["output"]:
            if item["type"] == "message":
                text += "".join(part.get("text", "") for part in item["content"])
            elif item["type"] == "reasoning":
                reasoning = "".join(part.get("text", "") for part in item.get("content") or [])
            elif item["type"] == "function_call":
                calls.append({"id": item["call_id"], "type": "function",
                              "function": {"name": item["name"], "arguments": json.loads(item["arguments"] or "{}")}})
            elif item["type"] == "custom_tool_call":
                calls.append({"id": item["call_id"], "type": "function",
                              "function": {"name": item["name"], "arguments": {CUSTOM_INPUT: item["input"]}}})
        turn = {"role": "assistant", "content": text}
        if reasoning:
            turn["reasoning_content"] = reasoning
        if calls:
            turn["tool_calls"] = calls
        history = [m for m in messages if m["role"] != "system"] + [turn]
        self.stored[response["id"]] = (response, history)
        while len(self.stored) > STORED_RESPONSES:
            self.stored.popitem(last=False)

    def recall(self, response_id: str) -> list[dict]:
        """The conversation up to and including a stored response (previous_response_id)."""
        if response_id not in self.stored:
            raise ApiError(404, "not_found_error", f"previous_response_id {response_id!r} is not stored here (the last "
                           f"{STORED_RESPONSES} responses are kept in memory, not across restarts); send the whole "
                           "conversation as input instead", "previous_response_id")
        return list(self.stored[response_id][1])

    def answer_grammar(self, schema: dict | None, param: str, tools, choice: tuple[str, str | None]):
        """The request's constraints as one AnswerGrammar (None: nothing to constrain): its output schema
        over the answer, and — when a tool is strict or tool_choice requires a call — each call held to the
        allowed tools' names and a strict tool's parameters to its schema. Compiling can take a while: call
        it off the event loop."""
        mode, named = choice
        tools = tools or []
        names = [t["function"]["name"] for t in tools]
        if mode == "named":
            names = [named]
        calls = matcher = None
        if mode != "none" and tools and (mode in ("required", "named") or any(t["function"].get("strict") for t in tools)):
            try:  # each strict tool compiled alone first, so a schema that cannot be enforced is named
                for tool in tools:
                    if tool["function"].get("strict") and tool["function"]["name"] in names:
                        self.grammars.call_matchers([tool], [tool["function"]["name"]], f"tool {tool['function']['name']!r}")
                calls = self.grammars.call_matchers(tools, names, "tools")
            except StructuredOutputError as exc:
                raise ApiError(400, "invalid_request_error", str(exc), "tools") from None
        if schema is not None and mode not in ("required", "named"):
            try:
                matcher = self.grammars.matcher(schema, param)
            except StructuredOutputError as exc:
                raise ApiError(400, "invalid_request_error", str(exc), param) from None
        if matcher is None and calls is None:
            return None
        escape = self.tokenizer.token_to_id("<tool_call>") if tools and mode != "none" else None
        return AnswerGrammar(matcher, escape, calls=calls)

    async def prompt(self, build):
        """Render and tokenize in a worker thread (a multi-megabyte prompt must not stall the event loop
        and /health); a failure while reading the request's own content is a 400, not a 500."""
        try:
            return await asyncio.to_thread(build)
        except (ApiError, RequestError):
            raise
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, RecursionError) as exc:
            raise ApiError(400, "invalid_request_error", f"malformed request: {type(exc).__name__}: {exc}"[:500]) from None

    def check_model(self, body: dict) -> None:
        model, cfg = body.get("model"), self.config
        if model is None or cfg.accept_any_model or model == cfg.model_id or model in cfg.model_aliases:
            return
        raise ApiError(404, "not_found_error", f"model {model!r} is not served here; use {cfg.model_id!r} (or start "
                       "the server with --served-model-name NAME,... or --accept-any-model)")


def build_app(server: Server, cors: bool = False) -> FastAPI:
    app = FastAPI(title="ninfer", docs_url=None, redoc_url=None)
    cfg = server.config
    if cors:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])

    async def body_of(request: Request) -> dict:
        if cfg.api_key:
            auth = request.headers.get("authorization", "")
            key = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key")
            if key != cfg.api_key:
                raise ApiError(401, "authentication_error", "missing or wrong API key")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cfg.max_request_bytes:
            raise ApiError(413, "request_too_large", f"request body of {declared} bytes exceeds the server's "
                           f"{cfg.max_request_bytes}-byte limit (--max-request-bytes)")
        raw = bytearray()
        async for piece in request.stream():
            raw += piece
            if len(raw) > cfg.max_request_bytes:
                raise ApiError(413, "request_too_large", f"request body exceeds the server's {cfg.max_request_bytes}-byte "
                               "limit (--max-request-bytes)")
        try:
            body = await asyncio.to_thread(json.loads, bytes(raw))
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # ValueError: also integers of > 4,300 digits
            raise ApiError(400, "invalid_request_error", f"request body is not valid JSON: {str(exc)[:200]}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "invalid_request_error", "request body must be a JSON object")
        cfg.stats["requests"] += 1
        return body

    def guarded(shape, api: str):
        def refused(e: ApiError):
            cfg.stats["errors"] += 1
            outcome = {429: "rejected", 529: "rejected", 503: "unavailable"}.get(e.status)
            server.metrics.outcomes.labels(api, outcome or ("invalid" if e.status < 500 else "error")).inc()
            return shape(e)

        def wrap(fn):
            async def handler(request: Request):
                try:
                    return await fn(request)
                except ApiError as e:
                    return refused(e)
                except RequestError as e:
                    kind = "vision_disabled" if str(e).startswith("vision_disabled") else "invalid_request_error"
                    return refused(ApiError(400, kind, str(e)))
                except Exception as e:  # noqa: BLE001 - a bug must still answer in the API's shape
                    import traceback

                    traceback.print_exc()
                    return refused(ApiError(500, "server_error", f"internal error ({type(e).__name__}); the server "
                                                                 "keeps serving other requests"))
            handler.__name__ = fn.__name__
            return handler
        return wrap

    @app.get("/health")
    async def health():
        failure = getattr(server.scheduler, "failure", None)
        if failure is not None:
            return JSONResponse({"status": "error", "error": f"generation worker stopped: {type(failure).__name__}"}, 503)
        return {"status": "ok", "model": cfg.model_id, "active_lanes": server.scheduler.active_lanes,
                "queued": server.scheduler.queue_depth}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "ninfer",
                                            "context_length": cfg.max_context}
                                           for name in dict.fromkeys((cfg.model_id, *cfg.model_aliases))]}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    # --- OpenAI Chat Completions -----------------------------------------------------------

    @app.post("/v1/chat/completions")
    @guarded(_openai_error, "chat")
    async def chat_completions(request: Request):
        body = await body_of(request)
        req = parse(ChatRequest, body)
        server.check_model(body)
        kwargs = req.chat_template_kwargs
        thinking = req.reasoning_effort != "none"
        if kwargs is not None and kwargs.enable_thinking is not None:
            thinking = kwargs.enable_thinking
        streaming = bool(req.stream)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def build():
            tools = normalize_openai_tools(body.get("tools"))
            sink = server.image_sink()
            messages = normalize_openai_messages(body.get("messages"), sink)
            keep = kwargs.preserve_thinking if kwargs is not None else None
            return tools, server.tokenize(messages, tools, thinking, sink, keep)

        tools, prompt = await server.prompt(build)
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        budget = req.thinking_budget if req.thinking_budget is not None else EFFORT_BUDGETS.get(req.reasoning_effort)
        if req.top_logprobs and not req.logprobs:
            raise ApiError(400, "invalid_request_error", "top_logprobs needs logprobs: true", "top_logprobs")
        choice = openai_tool_choice(req.tool_choice)
        grammar = await server.prompt(lambda: server.answer_grammar(answer_schema(req.response_format), "response_format",
                                                                    tools, choice))
        gen = server.start(body, prompt, tools, thinking, limit, body.get("stop"), budget, "chat", choice,
                           req.parallel_tool_calls is not False, (req.top_logprobs or 0) if req.logprobs else None, grammar)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        usage = lambda: {"prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,  # noqa: E731
                         "total_tokens": gen.prompt_tokens + gen.completion_tokens,
                         "prompt_tokens_details": {"cached_tokens": gen.request.cached_tokens},
                         "completion_tokens_details": {"reasoning_tokens": gen.reasoning_tokens}}

        if not streaming:
            await gen.collect(request)
            r = gen.parser.result
            message = {"role": "assistant", "content": r.content or (None if r.tool_calls else ""),
                       "reasoning_content": r.reasoning or None}
            if r.tool_calls:
                message["tool_calls"] = [{"id": c.id, "type": "function",
                                          "function": {"name": c.name, "arguments": c.arguments_json}} for c in r.tool_calls]
            return gen.answer({"id": rid, "object": "chat.completion", "created": created, "model": cfg.model_id,
                               "choices": [{"index": 0, "message": message, "finish_reason": gen.finish_reason,
                                            "logprobs": {"content": gen.logprob_entries()} if req.logprobs else None}],
                               "usage": usage(), "timings": gen.timings()})

        await gen.admission(request)  # a queue timeout is a 503 before any stream bytes

        def chunk(delta, finish=None):
            # each chunk carries the logprobs of the tokens that arrived since the previous one
            logprobs = gen.take_logprobs() if delta else None
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": cfg.model_id,
                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}]})

        async def stream():
            yield chunk({"role": "assistant", "content": ""})
            try:
                async for ev in gen.events(HEARTBEAT_S):
                    if ev.kind == "ping":
                        yield ": keep-alive\n\n"  # an SSE comment: clients skip it
                    elif ev.kind == "reasoning":
                        yield chunk({"reasoning_content": ev.text})
                    elif ev.kind == "content":
                        yield chunk({"content": ev.text})
                    elif ev.kind == "tool_call_begin":
                        c = ev.call
                        yield chunk({"tool_calls": [{"index": c.index, "id": c.id, "type": "function",
                                                     "function": {"name": c.name, "arguments": ""}}]})
                    elif ev.kind == "tool_call_delta":
                        yield chunk({"tool_calls": [{"index": ev.call.index, "function": {"arguments": ev.text}}]})
            except ApiError as e:
                yield _sse({"error": {"message": e.message, "type": e.kind}})
                return
            yield chunk({}, gen.finish_reason)
            if include_usage:
                yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": cfg.model_id,
                            "choices": [], "usage": usage(), "timings": gen.timings()})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    # --- Anthropic Messages ---------------------------------------------------------------

    async def anthropic_prompt(body: dict, model):
        req = parse(model, body)
        server.check_model(body)
        thinking = req.thinking is not None and req.thinking.type in ("enabled", "adaptive")

        def build():
            tools = normalize_anthropic_tools(body.get("tools"))
            sink = server.image_sink()
            messages = normalize_anthropic_messages(body.get("system"), body.get("messages"), sink)
            return tools, server.tokenize(messages, tools, thinking, sink)

        tools, prompt = await server.prompt(build)
        return req, tools, thinking, prompt

    @app.post("/v1/messages/count_tokens")
    @guarded(_anthropic_error, "count_tokens")
    async def count_tokens(request: Request):
        body = await body_of(request)
        _, _, _, prompt = await anthropic_prompt(body, CountTokensRequest)
        return {"input_tokens": len(prompt)}

    @app.post("/v1/messages")
    @guarded(_anthropic_error, "messages")
    async def messages(request: Request):
        body = await body_of(request)
        if body.get("max_tokens") is None:
            raise ApiError(400, "invalid_request_error", "max_tokens is required", "max_tokens")
        streaming = body.get("stream") is True
        req, tools, thinking, prompt = await anthropic_prompt(body, MessagesRequest)
        budget = (body.get("thinking") or {}).get("budget_tokens")  # adaptive: the server's default
        fmt, param = (req.output_config.format, "output_config.format") if req.output_config and req.output_config.format \
            else (req.output_format, "output_format")
        try:
            choice, parallel = anthropic_tool_choice(body.get("tool_choice"))
            grammar = await server.prompt(lambda: server.answer_grammar(answer_schema(fmt), param, tools, choice))
            gen = server.start(body, prompt, tools, thinking, body["max_tokens"], body.get("stop_sequences"), budget,
                               "messages", choice, parallel, grammar=grammar)
        except ApiError as e:
            if e.status == 429:  # Anthropic's overload status
                raise ApiError(529, "overloaded_error", e.message) from None
            raise
        mid = f"msg_{uuid.uuid4().hex}"
        stop_reason = lambda: {"length": "max_tokens", "tool_calls": "tool_use"}.get(  # noqa: E731
            gen.finish_reason, "stop_sequence" if gen.parser.result.stopped_by else "end_turn")

        if not streaming:
            await gen.collect(request)
            r = gen.parser.result
            content = []
            if r.reasoning:
                content.append({"type": "thinking", "thinking": r.reasoning, "signature": ""})
            if r.content:
                content.append({"type": "text", "text": r.content})
            content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in r.tool_calls]
            return gen.answer({"id": mid, "type": "message", "role": "assistant", "model": cfg.model_id,
                               "content": content, "stop_reason": stop_reason(), "stop_sequence": r.stopped_by,
                               "usage": {"input_tokens": gen.prompt_tokens - gen.request.cached_tokens,
                                         "cache_read_input_tokens": gen.request.cached_tokens,
                                         "output_tokens": gen.completion_tokens}})

        await gen.admission(request)

        async def stream():
            yield _sse({"type": "message_start", "message": {
                "id": mid, "type": "message", "role": "assistant", "model": cfg.model_id, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": gen.prompt_tokens, "output_tokens": 0}}}, "message_start")
            index, open_kind = -1, None

            def close():
                return _sse({"type": "content_block_stop", "index": index}, "content_block_stop")

            try:
                async for ev in gen.events(HEARTBEAT_S):
                    if ev.kind == "ping":
                        yield _sse({"type": "ping"}, "ping")
                        continue
                    if ev.kind in ("reasoning", "content"):
                        kind = "thinking" if ev.kind == "reasoning" else "text"
                        if open_kind != kind:
                            if open_kind is not None:
                                if open_kind == "thinking":
                                    yield _sse({"type": "content_block_delta", "index": index,
                                                "delta": {"type": "signature_delta", "signature": ""}}, "content_block_delta")
                                yield close()
                            index, open_kind = index + 1, kind
                            block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}
                            yield _sse({"type": "content_block_start", "index": index, "content_block": block}, "content_block_start")
                        delta = {"type": "thinking_delta", "thinking": ev.text} if kind == "thinking" else {"type": "text_delta", "text": ev.text}
                        yield _sse({"type": "content_block_delta", "index": index, "delta": delta}, "content_block_delta")
                    elif ev.kind == "tool_call_begin":
                        if open_kind is not None:
                            if open_kind == "thinking":
                                yield _sse({"type": "content_block_delta", "index": index,
                                            "delta": {"type": "signature_delta", "signature": ""}}, "content_block_delta")
                            yield close()
                        c = ev.call
                        index, open_kind = index + 1, "tool_use"
                        yield _sse({"type": "content_block_start", "index": index, "content_block": {
                            "type": "tool_use", "id": c.id, "name": c.name, "input": {}}}, "content_block_start")
                    elif ev.kind == "tool_call_delta":
                        yield _sse({"type": "content_block_delta", "index": index, "delta": {
                            "type": "input_json_delta", "partial_json": ev.text}}, "content_block_delta")
                    else:  # the call is complete
                        yield close()
                        open_kind = None
            except ApiError as e:
                yield _sse({"type": "error", "error": {"type": e.kind, "message": e.message}}, "error")
                return
            if open_kind is not None:
                yield close()
            yield _sse({"type": "message_delta", "delta": {"stop_reason": stop_reason(), "stop_sequence": gen.parser.result.stopped_by},
                        "usage": {"output_tokens": gen.completion_tokens}}, "message_delta")
            yield _sse({"type": "message_stop"}, "message_stop")

        return StreamingResponse(stream(), media_type="text/event-stream")

    # --- OpenAI Responses ------------------------------------------------------------------

    @app.get("/v1/responses/{response_id}")
    @guarded(_openai_error, "responses")
    async def get_response(request: Request):
        response_id = request.path_params["response_id"]
        if response_id not in server.stored:
            raise ApiError(404, "not_found_error", f"response {response_id!r} is not stored here", "response_id")
        return server.stored[response_id][0]

    @app.post("/v1/responses")
    @guarded(_openai_error, "responses")
    async def responses(request: Request):
        body = await body_of(request)
        req = parse(ResponsesRequest, body)
        server.check_model(body)
        thinking = (req.reasoning.effort if req.reasoning else None) not in ("none", "minimal")
        streaming = bool(req.stream)

        prior = server.recall(req.previous_response_id) if req.previous_response_id else []

        def build():
            tools, customs = responses_tools(body.get("tools"), body.get("input"))
            sink = server.image_sink()
            turn = normalize_responses_input(None, body.get("input"), sink)
            head = [{"role": "system", "content": req.instructions}] if req.instructions else []
            conversation = system_first(head + prior + turn)  # a previous response's instructions do not carry over
            if req.truncation != "auto" or getattr(sink, "images", None):  # (images: placeholders and pixels stay together)
                return tools, customs, conversation, server.tokenize(conversation, tools, thinking, sink)
            conversation, prompt = drop_oldest_turns(conversation, lambda c: server.tokenize(c, tools, thinking, sink))
            return tools, customs, conversation, prompt

        tools, customs, messages, prompt = await server.prompt(build)
        if req.store is False:
            messages = None  # not kept: remember() skips it
        effort = req.reasoning.effort if req.reasoning else None
        budget = req.thinking_budget if req.thinking_budget is not None else EFFORT_BUDGETS.get(effort)
        choice = openai_tool_choice(req.tool_choice)
        fmt = req.text.format if req.text else None
        grammar = await server.prompt(lambda: server.answer_grammar(answer_schema(fmt), "text.format", tools, choice))
        wants_logprobs = req.top_logprobs is not None or "message.output_text.logprobs" in (req.include or [])
        gen = server.start(body, prompt, tools, thinking, body.get("max_output_tokens"), None, budget, "responses",
                           choice, req.parallel_tool_calls is not False, (req.top_logprobs or 0) if wants_logprobs else None,
                           grammar=grammar)
        rid, created = f"resp_{uuid.uuid4().hex}", int(time.time())
        base = {"id": rid, "object": "response", "created_at": created, "model": cfg.model_id, "error": None,
                "instructions": body.get("instructions"), "metadata": body.get("metadata") or {},
                "parallel_tool_calls": req.parallel_tool_calls is not False, "temperature": body.get("temperature"), "top_p": body.get("top_p"),
                "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
                "max_output_tokens": body.get("max_output_tokens"), "previous_response_id": req.previous_response_id,
                "store": req.store is not False,
                "reasoning": body.get("reasoning"), "text": {"format": (req.text.format.model_dump(by_alias=True, exclude_none=True)
                                                                        if req.text and req.text.format else {"type": "text"})},
                "truncation": req.truncation or "disabled",
                "usage": None, "incomplete_details": None}

        def usage():
            return {"input_tokens": gen.prompt_tokens, "input_tokens_details": {"cached_tokens": gen.request.cached_tokens},
                    "output_tokens": gen.completion_tokens,
                    "output_tokens_details": {"reasoning_tokens": gen.reasoning_tokens},
                    "total_tokens": gen.prompt_tokens + gen.completion_tokens}

        def final(output):
            incomplete = gen.finish_reason == "length"
            return {**base, "status": "incomplete" if incomplete else "completed", "output": output, "usage": usage(),
                    "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None}

        def reasoning_item(text):
            return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                    "content": [{"type": "reasoning_text", "text": text}]}

        def message_item(mid, text, status="completed", logprobs=None):
            part = {"type": "output_text", "text": text, "annotations": []}
            if logprobs is not None:
                part["logprobs"] = logprobs
            return {"type": "message", "id": mid, "status": status, "role": "assistant",
                    "content": [part] if status == "completed" or text else []}

        def call_item(c):
            if c.name in customs:  # a freeform tool: its raw input, as the client offered it
                value = c.arguments.get(CUSTOM_INPUT, "") if isinstance(c.arguments, dict) else ""
                return {"type": "custom_tool_call", "id": f"ctc_{c.id}", "call_id": c.id, "name": c.name,
                        "input": value if isinstance(value, str) else json.dumps(value), "status": "completed"}
            return {"type": "function_call", "id": f"fc_{c.id}", "call_id": c.id, "name": c.name,
                    "arguments": c.arguments_json, "status": "completed"}

        if not streaming:
            await gen.collect(request)
            r = gen.parser.result
            output = ([reasoning_item(r.reasoning)] if r.reasoning else []) + \
                     ([message_item(f"msg_{uuid.uuid4().hex}", r.content, logprobs=gen.answer_logprobs() if wants_logprobs
                                    else None)] if r.content or not r.tool_calls else []) + \
                     [call_item(c) for c in r.tool_calls]
            done = final(output)
            server.remember(done, messages)
            return gen.answer(done)

        await gen.admission(request)

        async def stream():
            seq = 0

            def ev(kind, **fields):
                nonlocal seq
                seq += 1
                return _sse({"type": kind, "sequence_number": seq - 1, **fields}, kind)

            yield ev("response.created", response={**base, "status": "in_progress", "output": []})
            yield ev("response.in_progress", response={**base, "status": "in_progress", "output": []})
            output, open_item, text = [], None, ""
            answer_lps: list[dict] = []  # the logprobs the deltas carried, repeated in the finished part

            def close_open():
                nonlocal open_item, text
                item, idx = open_item, len(output)
                events = []
                if item["type"] == "reasoning":
                    item["content"] = [{"type": "reasoning_text", "text": text}]
                    events.append(ev("response.reasoning_text.done", item_id=item["id"], output_index=idx, content_index=0, text=text))
                else:
                    part = {"type": "output_text", "text": text, "annotations": []}
                    if wants_logprobs:
                        part["logprobs"] = answer_lps + gen.answer_logprobs()
                    item["content"], item["status"] = [part], "completed"
                    events.append(ev("response.output_text.done", item_id=item["id"], output_index=idx, content_index=0, text=text))
                    events.append(ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0, part=part))
                events.append(ev("response.output_item.done", output_index=idx, item=item))
                output.append(item)
                open_item, text = None, ""
                return events

            try:
                async for e in gen.events(HEARTBEAT_S):
                    if e.kind == "ping":
                        yield ": keep-alive\n\n"
                        continue
                    if e.kind in ("reasoning", "content"):
                        want = "reasoning" if e.kind == "reasoning" else "message"
                        if open_item is not None and open_item["type"] != want:
                            for x in close_open():
                                yield x
                        if open_item is None:
                            open_item = reasoning_item("") if want == "reasoning" else message_item(f"msg_{uuid.uuid4().hex}", "", "in_progress")
                            if want == "reasoning":
                                open_item["content"] = []
                            yield ev("response.output_item.added", output_index=len(output), item=dict(open_item))
                            if want == "message":
                                yield ev("response.content_part.added", item_id=open_item["id"], output_index=len(output),
                                         content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                        text += e.text
                        if want == "reasoning":
                            yield ev("response.reasoning_text.delta", item_id=open_item["id"], output_index=len(output),
                                     content_index=0, delta=e.text)
                        else:
                            extra = {"logprobs": gen.answer_logprobs()} if wants_logprobs else {}
                            if wants_logprobs:
                                answer_lps.extend(extra["logprobs"])
                            yield ev("response.output_text.delta", item_id=open_item["id"], output_index=len(output),
                                     content_index=0, delta=e.text, **extra)
                    elif e.kind == "tool_call_begin":
                        if open_item is not None:
                            for x in close_open():
                                yield x
                        item = call_item(e.call)
                        field = "input" if item["type"] == "custom_tool_call" else "arguments"
                        yield ev("response.output_item.added", output_index=len(output),
                                 item={**item, field: "", "status": "in_progress"})
                    elif e.kind == "tool_call_delta":
                        if e.call.name not in customs:  # a custom call's input streams once it is whole
                            yield ev("response.function_call_arguments.delta", item_id=call_item(e.call)["id"],
                                     output_index=len(output), delta=e.text)
                    else:  # the call is complete
                        item = call_item(e.call)
                        idx = len(output)
                        if item["type"] == "custom_tool_call":
                            yield ev("response.custom_tool_call_input.delta", item_id=item["id"], output_index=idx,
                                     delta=item["input"])
                            yield ev("response.custom_tool_call_input.done", item_id=item["id"], output_index=idx,
                                     input=item["input"])
                        else:
                            yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                                     arguments=item["arguments"])
                        yield ev("response.output_item.done", output_index=idx, item=item)
                        output.append(item)
            except ApiError as err:
                yield ev("response.failed", response={**base, "status": "failed", "output": output,
                                                      "error": {"code": err.kind, "message": err.message}})
                return
            if open_item is not None:
                for x in close_open():
                    yield x
            # as the OpenAI API does: a length stop ends with `response.incomplete` (status "incomplete",
            # incomplete_details), anything else with `response.completed`
            done = final(output)
            server.remember(done, messages)
            yield ev("response.incomplete" if done["status"] == "incomplete" else "response.completed", response=done)

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app
