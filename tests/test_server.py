"""The real server on loopback with a tiny converted model on CPU, driven by the official SDKs."""

import concurrent.futures
import json
import time

import httpx
import pytest

pytest.importorskip("triton")
openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from format.convert import ConvertOptions, convert_checkpoint  # noqa: E402
from runtime.memory_plan import PlanOptions  # noqa: E402
from runtime.serve.launch import build_server  # noqa: E402
from .serving import Loopback  # noqa: E402

DEVICE = "cpu"


class _Server:
    def __init__(self, artifact, lanes, max_pending=8, max_context=256, pending_timeout_ms=0, **plan):
        import tempfile

        self.log = tempfile.mktemp(suffix=".jsonl")
        app, _ = build_server(artifact, PlanOptions(max_context=max_context, max_concurrency=lanes, prefill_chunk=128, **plan),
                              device=DEVICE, model_id="tiny", max_pending=max_pending, pending_timeout_ms=pending_timeout_ms,
                              request_log=self.log)
        self.loopback = Loopback(app)
        self.url = self.loopback.url

    def stop(self):
        self.loopback.stop()


@pytest.fixture(scope="module")
def artifact(tiny_with_mtp, tmp_path_factory):
    from format.tiny import write_tiny_dflash2

    d = tmp_path_factory.mktemp("serve")
    drafter = write_tiny_dflash2(d / "drafter", tiny_with_mtp, seed=2)
    return convert_checkpoint(tiny_with_mtp, d / "tiny.nfer", ConvertOptions(recipe="q4", dflash2=drafter)).output


@pytest.fixture(scope="module")
def server(artifact):
    s = _Server(artifact, lanes=2)
    yield s
    s.stop()


def _oa(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def test_health_models_metrics(server):
    import re

    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert [m.id for m in _oa(server).models.list()] == ["tiny"]

    def counted() -> dict[str, int]:
        text = httpx.get(server.url + "/metrics").text
        assert "ninfer_requests_total" in text
        return {name: int(float(re.search(rf"^ninfer_{name}_total (\S+)", text, re.M).group(1)))
                for name in ("decode_steps", "decode_step_rows", "decode_tokens", "prefill_tokens", "generated_tokens",
                             "prefix_reused_tokens")}

    before = counted()
    r = _oa(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "count these"}],
                                            max_tokens=5, temperature=0, extra_body=NO_THINK)
    after = {k: v - before[k] for k, v in counted().items()}
    assert after["prefill_tokens"] + after["prefix_reused_tokens"] == r.usage.prompt_tokens
    assert after["generated_tokens"] == r.usage.completion_tokens
    # the first token comes from the prefill, each later one from a decode step of this one lane (one row a step;
    # a chained step past a stop may add one)
    assert r.usage.completion_tokens - 1 <= after["decode_steps"] == after["decode_step_rows"] <= r.usage.completion_tokens
    assert after["decode_tokens"] == after["decode_step_rows"]
    text = httpx.get(server.url + "/metrics").text  # (no CUDA graphs on a CPU)
    assert re.search(r"^ninfer_cuda_graphs 0\.0$", text, re.M)
    assert re.search(r"^ninfer_graphs_captured_serving_total 0\.0$", text, re.M)


def test_openai_chat_nonstream_and_stream_agree(server):
    client = _oa(server)
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hello there"}], max_tokens=3, temperature=0,
              extra_body=NO_THINK)
    full = client.chat.completions.create(**kw)
    assert full.choices[0].finish_reason in ("length", "stop")
    assert full.usage.completion_tokens <= 3 and full.usage.prompt_tokens > 0
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (full.choices[0].message.content or "")
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_openai_responses_nonstream_and_stream(server):
    client = _oa(server)
    kw = dict(model="tiny", input="hello", instructions="be brief", max_output_tokens=3, temperature=0,
              reasoning={"effort": "none"})
    full = client.responses.create(**kw)
    assert full.status in ("completed", "incomplete") and full.usage.output_tokens <= 3
    events = list(client.responses.create(stream=True, **kw))
    last = "response.incomplete" if full.status == "incomplete" else "response.completed"  # as the OpenAI API ends them
    assert events[0].type == "response.created" and events[-1].type == last
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == full.output_text == events[-1].response.output_text
    if full.status == "completed":  # the SDK's helper waits for response.completed
        with client.responses.stream(**kw) as stream:
            assert stream.get_final_response().output_text == full.output_text


def test_thinking_output_is_reasoning(server):
    r = _oa(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "think"}], max_tokens=3,
                                            temperature=0)
    assert r.model_extra.get("reasoning_content") or r.choices[0].message.model_extra.get("reasoning_content")


def test_anthropic_messages_and_stream(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    kw = dict(model="tiny", max_tokens=3, messages=[{"role": "user", "content": "hi"}], system="be brief", temperature=0)
    msg = client.messages.create(**kw)
    assert msg.role == "assistant" and msg.stop_reason in ("max_tokens", "end_turn")
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == [b.type for b in msg.content]
    assert final.usage.output_tokens == msg.usage.output_tokens
    count = client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "hi"}], system="be brief")
    assert count.input_tokens == msg.usage.input_tokens
    with open(server.log) as f:
        records = [json.loads(line) for line in f]
    assert records and {"prompt_tokens", "completion_tokens", "finish_reason"} <= set(records[-1])


@pytest.mark.parametrize("path,body,status,text", [
    ("/v1/chat/completions", "{not json", 400, "not valid JSON"),
    ("/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "not served here"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]}, 400, "vision_disabled"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 400}]}, 400, "--max-context"),
    ("/v1/chat/completions", {"messages": "nope"}, 400, "messages: Input should be a valid list"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature: Input should be a valid number"),
    ("/v1/messages", {"messages": [{"role": "user", "content": "x"}]}, 400, "max_tokens is required"),
])
def test_malformed_requests_get_api_shaped_errors(server, path, body, status, text):
    data = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(server.url + path, content=data, headers={"content-type": "application/json"})
    assert r.status_code == status
    payload = r.json()
    err = payload["error"]
    assert text in err["message"]
    if path.startswith("/v1/messages"):
        assert payload["type"] == "error"
    assert httpx.get(server.url + "/health").status_code == 200


def test_concurrent_clients_get_their_own_tokens(server):
    client = _oa(server)
    prompts = ["alpha beta", "the quick brown fox", "def add(a, b):"]

    def ask(p):
        r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}], max_tokens=3,
                                           temperature=0, extra_body=NO_THINK)
        return r.choices[0].message.content

    alone = [ask(p) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        together = list(pool.map(ask, prompts))
    assert together == alone


@pytest.mark.parametrize("method", ["mtp", "dflash2"])
def test_speculative_server_answers_like_the_plain_one(server, artifact, method):
    """--spec mtp|dflash2: two lanes speculate in one batched round; greedy text equals the plain server's."""
    prompts = ["alpha beta", "def add(a, b):"]

    def ask(srv, p):
        r = _oa(srv).chat.completions.create(model="tiny", messages=[{"role": "user", "content": p}], max_tokens=6,
                                             temperature=0, extra_body=NO_THINK)
        return r.choices[0].message.content, r.usage.completion_tokens

    plain = [ask(server, p) for p in prompts]
    spec = _Server(artifact, lanes=2, spec=method, draft_tokens=2)
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            together = list(pool.map(lambda p: ask(spec, p), prompts))
        assert together == plain
        metrics = httpx.get(spec.url + "/metrics").text
        rounds = float(next(line.split()[-1] for line in metrics.splitlines() if line.startswith("ninfer_spec_rounds_total")))
        assert rounds > 0 and 'ninfer_spec_accepted_at_position_total{position="2"}' in metrics
        timings = httpx.post(spec.url + "/v1/chat/completions", timeout=600, json={
            "messages": [{"role": "user", "content": prompts[0]}], "max_tokens": 6, "temperature": 0, **NO_THINK}).json()["timings"]
        assert timings["draft_n"] > 0 and 0 <= timings["draft_n_accepted"] <= timings["draft_n"]  # per request
    finally:
        spec.stop()


@pytest.fixture
def slow_decode(monkeypatch):
    """Decode steps of >= 20 ms: a tiny model on the CPU's torch path decodes in about a millisecond, faster than
    the tests' clients can queue behind it, so the tests that need a busy lane make it slow."""
    from runtime.engine import Engine

    decode_step = Engine.decode_step

    def slow_step(self, *args, **kwargs):
        time.sleep(0.02)
        return decode_step(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "decode_step", slow_step)


def test_overload_gives_429_and_loses_nothing(artifact, slow_decode):
    s = _Server(artifact, lanes=1, max_pending=1)
    try:
        client = _oa(s)

        def ask(i, tokens=2):
            try:
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"req {i}"}],
                                               max_tokens=tokens, temperature=0, extra_body=NO_THINK)
                return "ok"
            except openai.RateLimitError as e:
                assert "overloaded" in str(e)
                return "429"

        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            first = pool.submit(ask, 0, 12)  # holds the only lane for a while
            deadline = time.time() + 60
            while httpx.get(s.url + "/health").json()["active_lanes"] == 0 and time.time() < deadline:
                time.sleep(0.02)
            burst = list(pool.map(ask, range(1, 5)))
            assert first.result() == "ok"
        assert burst.count("ok") == 1 and burst.count("429") == 3  # one queued slot, the rest refused at once
        assert ask(99) == "ok"  # and the server keeps serving
    finally:
        s.stop()


def test_client_disconnect_frees_the_lane(server):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "tell me a long story"}], "max_tokens": 200,
            "stream": True, "chat_template_kwargs": {"enable_thinking": False}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        next(r.iter_lines())  # the role chunk: the request holds a lane now
    deadline = time.time() + 60
    while httpx.get(server.url + "/health").json()["active_lanes"] and time.time() < deadline:
        time.sleep(0.2)
    assert httpx.get(server.url + "/health").json()["active_lanes"] == 0


def test_queue_timeout_gives_503(artifact, slow_decode):
    s = _Server(artifact, lanes=1, max_pending=4, pending_timeout_ms=1)
    try:
        def ask(i):
            r = httpx.post(s.url + "/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 2,
                "chat_template_kwargs": {"enable_thinking": False}})
            return r.status_code, r.json()

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            results = list(pool.map(ask, range(3)))
        codes = sorted(c for c, _ in results)
        assert codes[0] == 200 and 503 in codes
        assert all("timed out" in j["error"]["message"] for c, j in results if c == 503)
    finally:
        s.stop()


def test_thinking_conversation_resumes_at_the_turn_checkpoint(artifact):
    """With thinking on, the next turn drops the previous reply's reasoning from the prompt, so the lane's
    history is no longer a prefix; the turn checkpoint still saves recomputing everything before it."""
    import re

    srv = _Server(artifact, lanes=1)
    try:
        client = _oa(srv)

        def reused():
            text = httpx.get(srv.url + "/metrics").text
            return int(re.search(r"^ninfer_prefix_reused_tokens_total (\d+)", text, re.M).group(1))

        history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}]
        r1 = client.chat.completions.create(model="tiny", messages=history, max_tokens=4, temperature=0)
        before = reused()
        history += [{"role": "assistant", "content": r1.choices[0].message.content or "ok"},
                    {"role": "user", "content": "and then?"}]
        r2 = client.chat.completions.create(model="tiny", messages=history, max_tokens=2, temperature=0)
        assert r2.choices[0].finish_reason in ("length", "stop")
        assert reused() - before >= 8  # at least the system turn and the first user turn
    finally:
        srv.stop()


def test_chained_decode_answers_like_step_by_step(artifact, monkeypatch):
    """Chained decode (each step launched before the host reads the previous one's tokens, picked on the
    device) gives every client the tokens the step-by-step scheduler gives: greedy and seeded sampling
    side by side, lanes ending at different lengths; the next turn still reuses the lane's prefix."""
    import runtime.serve.launch as launch
    import runtime.serve.scheduler as scheduler_module
    from runtime.engine import UNKNOWN_TOKEN

    made = []

    class Recorded(scheduler_module.Scheduler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(launch, "Scheduler", Recorded)
    asks = [("alpha beta", 0, None, 9), ("the quick brown fox", 0.8, 1234, 12), ("def add(a, b):", 0, None, 5)]

    def answers(chain: bool):
        monkeypatch.setattr(scheduler_module, "DECODE_CHAIN", chain)
        srv = _Server(artifact, lanes=3)
        try:
            client = _oa(srv)

            def ask(spec):
                prompt, temperature, seed, n = spec
                r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                   max_tokens=n, temperature=temperature, seed=seed, extra_body=NO_THINK)
                return r.choices[0].message.content, r.usage.completion_tokens

            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                together = list(pool.map(ask, asks))
            history = [{"role": "user", "content": "the quick brown fox"}]
            first = client.chat.completions.create(model="tiny", messages=history, max_tokens=6, temperature=0,
                                                   extra_body=NO_THINK)
            history += [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "and then?"}]
            second = client.chat.completions.create(model="tiny", messages=history, max_tokens=3, temperature=0,
                                                    extra_body=NO_THINK)
            # the host learnt every token a chained step fed (prefix reuse compares them with the next prompt)
            assert all(UNKNOWN_TOKEN not in held for held in made[-1].engine.lane_tokens)
            return together, second.usage.prompt_tokens_details.cached_tokens, made[-1].stats["chained_steps"]
        finally:
            srv.stop()

    chained, chained_reuse, steps = answers(True)
    plain, plain_reuse, no_steps = answers(False)
    assert chained == plain
    assert steps > 0 and no_steps == 0
    assert chained_reuse >= plain_reuse > 0


def test_start_up_warm_up_builds_the_grammar_tokenizer(artifact, monkeypatch):
    """build_server's warm-up builds the tokenizer llguidance needs (~1 s at 248K tokens) before serving, not inside
    the first request with a schema; --no-warm-up leaves it to that request."""
    from runtime.serve.structured import GrammarCompiler

    built = []
    real = GrammarCompiler._llm_tokenizer
    monkeypatch.setattr(GrammarCompiler, "_llm_tokenizer", lambda self: built.append(self) or real(self))
    for warm in (True, False):
        built.clear()
        build_server(artifact, PlanOptions(max_context=256, prefill_chunk=128), device=DEVICE, warm_up=warm)
        assert len(built) == warm and (not warm or built[0]._lltok is not None)


def test_a_failed_warm_up_leaves_the_server_serving(artifact, monkeypatch, capfd):
    """A warm-up that stops (GPU memory short for the graphs, say) is named in one line and the server still starts,
    capturing the graphs left on first use."""
    import runtime.serve.launch as launch
    from runtime.engine import Engine

    class Stopping(Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.use_graphs = True  # as on a GPU; warm_up is the one that stops

        def warm_up(self):
            self.use_graphs = False
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    monkeypatch.setattr(launch, "Engine", Stopping)
    app, summary = build_server(artifact, PlanOptions(max_context=256, prefill_chunk=128), device=DEVICE)
    err = capfd.readouterr().err
    assert "warm-up stopped (RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB)" in err
    assert "more detail" not in err and "CUDA graphs captured" not in summary
    lb = Loopback(app)
    try:
        r = httpx.post(lb.url + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}]}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        lb.stop()
