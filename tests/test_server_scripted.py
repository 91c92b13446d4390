"""Wire shapes of reasoning and tool calls for all three APIs, checked with the official SDKs.

A random tiny model never emits a tool call, so here the scheduler is replaced by one that plays
back a scripted completion token by token through the same callbacks the engine's scheduler uses.
"""

import json
import threading
import time

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from format.tiny import CHAT_TEMPLATE, build_tokenizer  # noqa: E402
from runtime.serve.app import Server, ServerConfig, build_app  # noqa: E402
from runtime.serve.chat_template import ChatTemplate  # noqa: E402

from .serving import Loopback  # noqa: E402

SCRIPT = ("The user wants weather.\n</think>\n\nChecking now.\n\n<tool_call>\n<function=get_weather>\n"
          "<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
TOOL = {"name": "get_weather", "description": "weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}


class ScriptedScheduler:
    def __init__(self, tokenizer, text):
        self.ids = tokenizer.encode(text, add_special_tokens=False).ids
        self.active_lanes = self.queue_depth = 0
        self.stats = {"generated_tokens": 0, "rejected_queue_full": 0}

    def submit(self, request):
        def play():
            for t in self.ids[: request.max_tokens]:
                if request.cancelled:
                    return request.on_done("cancelled", None)
                request.on_token(t)
                time.sleep(0.001)
            request.on_done("stop" if len(self.ids) <= request.max_tokens else "length", None)

        threading.Thread(target=play, daemon=True).start()

    def cancel(self, request):
        request.cancelled = True


@pytest.fixture(scope="module")
def url():
    tok = build_tokenizer(384)
    server = Server(None, tok, ChatTemplate(CHAT_TEMPLATE), ServerConfig("tiny", 4096), {tok.token_to_id("<|im_end|>")},
                    ScriptedScheduler(tok, SCRIPT))
    loopback = Loopback(build_app(server))
    yield loopback.url
    loopback.stop()


def test_chat_completions_tool_call(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    kw = dict(model="tiny", messages=[{"role": "user", "content": "weather in Oslo?"}],
              tools=[{"type": "function", "function": TOOL}], max_tokens=500)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking now."
    assert choice.message.model_extra["reasoning_content"] == "The user wants weather.\n"
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo", "days": 2}
    chunks = list(client.chat.completions.create(stream=True, **kw))
    args = "".join(tc.function.arguments or "" for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or []))
    names = [tc.function.name for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or []) if tc.function.name]
    assert names == ["get_weather"] and json.loads(args) == {"city": "Oslo", "days": 2}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks if c.choices)
    assert reasoning == "The user wants weather.\n"


def test_anthropic_thinking_text_and_tool_use_blocks(url):
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    kw = dict(model="tiny", max_tokens=500, thinking={"type": "enabled", "budget_tokens": 100},
              tools=[{"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}],
              messages=[{"role": "user", "content": "weather in Oslo?"}])
    msg = client.messages.create(**kw)
    assert [b.type for b in msg.content] == ["thinking", "text", "tool_use"] and msg.stop_reason == "tool_use"
    assert msg.content[2].input == {"city": "Oslo", "days": 2}
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "The user wants weather.\n" and final.content[1].text == "Checking now."
    assert final.content[2].input == {"city": "Oslo", "days": 2} and final.stop_reason == "tool_use"


def test_responses_reasoning_message_and_function_call(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    kw = dict(model="tiny", input="weather in Oslo?", tools=[{"type": "function", **TOOL}], max_output_tokens=500)
    r = client.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    assert r.output_text == "Checking now." and json.loads(r.output[2].arguments) == {"city": "Oslo", "days": 2}
    with client.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Checking now."


def test_length_stop_reports_incomplete(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    resp = client.responses.create(model="tiny", input="x", max_output_tokens=3)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
