"""Streaming parser for Qwen3.5 output: reasoning, answer text and qwen3_coder XML tool calls.

Text arrives in arbitrary pieces (detokenized deltas). The parser holds back any tail that could
still become a marker (`</think>`, `<tool_call>`, a stop string) or trailing whitespace, so no
markup ever leaks into the reasoning or content streams. A `<tool_call>` inside thinking ends the
reasoning implicitly (the model sometimes calls without closing `</think>`). Parameter values are
typed by the tool's JSON schema; a block that does not parse is returned as text, never dropped.
Hermes JSON calls (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) are accepted too.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field

THINK_END = "</think>"
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_FUNCTION_OPEN = re.compile(r"<function=([^>\n]+)>")
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)
_PARAM_OPEN = re.compile(r"<parameter=([^>\n]+)>")
PARAM_CLOSE = "</parameter>"
_NAME = re.compile(r"[A-Za-z0-9_.:-]+")


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: dict

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class Event:
    """kind: "reasoning" | "content" | "tool_call_begin" (id and name known) | "tool_call_delta" (`text`
    is the next piece of the arguments JSON) | "tool_call" (the call is complete; its arguments_json
    equals the concatenated deltas)."""

    kind: str
    text: str = ""
    call: ToolCall | None = None


@dataclass
class _CallStream:
    """Progress through one qwen3_coder block while it is still arriving."""

    call: ToolCall | None = None
    pos: int = 0  # scan position in the block
    param: str | None = None  # the parameter being read
    value_start: int = 0
    streamed: int = 0  # block index up to which a string value has been sent
    as_string: bool = False
    skip: bool = False  # a repeated parameter: the first one wins
    first: bool = True
    args: dict = field(default_factory=dict)


@dataclass
class ParsedOutput:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    stopped_by: str | None = None  # the stop string that ended generation, if any


def _types(schema) -> list[str]:
    t = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    if isinstance(t, str):
        return [t]
    if isinstance(schema, dict) and isinstance(schema.get("anyOf"), list):
        return [x for s in schema["anyOf"] for x in _types(s)]
    return []


def _literal(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(text)  # Python reprs the template writes: True, None, 1.0, {'a': 1}
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        raise ValueError(text) from None


def _is_text(schema) -> bool:
    """Values that `coerce` keeps as raw text (and that can therefore stream character by character)."""
    types = _types(schema)
    return "string" in types or (not types and isinstance(schema, dict) and "enum" in schema)


def _partial_suffix(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def coerce(raw: str, schema) -> object:
    """Type one parameter value by its JSON schema; values that do not fit stay strings."""
    types = _types(schema)
    s = raw.strip()
    if "null" in types and s in ("null", "None"):
        return None
    if "string" in types or (not types and schema is not None and isinstance(schema, dict) and "enum" in schema):
        return raw
    for t in types:
        try:
            if t == "integer" and re.fullmatch(r"[-+]?\d+", s):
                return int(s)
            if t == "number":
                v = float(s)
                return int(v) if re.fullmatch(r"[-+]?\d+", s) else v
            if t == "boolean" and s.lower() in ("true", "false"):
                return s.lower() == "true"
            if t in ("object", "array"):
                v = _literal(s)
                if isinstance(v, dict if t == "object" else (list, tuple)):
                    return list(v) if isinstance(v, tuple) else v
        except ValueError:
            continue
    if types:
        return raw
    try:  # undeclared parameter: the most specific literal, else the text
        return _literal(s)
    except ValueError:
        return raw


class OutputParser:
    def __init__(self, tools: list[dict] | None = None, thinking: bool = False, stop: list[str] | None = None):
        self.state = "reasoning" if thinking else "content"
        self.buffer = ""
        self.schemas = {}
        for t in tools or []:
            fn = t.get("function", t)
            self.schemas[fn["name"]] = (fn.get("parameters") or {}).get("properties") or {}
        self.tools_declared = bool(tools)
        self.stop = [s for s in (stop or []) if s]
        self.calls: list[ToolCall] = []
        self.result = ParsedOutput()
        self.strip_leading = False  # after </think>, the answer's leading whitespace is framing
        self.done = False
        self.stream = _CallStream()

    # --- public ------------------------------------------------------------------------

    def feed(self, text: str) -> list[Event]:
        if self.done:
            return []
        self.buffer += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        if self.done:
            return []
        events = self._drain(final=True)
        self.done = True
        return events

    # --- internals ----------------------------------------------------------------------

    def _markers(self) -> list[str]:
        if self.state == "reasoning":
            return [THINK_END, CALL_OPEN] + self.stop
        if self.state == "content":
            return [CALL_OPEN] + self.stop
        return [CALL_CLOSE]

    def _emit(self, kind: str, text: str, events: list[Event]) -> None:
        if kind == "content" and self.strip_leading:
            text = text.lstrip()
            if text:
                self.strip_leading = False
        if not text:
            return
        if kind == "reasoning":
            self.result.reasoning += text
        else:
            self.result.content += text
        if events and events[-1].kind == kind:
            events[-1].text += text
        else:
            events.append(Event(kind, text))

    def _drain(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while not self.done:
            markers = self._markers()
            hits = [(self.buffer.find(m), m) for m in markers]
            hits = [(i, m) for i, m in hits if i >= 0]
            if self.state == "tool":
                if hits:
                    i, _ = min(hits)
                    block = self.buffer[:i]
                    self.buffer = self.buffer[i + len(CALL_CLOSE):]
                    self._advance_call(block, CALL_CLOSE, True, events)
                    self.state = "content"
                    continue
                if final:  # never closed: finish what is there, or give it back as text
                    block, self.buffer = self.buffer, ""
                    self._advance_call(block, "", True, events)
                    self.state = "content"
                    continue
                self._advance_call(self.buffer, "", False, events)
                return events
            if hits:
                i, marker = min(hits, key=lambda h: (h[0], -len(h[1])))
                before = self.buffer[:i]
                # whitespace between the answer and a call or a stop string is framing, not content
                self._emit(self.state, before.rstrip() if self.state == "content" else before, events)
                self.buffer = self.buffer[i + len(marker):]
                if marker in self.stop:
                    self.result.stopped_by = marker
                    self.buffer = ""
                    self.done = True
                    return events
                if marker == THINK_END:
                    self.state, self.strip_leading = "content", True
                else:  # <tool_call>, also inside reasoning
                    self.state = "tool"
                    self.stream = _CallStream()
                continue
            keep = 0 if final else self._hold_back(markers)
            text, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
            self._emit(self.state, text.rstrip() if final and self.state == "content" else text, events)
            return events
        return events

    def _hold_back(self, markers: list[str]) -> int:
        """Length of the buffer tail that might still grow into a marker (or is whitespace before one)."""
        keep = 0
        for m in markers:
            for k in range(min(len(m) - 1, len(self.buffer)), 0, -1):
                if self.buffer.endswith(m[:k]):
                    keep = max(keep, k)
                    break
        if self.state == "content":  # also the whitespace just before it (framing if a marker follows)
            while keep < len(self.buffer) and self.buffer[len(self.buffer) - keep - 1].isspace():
                keep += 1
        return keep

    def _advance_call(self, block: str, closer: str, closed: bool, events: list[Event]) -> None:
        """Stream a qwen3_coder call as it arrives: begin once `<function=NAME>` names a declared tool,
        then arguments JSON pieces (string values character by character, others when their parameter
        closes). Other blocks (Hermes JSON, unknown tools, garbage) are decided when they close."""
        st = self.stream
        if st.call is None:
            m = _FUNCTION_OPEN.search(block)
            name = m.group(1).strip() if m else None
            if m is None or not block[: m.start()].strip() == "" or name not in self.schemas \
                    or not _NAME.fullmatch(name):
                if closed:
                    self._close_whole(block, closer, events)
                return
            st.call = ToolCall(len(self.calls), f"call_{uuid.uuid4().hex[:24]}", name, {})
            st.pos = m.end()
            events.append(Event("tool_call_begin", call=st.call))
        schema = self.schemas.get(st.call.name, {})

        def piece(text: str) -> None:
            if events and events[-1].kind == "tool_call_delta":
                events[-1].text += text
            else:
                events.append(Event("tool_call_delta", text, st.call))

        while True:
            if st.param is None:
                m = _PARAM_OPEN.search(block, st.pos)
                if m is None or (m.end() >= len(block) and not closed):
                    break  # no parameter yet, or not yet known whether a newline follows its tag
                start = m.end() + (1 if block.startswith("\n", m.end()) else 0)
                st.param, st.value_start, st.streamed, st.pos = m.group(1).strip(), start, start, start
                st.as_string = _is_text(schema.get(st.param))
                st.skip = st.param in st.args
                if not st.skip:
                    piece(("{" if st.first else ", ") + json.dumps(st.param, ensure_ascii=False) + ": "
                          + ('"' if st.as_string else ""))
                    st.first = False
            end = block.find(PARAM_CLOSE, st.pos)
            if end < 0 and not closed:
                if st.as_string and not st.skip:  # stream what can no longer become the closing tag
                    safe = len(block) - _partial_suffix(block, PARAM_CLOSE)
                    if safe > st.streamed and block[safe - 1] == "\n":
                        safe -= 1  # a newline right before </parameter> is framing
                    if safe > st.streamed:
                        piece(json.dumps(block[st.streamed:safe], ensure_ascii=False)[1:-1])
                        st.streamed = safe
                break
            stop = len(block) if end < 0 else end
            raw = block[st.value_start:stop]
            if raw.endswith("\n"):
                raw = raw[:-1]
            if not st.skip:
                value = coerce(raw, schema.get(st.param))
                if st.as_string:
                    piece(json.dumps(raw[st.streamed - st.value_start:], ensure_ascii=False)[1:-1] + '"')
                else:
                    piece(json.dumps(value, ensure_ascii=False))
                st.args[st.param] = value
            st.param, st.pos = None, (stop + len(PARAM_CLOSE) if end >= 0 else len(block))
            if end < 0:
                break
        if closed:
            piece("{}" if st.first else "}")
            st.call.arguments = st.args
            self.calls.append(st.call)
            self.result.tool_calls.append(st.call)
            events.append(Event("tool_call", call=st.call))
            self.stream = _CallStream()

    def _close_whole(self, block: str, closer: str, events: list[Event]) -> None:
        call = self._parse_block(block)
        if call is None:  # not a call we can trust: the text goes back to the answer verbatim
            self._emit("content", CALL_OPEN + block + closer, events)
            return
        self.calls.append(call)
        self.result.tool_calls.append(call)
        events.append(Event("tool_call_begin", call=call))
        events.append(Event("tool_call_delta", call.arguments_json, call))
        events.append(Event("tool_call", call=call))

    def _parse_block(self, block: str) -> ToolCall | None:
        body = block.strip()
        name, args = None, None
        if body.startswith("{"):  # Hermes JSON
            try:
                obj = json.loads(body)
            except json.JSONDecodeError:
                return None
            if isinstance(obj, dict) and isinstance(obj.get("name"), str):
                name, args = obj["name"], obj.get("arguments", {})
                if isinstance(args, str):
                    try:
                        args = json.loads(args)
                    except json.JSONDecodeError:
                        return None
        else:
            m = _FUNCTION.search(body)
            if m is None:
                return None
            name = m.group(1).strip()
            schema = self.schemas.get(name, {})
            args = {}
            for key, raw in _PARAM.findall(m.group(2)):
                key = key.strip()
                if key in args:
                    return None  # duplicate parameter: malformed
                if raw.startswith("\n"):
                    raw = raw[1:]
                if raw.endswith("\n"):
                    raw = raw[:-1]
                args[key] = coerce(raw, schema.get(key))
        if not isinstance(args, dict) or not name or not re.fullmatch(r"[A-Za-z0-9_.:-]+", name):
            return None
        if self.tools_declared and name not in self.schemas:
            return None
        if not self.tools_declared:
            return None
        return ToolCall(len(self.calls), f"call_{uuid.uuid4().hex[:24]}", name, args)
