"""Chat-template rendering and the streaming output parser (reasoning, content, tool calls)."""

import random

import pytest

from format.tiny import CHAT_TEMPLATE
from runtime.serve.chat_template import (
    ChatTemplate,
    RequestError,
    normalize_anthropic_messages,
    normalize_anthropic_tools,
    normalize_openai_messages,
    normalize_openai_tools,
)
from runtime.serve.output_parser import OutputParser, coerce

TOOLS = normalize_openai_tools([{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "tags": {"type": "array"},
                                     "note": {"type": ["string", "null"]}}}}}])


def _run(text, pieces, **kw):
    """Feed `text` in random pieces; return (events, parser)."""
    rng = random.Random(pieces)
    parser = OutputParser(**kw)
    events, i = [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        events += parser.feed(text[i : i + n])
        i += n
    events += parser.finish()
    return events, parser


CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n"
        "</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=tags>\n['a', 'b']\n</parameter>\n"
        "<parameter=note>\nNone\n</parameter>\n</function>\n</tool_call>")


@pytest.mark.parametrize("seed", range(5))
def test_reasoning_content_and_typed_tool_call_in_any_chunking(seed):
    text = "Let me check the weather.\n</think>\n\nI'll look it up.\n\n" + CALL
    events, parser = _run(text, seed, tools=TOOLS, thinking=True)
    r = parser.result
    assert r.reasoning == "Let me check the weather.\n"
    assert r.content == "I'll look it up."
    assert len(r.tool_calls) == 1
    assert r.tool_calls[0].name == "get_weather"
    assert r.tool_calls[0].arguments == {"city": "New York", "days": 3, "metric": True, "tags": ["a", "b"], "note": None}
    streamed = "".join(e.text for e in events if e.kind == "content")
    assert streamed == r.content and "<" not in streamed


def test_tool_call_inside_thinking_ends_reasoning():
    _, parser = _run("I should call it " + CALL, 1, tools=TOOLS, thinking=True)
    assert parser.result.reasoning == "I should call it "
    assert parser.result.tool_calls and parser.result.content == ""


def test_string_parameter_keeps_digits_and_whitespace():
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\n  123\n\n</parameter>\n</function>\n</tool_call>"
    _, parser = _run(call, 2, tools=TOOLS)
    assert parser.result.tool_calls[0].arguments == {"city": "  123\n"}


def test_malformed_and_undeclared_calls_come_back_as_text():
    bad = "<tool_call>\n<function=launch_missiles>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>"
    _, parser = _run("ok " + bad, 3, tools=TOOLS)
    assert parser.result.tool_calls == [] and "launch_missiles" in parser.result.content
    # a declared tool is committed (and streamed) once its name arrives: a repeated parameter keeps its
    # first value rather than turning the whole call back into text
    dup = "<tool_call>\n<function=get_weather>\n<parameter=city>\na\n</parameter>\n<parameter=city>\nb\n</parameter>\n</function>\n</tool_call>"
    _, parser = _run(dup, 4, tools=TOOLS)
    assert [c.arguments for c in parser.result.tool_calls] == [{"city": "a"}] and parser.result.content == ""


def test_unclosed_call_at_end_is_still_parsed():
    _, parser = _run(CALL[: -len("</tool_call>")], 5, tools=TOOLS)
    assert parser.result.tool_calls and parser.result.tool_calls[0].arguments["days"] == 3


def test_hermes_json_fallback():
    _, parser = _run('<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>', 6, tools=TOOLS)
    assert parser.result.tool_calls[0].arguments == {"city": "Oslo"}


def test_no_tools_declared_means_text():
    _, parser = _run(CALL, 7)
    assert parser.result.tool_calls == [] and parser.result.content.startswith("<tool_call>")


@pytest.mark.parametrize("seed", range(3))
def test_stop_strings_are_held_back_and_cut(seed):
    events, parser = _run("alpha beta STOP gamma", seed, stop=["STOP"])
    assert parser.result.content == "alpha beta" and parser.result.stopped_by == "STOP"
    assert "".join(e.text for e in events) == "alpha beta"


def test_length_stop_inside_thinking_leaves_all_reasoning():
    _, parser = _run("still thinking about it", 8, thinking=True)
    assert parser.result.reasoning == "still thinking about it" and parser.result.content == ""


@pytest.mark.parametrize("raw,schema,want", [
    ("42", {"type": "integer"}, 42), ("4.5", {"type": "number"}, 4.5), ("FALSE", {"type": "boolean"}, False),
    ('{"a": 1}', {"type": "object"}, {"a": 1}), ("{'a': True}", {"type": "object"}, {"a": True}),
    ("abc", {"type": "integer"}, "abc"), ("007", {"type": "string"}, "007"), ("[1, 2]", None, [1, 2]),
    ("hello", None, "hello"), ("null", {"type": ["integer", "null"]}, None),
])
def test_coerce(raw, schema, want):
    assert coerce(raw, schema) == want


def test_render_openai_and_anthropic_conversations_identically():
    t = ChatTemplate(CHAT_TEMPLATE)
    openai = normalize_openai_messages([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Oslo?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    ])
    anthropic = normalize_anthropic_messages("Be brief.", [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "get_weather", "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "rain"}]},
    ])
    a_tools = normalize_anthropic_tools([{"name": "get_weather", "description": "",
                                          "input_schema": TOOLS[0]["function"]["parameters"]}])
    one = t.render(openai, TOOLS, enable_thinking=False)
    assert one == t.render(anthropic, a_tools, enable_thinking=False)
    assert "<tool_response>\nrain\n</tool_response>" in one and one.endswith("<think>\n\n</think>\n\n")
    assert t.render(openai, TOOLS, enable_thinking=True).endswith("<|im_start|>assistant\n<think>\n")


@pytest.mark.parametrize("messages,match", [
    ([], "non-empty"),
    ([{"role": "wizard", "content": "a"}], "unknown role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "vision_disabled"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}], "not valid JSON"),
])
def test_bad_conversations_get_request_errors(messages, match):
    t = ChatTemplate(CHAT_TEMPLATE)
    with pytest.raises(RequestError, match=match):
        t.render(normalize_openai_messages(messages))


def test_system_messages_fold_into_one_first():
    """Every system / developer message (Responses instructions + developer items, Anthropic system entries,
    late reminders) folds into the one system message the template accepts at the start."""
    from runtime.serve.chat_template import normalize_anthropic_messages, normalize_responses_input

    t = ChatTemplate(CHAT_TEMPLATE)
    with pytest.raises(RequestError, match="System message must be at the beginning"):
        t.render([{"role": "user", "content": "a"}, {"role": "system", "content": "late"}])
    msgs = normalize_openai_messages([{"role": "developer", "content": "d1"}, {"role": "system", "content": "s2"},
                                      {"role": "user", "content": "a"}, {"role": "system", "content": "late"}])
    assert msgs == [{"role": "system", "content": "d1\n\ns2\n\nlate"}, {"role": "user", "content": "a"}]
    t.render(msgs)
    codex = normalize_responses_input("be brief", [{"type": "message", "role": "developer", "content": "rules"},
                                                   {"type": "message", "role": "developer", "content": "more"},
                                                   {"type": "message", "role": "user", "content": "hi"}])
    assert codex[0] == {"role": "system", "content": "be brief\n\nrules\n\nmore"} and len(codex) == 2
    claude = normalize_anthropic_messages("sys", [{"role": "user", "content": "hi"},
                                                  {"role": "system", "content": "reminder"}])
    assert claude == [{"role": "system", "content": "sys\n\nreminder"}, {"role": "user", "content": "hi"}]
    t.render(codex)
    t.render(claude)


def test_tools_the_model_cannot_call_are_left_out():
    tools = normalize_openai_tools([{"type": "web_search"}, {"type": "local_shell"}, {"type": "custom", "name": "x"},
                                    {"type": "namespace", "name": "ns", "tools": [
                                        {"type": "function", "name": "inner", "parameters": {"type": "object"}}]},
                                    {"type": "function", "name": "outer"}])
    assert [x["function"]["name"] for x in tools] == ["inner", "outer"]
    assert normalize_openai_tools([{"type": "web_search"}]) is None
    with pytest.raises(RequestError, match=r"tools\[0\] must be"):
        normalize_openai_tools([{"type": "function", "function": {"name": 5}}])


def test_reasoning_dropped_before_last_query_unless_preserved():
    t = ChatTemplate(CHAT_TEMPLATE)
    msgs = normalize_openai_messages([
        {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "user", "content": "q2"}])
    assert "r1" not in t.render(msgs)
    assert "<think>\nr1\n</think>\n\na1" in t.render(msgs, preserve_thinking=True)


def test_arguments_stream_while_the_call_arrives():
    """Deltas start before </tool_call>: a long string value streams character by character, and the
    concatenated deltas equal the final arguments JSON for any split of the text."""
    import random

    long_text = "line one\nline \"two\"\n" * 5
    call = (f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{long_text}\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    rng = random.Random(0)
    for _ in range(50):
        p = OutputParser(tools=TOOLS)
        events, i, before_close = [], 0, 0
        while i < len(call):
            n = rng.randint(1, 7)
            new = p.feed(call[i : i + n])
            i += n
            if i < len(call) - len("</tool_call>"):
                before_close += sum(1 for e in new if e.kind == "tool_call_delta")
            events += new
        events += p.finish()
        kinds = [e.kind for e in events]
        assert kinds[0] == "tool_call_begin" and kinds[-1] == "tool_call"
        final = events[-1].call
        assert "".join(e.text for e in events if e.kind == "tool_call_delta") == final.arguments_json
        assert final.arguments == {"city": long_text, "days": 3}
        assert before_close >= 3  # the value arrived in pieces, not in one block at the end


def test_streamed_text_decodes_a_window_not_the_whole_answer():
    """Generation._new_text: token by token the streamed text is the whole answer's decode (multi-byte
    characters split over tokens wait for their last byte, special tokens are kept), while each call decodes
    only the last shown tokens and the new one."""
    from types import SimpleNamespace

    from format.tiny import build_tokenizer
    from runtime.serve.app import Generation

    tok = build_tokenizer(400)
    ids = tok.encode("Grüße — 日本語 ok 🙂🙂 <think>x</think> done. " * 3).ids
    lengths = []

    class Counting:
        def decode(self, part, skip_special_tokens=False):
            lengths.append(len(part))
            return tok.decode(part, skip_special_tokens=skip_special_tokens)

    gen = SimpleNamespace(server=SimpleNamespace(tokenizer=Counting()), ids=[], text="", window_start=0, shown=0)
    waited = 0
    for i in ids:
        gen.ids.append(i)
        delta = Generation._new_text(gen)
        if delta is None:
            waited += 1
            continue
        assert gen.text == tok.decode(gen.ids, skip_special_tokens=False)
    assert waited  # the emoji and CJK bytes span tokens in this small vocabulary
    assert gen.text == tok.decode(ids, skip_special_tokens=False)
    assert max(lengths) < 12 < len(ids)  # windows, never the whole answer
