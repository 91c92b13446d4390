"""`ninfer serve` against hostile and careless clients: the real app and the real lane scheduler over a
fake engine (deterministic logits in microseconds), on loopback. Every malformed request is a 4xx in
its API's own JSON shape, one request's failure never reaches another, admission is bounded at
arrival, disconnects free their place, the event loop stays responsive, and a dead worker is loud."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import torch

from format.tiny import CHAT_TEMPLATE, build_tokenizer
from runtime.serve.app import Server, ServerConfig, build_app
from runtime.serve.chat_template import ChatTemplate
from runtime.serve.scheduler import Scheduler
from .serving import Loopback

VOCAB = 384
POISON = "poison-pill"  # a prompt holding this fails in the middle of its prefill (fault injection)


class FakeEngine:
    """The engine surface the scheduler uses. Greedy next token = a function of the last token only, so
    a lane's output depends on its own prompt alone; prefill yields one chunk per 16 prompt tokens."""

    def __init__(self, tokenizer, lanes: int = 2, step_s: float = 0.002):
        self.lanes, self.step_s = lanes, step_s
        self.device = torch.device("cpu")
        self.cfg = SimpleNamespace(vocab_size=VOCAB)
        self.opts = SimpleNamespace(max_context=4096)
        self.speculator = None
        self.held: dict[int, int] = {}
        self.stop = tokenizer.token_to_id("<|im_end|>")
        self.poison = tokenizer.encode(POISON, add_special_tokens=False).ids
        self.prefer: int | None = None  # a token the model rates above everything else (tool_choice tests)

    def logits(self, token: int) -> torch.Tensor:
        nxt = 40 + (token * 7 + 3) % 50  # plain characters: no special tokens, never the end of thinking
        out = torch.zeros(VOCAB)
        out[nxt] = 10.0
        if self.prefer is not None:
            out[self.prefer] = 20.0
        return out

    def reusable_prefix(self, lane, prompt):
        return 0

    def held_tokens(self, lane):
        return self.held.get(lane, 0)

    def prefill_chunks(self, lane, prompt, **_):
        n = len(self.poison)  # the pill's tokens in a row (a long prompt holds its characters anyway)
        poisoned = any(prompt[i : i + n] == self.poison for i in range(len(prompt) - n + 1))

        def chunks():
            for start in range(0, len(prompt), 16):
                time.sleep(self.step_s)
                if poisoned and start > 0:
                    raise RuntimeError("injected fault in the middle of a prefill")
                self.held[lane] = min(len(prompt), start + 16)
                yield self.logits(prompt[-1]) if start + 16 >= len(prompt) else None

        return chunks()

    def decode_step(self, lanes, tokens, device_tokens=None):
        time.sleep(self.step_s)
        if device_tokens is not None:  # a chained step: fed the tokens the scheduler picked on the device
            tokens = device_tokens.tolist()
        for lane in lanes:
            self.held[lane] += 1
        return torch.stack([self.logits(t) for t in tokens])

    def record_fed_tokens(self, lanes, tokens):
        pass


class Running:
    def __init__(self, lanes=2, max_pending=4, pending_timeout_ms=0, step_s=0.002, max_request_bytes=1 << 20,
                 on_fatal=None, **config):
        tok = build_tokenizer(VOCAB)
        self.engine = FakeEngine(tok, lanes, step_s)
        self.scheduler = Scheduler(self.engine, max_pending=max_pending, pending_timeout_ms=pending_timeout_ms,
                                   on_fatal=on_fatal)
        config = ServerConfig("tiny", 4096, pending_timeout_ms=pending_timeout_ms, max_request_bytes=max_request_bytes,
                              **config)
        server = Server(self.engine, tok, ChatTemplate(CHAT_TEMPLATE), config, {self.engine.stop}, self.scheduler)
        self.loopback = Loopback(build_app(server))
        self.url = self.loopback.url

    def stop(self):
        self.loopback.stop()
        self.scheduler.close()

    def wait_busy(self, timeout: float = 10) -> None:
        """Until a request holds a lane (the one just submitted from another thread)."""
        deadline = time.time() + timeout
        while httpx.get(self.url + "/health").json()["active_lanes"] == 0 and time.time() < deadline:
            time.sleep(0.02)

    def healthy(self) -> bool:
        return httpx.get(self.url + "/health", timeout=10).status_code == 200

    def chat(self, content="hello", timeout=30, **extra):
        body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 6,
                "temperature": 0, **extra}
        return httpx.post(self.url + "/v1/chat/completions", json=body, timeout=timeout)


@pytest.fixture(scope="module")
def srv():
    s = Running()
    yield s
    s.stop()


CHAT, MESSAGES, RESPONSES, COUNT = "/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/messages/count_tokens"
USER = [{"role": "user", "content": "hi"}]
BASES = {CHAT: {"messages": USER, "max_tokens": 4}, MESSAGES: {"messages": USER, "max_tokens": 4},
         RESPONSES: {"input": "hi", "max_output_tokens": 4}, COUNT: {"messages": USER}}
# fields every API reads, with values no client may send
SHARED_BAD = [("temperature", "hot"), ("temperature", float("nan")), ("temperature", 3), ("temperature", -1),
              ("temperature", [1]), ("top_p", 2), ("top_p", "x"), ("top_k", 10 ** 30), ("top_k", -1), ("top_k", 1.5),
              ("seed", "x"), ("seed", 1.5), ("model", "gpt-9"), ("stream", "yes"), ("tools", "x"), ("tools", [5]),
              ("presence_penalty", 9), ("min_p", float("inf"))]
PER_API_BAD = {
    CHAT: [("messages", "nope"), ("messages", [{"role": "user", "content": [{"type": "text", "text": 5}]}]),
           ("messages", [{"role": "user", "content": [{"type": "video", "video": 1}]}]), ("messages", [5]),
           ("messages", [{"role": "wizard", "content": "x"}]), ("chat_template_kwargs", "x"),
           ("chat_template_kwargs", {"enable_thinking": "maybe"}), ("stream_options", "yes"), ("max_tokens", 0),
           ("max_tokens", "many"), ("stop", 5), ("stop", [1, 2]),
           ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]),
           ("logit_bias", {"5": 101}), ("logit_bias", {"5": "up"}), ("logit_bias", {"x": 1}), ("logit_bias", {"-1": 1}),
           ("logit_bias", {str(VOCAB): 1}), ("logit_bias", {"99999999999999999999": 1}), ("logit_bias", [5]),
           ("logit_bias", {str(i): 1 for i in range(301)})],
    MESSAGES: [("messages", "nope"), ("thinking", "yes"), ("messages", [{"role": "user", "content": [{"type": "text", "text": 5}]}]),
               ("messages", [{"role": "assistant", "content": [{"type": "thinking", "thinking": None}]}]),
               ("messages", [{"role": "user", "content": [{"type": "tool_result"}]}]), ("max_tokens", -3),
               ("stop_sequences", 7), ("system", 5), ("messages", [{"role": "user"}])],
    RESPONSES: [("reasoning", "high"), ("input", 5), ("input", [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]),
                ("input", [{"type": "function_call_output"}]), ("max_output_tokens", 0), ("instructions", 5)],
    COUNT: [("messages", "nope"), ("thinking", "yes"), ("system", [5])],
}


def _cases():
    cases = []
    for path, base in BASES.items():
        for key, value in SHARED_BAD if path != COUNT else [("model", "gpt-9"), ("tools", "x"), ("tools", [5])]:
            cases.append((path, {**base, key: value}))
        for key, value in PER_API_BAD[path]:
            cases.append((path, {**base, key: value}))
        cases += [(path, "{not json"), (path, "[1, 2]"), (path, "null"), (path, "[" * 200_000 + "]" * 200_000),
                  (path, '{"max_tokens": ' + "9" * 5000 + "}"), (path, b"\xff\xfe{}")]
    return cases


CASES = _cases()


def test_the_matrix_is_large():
    assert len(CASES) >= 80


@pytest.mark.parametrize("path,body", CASES, ids=lambda v: v if isinstance(v, str) and v.startswith("/") else None)
def test_malformed_requests_are_4xx_in_the_api_shape(srv, path, body):
    data = body if isinstance(body, (str, bytes)) else json.dumps(body, allow_nan=True)
    r = httpx.post(srv.url + path, content=data, headers={"content-type": "application/json"}, timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    payload = r.json()  # JSON, never plain text
    if path.startswith("/v1/messages"):
        assert payload["type"] == "error" and payload["error"]["type"] in (
            "invalid_request_error", "not_found_error", "request_too_large")
    else:
        assert payload["error"]["type"] in ("invalid_request_error", "not_found_error")  # OpenAI's documented types
    assert payload["error"]["message"]
    assert srv.healthy()


def test_well_formed_request_after_the_matrix(srv):
    r = srv.chat()
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


def test_logit_bias_forces_and_bans_tokens(srv):
    """Chat's logit_bias through the official SDK: +100 on one token makes it every pick (greedy and sampled),
    -100 keeps a token out even where the model rates it first; the server says which key is wrong."""
    import openai

    tok = build_tokenizer(VOCAB)
    z, q = tok.token_to_id("z"), tok.token_to_id("q")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    plain = client.chat.completions.create(model="tiny", messages=USER, max_tokens=6, temperature=0,
                                           extra_body=no_thinking)
    for temperature in (0, 1):
        forced = client.chat.completions.create(model="tiny", messages=USER, max_tokens=6, temperature=temperature,
                                                logit_bias={str(z): 100}, seed=3, extra_body=no_thinking)
        assert forced.choices[0].message.content == "z" * 6
    srv.engine.prefer = q  # the model now rates q first at every step: banned, the plain chain comes back
    try:
        banned = client.chat.completions.create(model="tiny", messages=USER, max_tokens=6, temperature=0,
                                                logit_bias={str(q): -100}, extra_body=no_thinking)
    finally:
        srv.engine.prefer = None
    assert banned.choices[0].message.content == plain.choices[0].message.content and "q" not in plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="not a token id of this model"):
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, logit_bias={str(VOCAB + 5): 1})


def test_any_integer_seed_samples_deterministically(srv):
    big = 1180591620717411303424  # 2^70: reduced to 64 bits, the same seed gives the same text
    a = srv.chat(temperature=1, seed=big).json()["choices"][0]["message"]["content"]
    b = srv.chat(temperature=1, seed=big).json()["choices"][0]["message"]["content"]
    assert a == b
    assert srv.chat(temperature=1, seed=-5).status_code == 200
    assert srv.healthy() and srv.chat().status_code == 200


def test_a_failing_request_does_not_touch_its_neighbour(srv):
    alone = srv.chat("the neighbour", max_tokens=12).json()["choices"][0]["message"]["content"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        bad = pool.submit(srv.chat, f"{POISON} " + "word " * 60, max_tokens=12)
        good = pool.submit(srv.chat, "the neighbour", max_tokens=12)
        bad, good = bad.result(), good.result()
    assert bad.status_code == 500 and bad.json()["error"]["type"] == "server_error"
    assert good.status_code == 200 and good.json()["choices"][0]["message"]["content"] == alone
    assert srv.healthy()


def test_chained_decode_hands_each_request_only_its_own_tokens():
    """Six requests of different lengths through two lanes: a lane ends while its chained step is in flight
    and the next request takes the lane; every answer is its answer alone, and the steps were chained."""
    s = Running(lanes=2, max_pending=8, step_s=0.004)
    try:
        asks = [(f"request {i} " + "word " * i, 3 + 4 * i) for i in range(6)]

        def content(ask):
            r = s.chat(ask[0], max_tokens=ask[1])
            assert r.status_code == 200, r.text
            message = r.json()["choices"][0]["message"]  # (the fake model's text is all reasoning)
            return message.get("reasoning_content"), message["content"], r.json()["usage"]["completion_tokens"]

        alone = [content(a) for a in asks]
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            together = list(pool.map(content, asks))
        assert together == alone
        assert [n for *_, n in alone] == [n for _, n in asks] and all(reasoning for reasoning, *_ in alone)
        assert s.scheduler.stats["chained_steps"] > 0
    finally:
        s.stop()


def test_chained_decode_stops_where_a_thinking_budget_closes_the_block():
    """A thinking budget: the chain runs while the budget lasts and ends before the host emits </think> in
    place of the model's token, so the token the next step is fed is </think>: the same answer as unchained."""
    s = Running(lanes=2, max_pending=4, step_s=0.002)
    try:
        def ask():
            r = httpx.post(s.url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "think about it"}], "max_tokens": 16, "thinking_budget": 6,
                "temperature": 0}, timeout=60).json()
            return r["choices"][0]["message"], r["usage"]["completion_tokens_details"]["reasoning_tokens"]

        chained = ask()
        steps = s.scheduler.stats["chained_steps"]
        s.scheduler.chain = False
        plain = ask()
        assert chained == plain and chained[1] == 6 and chained[0]["content"]
        assert steps > 0
    finally:
        s.stop()


def test_admission_is_bounded_at_arrival():
    s = Running(lanes=1, max_pending=1, step_s=0.02)
    try:
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            # 40 tokens (0.8 s) each: the held requests last longer than the burst takes to arrive (each
            # httpx.post builds a client, ~0.1 s on a busy CI core), so none finishes and frees a place early
            results = list(pool.map(lambda i: s.chat(f"burst {i}", max_tokens=40), range(10)))
        codes = sorted(r.status_code for r in results)
        assert codes.count(200) <= 2 and codes.count(429) >= 8, codes
        refused = next(r for r in results if r.status_code == 429)
        assert refused.headers.get("retry-after") == "1" and refused.json()["error"]["type"] == "rate_limit_error"
        anthropic = httpx.post(s.url + MESSAGES, json={"messages": USER, "max_tokens": 4}, timeout=30)
        assert anthropic.status_code == 200  # idle again: admitted
        metrics = httpx.get(s.url + "/metrics").text
        assert f"ninfer_rejected_total {codes.count(429)}.0" in metrics
        assert f'ninfer_api_requests_total{{api="chat",outcome="rejected"}} {codes.count(429)}.0' in metrics
    finally:
        s.stop()


def test_queue_timeout_is_a_503_before_any_stream_bytes():
    s = Running(lanes=1, max_pending=4, pending_timeout_ms=200, step_s=0.05)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(s.chat, "long one", max_tokens=80)
            s.wait_busy()  # the first request holds the only lane
            t0 = time.time()
            second = s.chat("waits", stream=True)
            waited = time.time() - t0
            assert first.result().status_code == 200
        assert second.status_code == 503 and second.headers["content-type"].startswith("application/json")
        assert "timed out in the queue" in second.json()["error"]["message"] and waited < 2.0
        assert "ninfer_queue_timeouts_total 1.0" in httpx.get(s.url + "/metrics").text
    finally:
        s.stop()


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
def test_a_queue_timeout_the_worker_sees_first_is_still_a_503(path):
    """On a loaded machine the worker's own expiry check can run before the event loop's wait ends; the
    client must still get a 503 before any stream bytes, not a 200 stream that carries an error."""
    s = Running(lanes=1, max_pending=4, pending_timeout_ms=150, step_s=0.03)
    s.scheduler.expire = lambda request: False  # the loop always loses the race
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(s.chat, "long one", max_tokens=60)
            s.wait_busy()  # the first request holds the only lane
            second = httpx.post(s.url + path, json={**BASES[path], "stream": True}, timeout=30)
            assert first.result().status_code == 200
        assert second.status_code == 503 and second.headers["content-type"].startswith("application/json")
        assert "timed out in the queue" in second.text
        assert "ninfer_queue_timeouts_total 1.0" in httpx.get(s.url + "/metrics").text
    finally:
        s.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_disconnecting_client_frees_its_lane(stream):
    s = Running(lanes=1, step_s=0.02)
    try:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "goes away"}], "max_tokens": 3000,
                "stream": stream}
        if stream:
            with httpx.stream("POST", s.url + CHAT, json=body, timeout=30) as r:
                next(r.iter_lines())  # the first chunk: the request holds the lane; then the client leaves
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(s.url + CHAT, json=body, timeout=0.5)
        deadline = time.time() + 5
        while httpx.get(s.url + "/health").json()["active_lanes"] and time.time() < deadline:
            time.sleep(0.05)
        assert httpx.get(s.url + "/health").json()["active_lanes"] == 0
        assert s.chat("next").status_code == 200
    finally:
        s.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_queued_client_that_disconnects_leaves_the_queue(stream):
    s = Running(lanes=1, max_pending=4, step_s=0.02)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(s.chat, "holder", max_tokens=100)
            s.wait_busy()  # the first request holds the only lane
            with pytest.raises(httpx.ReadTimeout):  # a stream waits for its lane before any bytes
                s.chat("queued then gone", timeout=0.3, stream=stream)
            time.sleep(0.4)
            assert httpx.get(s.url + "/health").json()["queued"] == 0
            assert first.result().status_code == 200
    finally:
        s.stop()


def test_large_bodies_are_413_and_health_stays_fast():
    s = Running(max_request_bytes=4 << 20)
    try:
        too_big = httpx.post(s.url + CHAT, content=b"{" + b" " * (5 << 20) + b"}",
                             headers={"content-type": "application/json"}, timeout=60)
        assert too_big.status_code == 413 and "--max-request-bytes" in too_big.json()["error"]["message"]
        latencies, done = [], threading.Event()

        def poll():
            while not done.is_set():
                t0 = time.perf_counter()
                assert httpx.get(s.url + "/health", timeout=10).status_code == 200
                latencies.append(time.perf_counter() - t0)
                time.sleep(0.01)

        poller = threading.Thread(target=poll)
        poller.start()
        t0 = time.perf_counter()
        big = s.chat("word " * 700_000, timeout=120)  # 3.5 MB rendered and tokenized off the event loop
        big_s = time.perf_counter() - t0
        done.set()
        poller.join()
        assert big.status_code == 400 and "tokens" in big.json()["error"]["message"]
        # ~100 ms on an idle machine; work on the event loop would hold /health for about the whole request.
        # The bound scales with the request's own time, so a loaded two-core CI runner does not trip it
        assert len(latencies) >= 3 and max(latencies) < max(0.5, 0.5 * big_s), (max(latencies), big_s)
        print(f"/health during a 3.5 MB request: max {max(latencies) * 1e3:.0f} ms over {len(latencies)} polls")
    finally:
        s.stop()


def test_a_dead_worker_is_loud_not_a_hang(monkeypatch):
    fatal = []
    s = Running(lanes=1, step_s=0.01, on_fatal=fatal.append)
    try:
        def broken():
            raise SystemError("worker bug")

        monkeypatch.setattr(s.scheduler, "_expire_and_admit", broken)  # outside the per-step guard: escapes the loop
        first = s.chat("wakes the worker", timeout=10)
        assert first.status_code == 500 and "worker stopped" in first.json()["error"]["message"]  # answered, no hang
        assert len(fatal) == 1 and isinstance(fatal[0], SystemError)
        health = httpx.get(s.url + "/health", timeout=5)
        assert health.status_code == 503 and "worker stopped" in health.json()["error"]
        r = s.chat("anyone?", timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded_error"
    finally:
        s.stop()


@pytest.mark.parametrize("api", ["chat", "effort", "messages", "responses"])
def test_thinking_budget_closes_the_block_and_the_answer_follows(srv, api):
    """The model here never ends its thinking: the budget makes the engine emit </think> itself after
    exactly that many reasoning tokens, and the rest of max_tokens is the answer."""
    user = [{"role": "user", "content": "think about it"}]
    if api in ("chat", "effort"):
        extra = {"thinking_budget": 5} if api == "chat" else {"reasoning_effort": "low"}
        r = httpx.post(srv.url + CHAT, json={"messages": user, "max_tokens": 12 if api == "chat" else 1030, **extra,
                                             "temperature": 0}, timeout=60).json()
        want = 5 if api == "chat" else 1024
        assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] == want, (r["usage"], r["choices"][0]["finish_reason"])
        assert r["choices"][0]["message"]["reasoning_content"] and r["choices"][0]["message"]["content"]
    elif api == "messages":
        r = httpx.post(srv.url + MESSAGES, json={"messages": user, "max_tokens": 12, "temperature": 0,
                                                 "thinking": {"type": "enabled", "budget_tokens": 5}}, timeout=60).json()
        kinds = [block["type"] for block in r["content"]]
        assert kinds == ["thinking", "text"] and r["stop_reason"] == "max_tokens"
    else:
        r = httpx.post(srv.url + RESPONSES, json={"input": "think about it", "max_output_tokens": 12,
                                                  "thinking_budget": 5, "temperature": 0}, timeout=60).json()
        assert r["usage"]["output_tokens_details"]["reasoning_tokens"] == 5
        assert [item["type"] for item in r["output"]] == ["reasoning", "message"]


def test_without_a_budget_thinking_runs_to_max_tokens(srv):
    # greedy: sampled at the default temperature, the fake model's </think> (weight e^0 against e^10) came up in
    # ~1 of 750 replies (1,500 tries in session 33: one reply that ended its thinking at once, one after 6 tokens)
    r = httpx.post(srv.url + CHAT, json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 8,
                                         "temperature": 0}, timeout=60).json()
    assert r["usage"]["completion_tokens_details"]["reasoning_tokens"] == 8, r
    assert not r["choices"][0]["message"]["content"], r


def test_model_names_clients_ask_for():
    s = Running(model_aliases=("claude-sonnet-4-5", "gpt-5-codex"))
    try:
        assert s.chat(model="gpt-5-codex").status_code == 200
        r = httpx.post(s.url + MESSAGES, json={"model": "claude-sonnet-4-5", "messages": USER, "max_tokens": 3})
        assert r.status_code == 200
        missing = s.chat(model="other")
        assert missing.status_code == 404 and "--accept-any-model" in missing.json()["error"]["message"]
        names = [m["id"] for m in httpx.get(s.url + "/v1/models").json()["data"]]
        assert names == ["tiny", "claude-sonnet-4-5", "gpt-5-codex"]
    finally:
        s.stop()
    s = Running(accept_any_model=True)
    try:
        assert s.chat(model="whatever-7b").status_code == 200
    finally:
        s.stop()


def test_a_too_long_prompt_says_so_in_the_words_agents_parse():
    s = Running()
    try:
        s.engine.opts.max_context = 64
        s.scheduler.engine.opts.max_context = 64
        r = httpx.post(s.url + MESSAGES, json={"messages": [{"role": "user", "content": "word " * 4000}], "max_tokens": 3},
                       timeout=60)
        assert r.status_code == 400
        import re

        assert re.search(r"prompt is too long: \d+ tokens > 4095 maximum", r.json()["error"]["message"])
    finally:
        s.stop()


def test_responses_truncation_auto_drops_the_oldest_whole_turns(srv):
    """Responses `truncation: "auto"`: a conversation past the context loses its oldest turns (the fewest that
    make it fit, the instructions kept) instead of a 400; "disabled" (the default) keeps the 400, and so does a
    newest turn too long on its own."""
    old = [{"role": "user", "content": "word " * 900}, {"role": "assistant", "content": "noted"}]  # ~3,600 tokens
    recent = [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "fine"},
              {"role": "user", "content": "and now?"}]
    body = {"instructions": "be brief", "max_output_tokens": 3}

    def post(items, truncation=None):
        extra = {"truncation": truncation} if truncation else {}
        return httpx.post(srv.url + RESPONSES, json={**body, "input": items, **extra}, timeout=60)

    full = post(old + recent)
    assert full.status_code == 400 and "prompt is too long" in full.json()["error"]["message"]
    alone = post(recent)
    assert alone.status_code == 200
    auto = post(old + recent, "auto")
    assert auto.status_code == 200, auto.text[:300]
    assert auto.json()["truncation"] == "auto"
    assert auto.json()["usage"]["input_tokens"] == alone.json()["usage"]["input_tokens"]  # only the old turn went
    huge = post([{"role": "user", "content": "word " * 1100}], "auto")
    assert huge.status_code == 400 and "prompt is too long" in huge.json()["error"]["message"]
    assert post(recent, "sometimes").status_code == 400


def test_streams_stay_alive_while_nothing_is_generated(monkeypatch):
    """A long prefill sends no tokens: Anthropic streams get `ping` events, OpenAI streams SSE comments."""
    import runtime.serve.app as app_module

    monkeypatch.setattr(app_module, "HEARTBEAT_S", 0.05)
    s = Running(lanes=1, step_s=0.3)  # each prefill chunk (and step) takes 0.3 s
    try:
        body = {"messages": USER, "max_tokens": 2, "stream": True}
        with httpx.stream("POST", s.url + MESSAGES, json=body, timeout=30) as r:
            events = [line for line in r.iter_lines() if line.startswith("event: ")]
        assert "event: ping" in events and events[-1] == "event: message_stop"
        with httpx.stream("POST", s.url + CHAT, json=body, timeout=30) as r:
            lines = list(r.iter_lines())
        assert ": keep-alive" in lines and lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
    finally:
        s.stop()


def test_metrics_histograms_timings_and_cached_tokens():
    s = Running(lanes=1)
    try:
        first = s.chat("the same long conversation " * 4, max_tokens=4).json()
        t = first["timings"]
        assert t["prompt_n"] == first["usage"]["prompt_tokens"] - t["cache_n"] and t["predicted_n"] == 4
        assert t["prompt_ms"] >= 0 and t["predicted_ms"] > 0 and t["predicted_per_second"] > 0
        s.engine.reusable_prefix = lambda lane, prompt: 10  # as if the lane still held 10 tokens of it
        again = s.chat("the same long conversation " * 4, max_tokens=4).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 10 == again["timings"]["cache_n"]
        reply = httpx.post(s.url + MESSAGES, json={"messages": USER, "max_tokens": 3})
        r = reply.json()
        assert r["usage"]["cache_read_input_tokens"] == 10
        assert json.loads(reply.headers["x-ninfer-timings"])["predicted_n"] == 3  # every API: in a header
        text = httpx.get(s.url + "/metrics").text
        for name in ("ninfer_queue_wait_seconds", "ninfer_time_to_first_token_seconds", "ninfer_request_duration_seconds"):
            assert f'{name}_count{{api="chat"}} 2.0' in text, name  # one per request
        assert 'ninfer_inter_token_latency_seconds_count{api="chat"} 6.0' in text  # one per gap: 3 a request
        assert 'ninfer_api_requests_total{api="chat",outcome="length"} 2.0' in text
        assert 'ninfer_api_requests_total{api="messages",outcome="length"} 1.0' in text
        s.chat("x", temperature="hot")
        assert 'ninfer_api_requests_total{api="chat",outcome="invalid"} 1.0' in httpx.get(s.url + "/metrics").text
    finally:
        s.stop()


WEATHER = {"name": "get_weather", "description": "weather", "parameters": {"type": "object", "properties": {}}}
OTHER = {"name": "get_time", "description": "time", "parameters": {"type": "object", "properties": {}}}


@pytest.fixture
def eager_caller():
    """A server whose model always wants the next token to be a tool-call marker."""
    s = Running(lanes=1)
    yield s
    s.stop()


def _chat_tools(s, tool_choice, tools=(WEATHER, OTHER), **extra):
    body = {"messages": USER, "max_tokens": 60, "tools": [{"type": "function", "function": t} for t in tools],
            "tool_choice": tool_choice, "chat_template_kwargs": {"enable_thinking": False}, **extra}
    return httpx.post(s.url + CHAT, json=body, timeout=60)


def test_tool_choice_none_bans_the_call(eager_caller):
    s = eager_caller
    s.engine.prefer = build_tokenizer(VOCAB).token_to_id("<tool_call>")
    r = _chat_tools(s, "none").json()
    assert r["choices"][0]["message"].get("tool_calls") is None and r["choices"][0]["message"]["content"]
    r = httpx.post(s.url + MESSAGES, json={"messages": USER, "max_tokens": 6, "tools": [
        {"name": "get_weather", "input_schema": {"type": "object"}}], "tool_choice": {"type": "none"}}).json()
    assert [b["type"] for b in r["content"]] == ["text"]


@pytest.mark.parametrize("choice,want", [({"type": "function", "function": {"name": "get_time"}}, "get_time"),
                                         ("required", None)])
def test_tool_choice_forces_a_call(eager_caller, choice, want):
    s = eager_caller
    s.engine.prefer = build_tokenizer(VOCAB).token_to_id("</tool_call>")  # left alone, it would never open a call
    tools = (WEATHER, OTHER) if want else (WEATHER,)
    r = _chat_tools(s, choice, tools, parallel_tool_calls=False).json()
    calls = r["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == [want or "get_weather"]
    assert r["choices"][0]["finish_reason"] == "tool_calls" and r["usage"]["completion_tokens"] < 60


@pytest.mark.parametrize("api", [CHAT, MESSAGES])
def test_required_call_among_several_tools_names_one_of_them(eager_caller, api):
    """`required` / `any` with several tools: the opening is forced and the name is held to the tools'
    names (the fake model, left alone, would close the call at once, nameless)."""
    s = eager_caller
    s.engine.prefer = build_tokenizer(VOCAB).token_to_id("</tool_call>")
    if api == CHAT:
        r = _chat_tools(s, "required", (WEATHER, OTHER), parallel_tool_calls=False).json()
        names = [c["function"]["name"] for c in r["choices"][0]["message"]["tool_calls"]]
    else:
        r = httpx.post(s.url + MESSAGES, json={"messages": USER, "max_tokens": 60, "tool_choice": {"type": "any"}, "tools": [
            {"name": t["name"], "input_schema": t["parameters"]} for t in (WEATHER, OTHER)]}, timeout=60).json()
        names = [b["name"] for b in r["content"] if b["type"] == "tool_use"]
    assert len(names) == 1 and names[0] in (WEATHER["name"], OTHER["name"]), r


def test_tool_choice_forces_a_call_after_thinking_on_anthropic(eager_caller):
    s = eager_caller
    s.engine.prefer = build_tokenizer(VOCAB).token_to_id("</tool_call>")
    r = httpx.post(s.url + MESSAGES, json={
        "messages": USER, "max_tokens": 60, "thinking": {"type": "enabled", "budget_tokens": 3},
        "tools": [{"name": "get_weather", "input_schema": {"type": "object"}}, {"name": "get_time", "input_schema": {}}],
        "tool_choice": {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True}}).json()
    assert [b["type"] for b in r["content"]] == ["thinking", "tool_use"] and r["content"][1]["name"] == "get_time"
    assert r["stop_reason"] == "tool_use"


def test_tool_choice_errors(srv):
    assert _chat_tools(srv, {"type": "function", "function": {"name": "nope"}}).status_code == 400
    assert _chat_tools(srv, "required", ()).status_code == 400
    assert _chat_tools(srv, "sometimes").status_code == 400
    r = httpx.post(srv.url + MESSAGES, json={"messages": USER, "max_tokens": 3, "tool_choice": {"type": "maybe"}})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_responses_previous_response_id_store_and_incomplete_streams(srv):
    first = httpx.post(srv.url + RESPONSES, json={"input": "hello there", "instructions": "be brief",
                                                  "max_output_tokens": 5}, timeout=60).json()
    assert first["status"] == "incomplete" and first["store"] is True
    second = httpx.post(srv.url + RESPONSES, json={"input": [{"type": "message", "role": "user", "content": "and then?"}],
                                                   "previous_response_id": first["id"], "max_output_tokens": 5},
                        timeout=60).json()
    alone = httpx.post(srv.url + RESPONSES, json={"input": [{"type": "message", "role": "user", "content": "and then?"}],
                                                  "max_output_tokens": 5}, timeout=60).json()
    # the earlier exchange is in the prompt (its instructions are not: they do not carry over)
    assert second["usage"]["input_tokens"] > alone["usage"]["input_tokens"] + 5
    assert second["previous_response_id"] == first["id"]
    got = httpx.get(srv.url + f"/v1/responses/{first['id']}").json()
    assert got["id"] == first["id"] and got["output"] == first["output"]
    missing = httpx.post(srv.url + RESPONSES, json={"input": "x", "previous_response_id": "resp_nope"})
    assert missing.status_code == 404 and "previous_response_id" in missing.json()["error"]["message"]
    unstored = httpx.post(srv.url + RESPONSES, json={"input": "x", "store": False, "max_output_tokens": 2}).json()
    assert httpx.get(srv.url + f"/v1/responses/{unstored['id']}").status_code == 404
    with httpx.stream("POST", srv.url + RESPONSES, json={"input": "x", "max_output_tokens": 3, "stream": True}) as r:
        kinds = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert kinds[-1] == "response.incomplete"  # a length stop, as the OpenAI API reports it


def test_logprobs_and_top_logprobs(srv):
    body = {"messages": USER, "max_tokens": 6, "logprobs": True, "top_logprobs": 3, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False}}
    r = httpx.post(srv.url + CHAT, json=body, timeout=60).json()
    entries = r["choices"][0]["logprobs"]["content"]
    assert len(entries) == r["usage"]["completion_tokens"] == 6
    for e in entries:  # greedy: the chosen token is the most likely one
        assert e["logprob"] <= 0 and len(e["top_logprobs"]) == 3
        assert e["top_logprobs"][0]["token"] == e["token"] and abs(e["top_logprobs"][0]["logprob"] - e["logprob"]) < 1e-6
    assert "".join(e["token"] for e in entries) == r["choices"][0]["message"]["content"]
    with httpx.stream("POST", srv.url + CHAT, json={**body, "stream": True}, timeout=60) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    streamed = [e for c in chunks for choice in c["choices"] for e in ((choice.get("logprobs") or {}).get("content") or [])]
    assert [e["token"] for e in streamed] == [e["token"] for e in entries]
    bad = httpx.post(srv.url + CHAT, json={"messages": USER, "top_logprobs": 2}, timeout=60)
    assert bad.status_code == 400 and "logprobs" in bad.json()["error"]["message"]
    assert httpx.post(srv.url + CHAT, json={"messages": USER, "logprobs": True, "top_logprobs": 21}).status_code == 400


# --- structured output ------------------------------------------------------------------------------
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
                 "required": ["answer", "sure"], "additionalProperties": False}


def _valid_answer(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"answer", "sure"} and value["answer"] in ("yes", "no") and isinstance(value["sure"], bool)


def test_structured_output_through_the_official_sdks(srv):
    """OpenAI `parse` (response_format json_schema, strict), Responses `text_format`, Anthropic `parse`
    (output_config.format): the fake model's greedy text is forced into the schema on every API."""
    from typing import Literal

    import anthropic
    import openai
    from pydantic import BaseModel

    class Answer(BaseModel):
        answer: Literal["yes", "no"]
        sure: bool

    oa = openai.OpenAI(base_url=srv.url + "/v1", api_key="x")
    chat = oa.chat.completions.parse(model="tiny", messages=USER, max_tokens=40, response_format=Answer,
                                     extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert chat.choices[0].finish_reason == "stop" and isinstance(chat.choices[0].message.parsed, Answer)
    resp = oa.responses.parse(model="tiny", input="hi", max_output_tokens=40, text_format=Answer,
                              reasoning={"effort": "minimal"})
    assert isinstance(resp.output_parsed, Answer) and resp.text.format.type == "json_schema"
    an = anthropic.Anthropic(base_url=srv.url, api_key="x")
    msg = an.messages.parse(model="tiny", max_tokens=40, messages=USER, output_format=Answer)
    assert msg.stop_reason == "end_turn" and isinstance(msg.parsed_output, Answer)


def test_structured_output_raw_shapes_and_thinking(srv):
    """json_object, Anthropic's beta output_format spelling, and a thinking model: the reasoning stays free
    and the answer after it follows the schema."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    obj = httpx.post(srv.url + CHAT, json={"messages": USER, "max_tokens": 12, "response_format": {"type": "json_object"},
                                           **off}, timeout=60).json()
    assert obj["choices"][0]["message"]["content"].startswith("{")
    beta = httpx.post(srv.url + MESSAGES, json={"messages": USER, "max_tokens": 40, "output_format": {
        "type": "json_schema", "schema": ANSWER_SCHEMA}}, timeout=60).json()
    assert _valid_answer(beta["content"][0]["text"])
    thought = httpx.post(srv.url + CHAT, json={"messages": USER, "max_tokens": 60, "thinking_budget": 6, "temperature": 0,
                                               "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA}}}, timeout=60).json()
    message = thought["choices"][0]["message"]
    assert message["reasoning_content"] and _valid_answer(message["content"])
    assert thought["usage"]["completion_tokens_details"]["reasoning_tokens"] == 6


@pytest.mark.parametrize("path,field,value", [
    (CHAT, "response_format", {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "frob"}}}),
    (CHAT, "response_format", {"type": "xml"}),
    (CHAT, "response_format", "json"),
    (RESPONSES, "text", {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object", "minProperties": "x"}}}),
    (MESSAGES, "output_config", {"format": {"type": "json_schema", "schema": {"$ref": "#/nowhere"}}}),
])
def test_structured_output_refuses_what_it_cannot_enforce(srv, path, field, value):
    r = httpx.post(srv.url + path, json={**BASES[path], field: value}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in (err.get("param") or err["message"]) and "\n" not in err["message"]
    assert srv.healthy()


def test_answer_grammar_leaves_the_tool_call_marker_open():
    """With tools, the call marker is allowed where the answer has not started, and a call ends the
    constraint; once the answer has started it is not."""
    from runtime.serve.structured import AnswerGrammar, GrammarCompiler

    tok = build_tokenizer(VOCAB)
    marker = tok.token_to_id("<tool_call>")
    compiler = GrammarCompiler(tok, VOCAB, [tok.token_to_id("<|im_end|>")])
    logits = torch.zeros(VOCAB)
    grammar = AnswerGrammar(compiler.matcher(ANSWER_SCHEMA, "response_format"), marker)
    allowed = torch.isfinite(grammar.mask(logits))
    opening = tok.token_to_id('{"')  # the compact object's forced start, in this vocabulary's own token
    assert allowed[marker] and allowed[opening] and int(allowed.sum()) == 2
    assert grammar.advance(opening) is None and not torch.isfinite(grammar.mask(logits))[marker]
    assert "breaks the schema" in grammar.advance(tok.token_to_id("}"))  # "answer" is required
    called = AnswerGrammar(compiler.matcher(ANSWER_SCHEMA, "response_format"), marker)
    assert called.advance(marker) is None and not called.active


def test_responses_logprobs(srv):
    """Responses: `top_logprobs` / include message.output_text.logprobs put the answer tokens' logprobs on the
    output_text part (after a thinking block: its tokens are not the answer's) and on each streamed delta."""
    import openai

    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    plain = client.responses.create(model="tiny", input="hi", max_output_tokens=6, top_logprobs=2, temperature=0,
                                    reasoning={"effort": "none"})
    part = plain.output[0].content[0]
    assert "".join(e.token for e in part.logprobs) == part.text and len(part.logprobs) == 6
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in part.logprobs)
    thought = httpx.post(srv.url + RESPONSES, json={"input": "hi", "max_output_tokens": 12, "thinking_budget": 3,
                                                    "include": ["message.output_text.logprobs"]}, timeout=60).json()
    message = [o for o in thought["output"] if o["type"] == "message"][0]["content"][0]
    assert "".join(e["token"] for e in message["logprobs"]) == message["text"] and message["logprobs"]
    events = list(client.responses.create(model="tiny", input="hi", max_output_tokens=6, top_logprobs=1,
                                          reasoning={"effort": "none"}, stream=True))
    final = events[-1].response  # response.incomplete: a length stop
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert "".join(streamed) == final.output_text and streamed == [e.token for e in final.output[0].content[0].logprobs]


FORECAST = {"name": "forecast", "description": "the forecast", "strict": True, "parameters": {
    "type": "object", "additionalProperties": False, "required": ["days", "unit"], "properties": {
        "days": {"type": "integer", "minimum": 1, "maximum": 14}, "unit": {"type": "string", "enum": ["c", "f"]},
        "detailed": {"type": "boolean"}, "where": {"type": "object", "properties": {"lat": {"type": "number",
                                                                                        "minimum": -90, "maximum": 90}},
                                                   "required": ["lat"], "additionalProperties": False}}}}


def _valid_forecast(args: dict) -> bool:
    return (set(args) <= {"days", "unit", "detailed", "where"} and isinstance(args["days"], int)
            and 1 <= args["days"] <= 14 and args["unit"] in ("c", "f") and isinstance(args.get("detailed", True), bool)
            and (("where" not in args) or set(args["where"]) == {"lat"}))


def test_strict_tool_grammar_accepts_valid_calls_and_rejects_the_rest():
    """The call grammar of a strict tool, fed token by token as the model would emit them: multi-line text,
    optional parameters, and a free tool's name pass; a missing required parameter, a wrong type, a value
    outside its bounds, an unknown parameter or tool are refused at the first wrong token."""
    from runtime.serve.structured import AnswerGrammar, GrammarCompiler

    tok = build_tokenizer(VOCAB)
    compiler = GrammarCompiler(tok, VOCAB, [tok.token_to_id("<|im_end|>")])
    note = {"name": "note", "strict": True, "parameters": {"type": "object", "required": ["text"], "properties": {
        "text": {"type": "string"}}}}
    tools = [{"type": "function", "function": f} for f in (FORECAST, note, WEATHER)]
    names = [t["function"]["name"] for t in tools]
    opener, closer = tok.token_to_id("<tool_call>"), tok.token_to_id("</tool_call>")

    def feed(body: str, close: bool = True) -> str | None:
        grammar = AnswerGrammar(None, opener, calls=compiler.call_matchers(tools, names, "tools"))
        ids = [opener] + tok.encode(body, add_special_tokens=False).ids + ([closer] if close else [])
        for token in ids:
            error = grammar.advance(token)
            if error:
                return error
        return None if grammar.call is None else "unfinished"

    p = lambda k, v: f"<parameter={k}>\n{v}\n</parameter>\n"  # noqa: E731
    LAT, TWO_LINES = '{"lat":-12.5}', "two\nlines </param"
    ok = [f"\n<function=forecast>\n{p('days', 3)}{p('unit', 'c')}</function>\n",
          f"\n<function=forecast>\n{p('days', 14)}{p('unit', 'f')}{p('detailed', 'true')}{p('where', LAT)}</function>\n",
          f"\n<function=note>\n{p('text', TWO_LINES)}</function>\n"]
    for body in ok:
        assert feed(body) is None, body
    assert feed("\n<function=get_weather>\n<parameter=anything>\nfree\n</parameter>\n</function>\n") is None
    bad = [f"\n<function=forecast>\n{p('unit', 'c')}</function>\n",  # days is required
           f"\n<function=forecast>\n{p('days', 'three')}{p('unit', 'c')}</function>\n",
           f"\n<function=forecast>\n{p('days', 15)}{p('unit', 'c')}</function>\n",
           f"\n<function=forecast>\n{p('days', 2)}{p('unit', 'kelvin')}</function>\n",
           f"\n<function=forecast>\n{p('days', 2)}{p('unit', 'c')}{p('color', 'red')}</function>\n",
           f"\n<function=forecast>\n{p('days', 2)}{p('unit', 'c')}{p('where', '{}')}</function>\n",
           f"\n<function=nowcast>\n{p('days', 2)}</function>\n"]
    for body in bad:
        assert "breaks the tool's schema" in (feed(body) or ""), body
    assert feed(f"\n<function=forecast>\n{p('days', 2)}{p('unit', 'c')}</function>\n", close=False) == "unfinished"
    # nested models as clients' schema generators write them: "$defs" at the root, "$ref" in a property
    place = {"name": "place", "strict": True, "parameters": {
        "type": "object", "required": ["at"], "properties": {"at": {"$ref": "#/$defs/Point"}},
        "$defs": {"Point": {"type": "object", "required": ["x"], "properties": {"x": {"type": "integer"}},
                            "additionalProperties": False}}}}
    tools, names = [{"type": "function", "function": place}], ["place"]
    good, bad = '{"x":3}', '{"y":3}'
    assert feed(f"\n<function=place>\n{p('at', good)}</function>\n") is None
    assert "breaks the tool's schema" in feed(f"\n<function=place>\n{p('at', bad)}</function>\n")


@pytest.mark.parametrize("api", [CHAT, RESPONSES, MESSAGES])
def test_strict_tool_arguments_parse_and_validate_on_every_api(eager_caller, api):
    """A model that wants a call at every step, sampled at temperature 1 (random tokens inside the call):
    with `strict` set, the call is held to the tool's schema, so its arguments always parse and validate
    (official SDKs read them)."""
    import anthropic
    import openai

    s = eager_caller
    s.engine.prefer = build_tokenizer(VOCAB).token_to_id("<tool_call>")
    schema = {k: v for k, v in FORECAST.items() if k != "strict"}
    for seed in range(3):
        if api == CHAT:
            r = openai.OpenAI(base_url=s.url + "/v1", api_key="x").chat.completions.create(
                model="tiny", messages=USER, max_tokens=200, seed=seed, temperature=1.0, parallel_tool_calls=False,
                tools=[{"type": "function", "function": FORECAST}], extra_body={"chat_template_kwargs": {"enable_thinking": False}})
            calls = [json.loads(c.function.arguments) for c in r.choices[0].message.tool_calls]
        elif api == RESPONSES:
            r = openai.OpenAI(base_url=s.url + "/v1", api_key="x").responses.create(
                model="tiny", input="hi", max_output_tokens=200, temperature=1.0, reasoning={"effort": "minimal"},
                parallel_tool_calls=False, tools=[{"type": "function", **schema, "strict": True}], extra_body={"seed": seed})
            calls = [json.loads(item.arguments) for item in r.output if item.type == "function_call"]
        else:
            r = anthropic.Anthropic(base_url=s.url, api_key="x").messages.create(
                model="tiny", max_tokens=200, messages=USER, temperature=1.0,
                tools=[{"name": "forecast", "input_schema": schema["parameters"], "strict": True}],
                tool_choice={"type": "auto", "disable_parallel_tool_use": True}, extra_body={"seed": seed})
            calls = [b.input for b in r.content if b.type == "tool_use"]
        assert len(calls) == 1 and _valid_forecast(calls[0]), calls


def test_strict_tool_schema_that_cannot_be_enforced_is_a_400_naming_the_tool(srv):
    bad = {"name": "frob", "strict": True, "parameters": {"type": "object", "properties": {"x": {"type": "frob"}}}}
    r = _chat_tools(srv, "auto", (WEATHER, bad))
    assert r.status_code == 400 and "'frob'" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "tools" and srv.healthy()


def test_strict_call_opened_inside_thinking_is_held_to_the_schema(eager_caller):
    """A model that opens a call before closing its thinking block (a drift seen in the wild): the call is
    still held to the strict tool's schema, and the client gets it as a call with valid arguments."""
    s = eager_caller
    s.engine.prefer = build_tokenizer(VOCAB).token_to_id("<tool_call>")
    for seed in range(3):
        r = httpx.post(s.url + CHAT, json={"messages": USER, "max_tokens": 200, "temperature": 1.0, "seed": seed,
                                           "parallel_tool_calls": False,
                                           "tools": [{"type": "function", "function": FORECAST}]}, timeout=60).json()
        calls = r["choices"][0]["message"]["tool_calls"]
        assert len(calls) == 1 and _valid_forecast(json.loads(calls[0]["function"]["arguments"])), r


def test_an_answer_cut_inside_a_utf8_sequence_keeps_its_last_tokens():
    """A length stop in the middle of a multi-byte character: the text ends in U+FFFD rather than losing the
    tokens, and the streamed deltas, the final text and the logprobs all agree."""
    import openai

    s = Running()
    try:
        s.engine.prefer = 104  # a lone UTF-8 continuation byte: every prefix of the answer decodes to U+FFFD
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        events = list(client.responses.create(model="tiny", input="hi", max_output_tokens=4, top_logprobs=1,
                                              temperature=0, reasoning={"effort": "none"}, stream=True))
        final = events[-1].response
        streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        tokens = [lp.token for lp in final.output[0].content[0].logprobs]
        assert final.output_text and streamed == final.output_text == "".join(tokens) and len(tokens) == 4
        chat = s.chat("hi", max_tokens=3, chat_template_kwargs={"enable_thinking": False}).json()
        assert chat["choices"][0]["message"]["content"].endswith("\ufffd") and chat["usage"]["completion_tokens"] == 3
    finally:
        s.stop()
