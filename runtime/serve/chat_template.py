"""Render OpenAI- or Anthropic-shaped conversations with the artifact's own Jinja chat template.

Requests are first normalized to one canonical message list (HF shape: role, content string,
optional reasoning_content, tool_calls with *mapping* arguments), so every API renders the same
prompt for the same conversation — which is what makes prefix reuse across turns possible.
"""

from __future__ import annotations

import contextvars
import json
import time
from datetime import datetime

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

# Bounded work per render: a hostile template is an error, never a hang or an exhausted machine.
RENDER_SECONDS = 10.0
RENDER_MAX_CHARS = 64 << 20  # the rendered prompt (a request body is at most --max-request-bytes)
RENDER_MAX_ITERATIONS = 1 << 20  # items over all range() loops of one render
RENDER_MAX_PRODUCT = 1 << 20  # elements of a string or list built with * or **
_budget: contextvars.ContextVar = contextvars.ContextVar("render_budget")


class RequestError(ValueError):
    """The request cannot be rendered; the message is safe to return to the client (HTTP 400)."""


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
    # HF semantics: json.dumps defaults (", " and ": "), key order kept, non-ASCII kept
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _raise(message):
    raise RequestError(f"chat template rejected the conversation: {message}")


class _Budget:
    def __init__(self):
        self.deadline = time.monotonic() + RENDER_SECONDS
        self.iterations = 0

    def spend(self, n: int) -> None:
        self.iterations += n
        if self.iterations > RENDER_MAX_ITERATIONS:
            raise SecurityError(f"the template loops more than {RENDER_MAX_ITERATIONS} times")
        if time.monotonic() > self.deadline:
            raise SecurityError(f"the template ran longer than {RENDER_SECONDS:g} s")


class _BoundedRange:
    """range() for templates: a sequence as before (len, indexing, reversed), whose iteration spends
    the render's budget."""

    def __init__(self, *args):
        self.inner = range(*args)

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        return self.inner[index]

    def __reversed__(self):
        return self._spending(reversed(self.inner))

    def __iter__(self):
        return self._spending(iter(self.inner))

    @staticmethod
    def _spending(values):
        budget = _budget.get(None)
        for i, value in enumerate(values):
            if budget is not None and i % 1024 == 0:
                budget.spend(1024)
            yield value


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, plus limits on loops (range), time, and the size of repeated strings and lists."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator, left, right):
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
            raise SecurityError("the template raises a number to a power above 64")
        if operator == "*":
            sized, count = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
            if isinstance(sized, (str, list, tuple)) and isinstance(count, int) and len(sized) * count > RENDER_MAX_PRODUCT:
                raise SecurityError(f"the template builds a sequence of more than {RENDER_MAX_PRODUCT} elements")
        return super().call_binop(context, operator, left, right)


def make_environment() -> ImmutableSandboxedEnvironment:
    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["range"] = _BoundedRange
    return env


class ChatTemplate:
    def __init__(self, source: str):
        if not isinstance(source, str) or not source.strip():
            raise RequestError("the artifact's chat template is empty")
        try:
            self.template = make_environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise RequestError(f"the artifact's chat template does not parse: {str(exc)[:300]}") from None
        except RecursionError:
            raise RequestError("the artifact's chat template nests too deeply to parse") from None

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
               enable_thinking: bool = True, preserve_thinking: bool = False, **extra) -> str:
        budget = _Budget()
        token = _budget.set(budget)
        try:
            pieces, size = [], 0
            for piece in self.template.generate(messages=messages, tools=tools or None,
                                                add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking,
                                                preserve_thinking=preserve_thinking, **extra):
                size += len(piece)
                if size > RENDER_MAX_CHARS:
                    raise SecurityError(f"the template's output exceeds {RENDER_MAX_CHARS} characters")
                budget.spend(0)
                pieces.append(piece)
            return "".join(pieces)
        except RequestError:
            raise
        except jinja2.TemplateError as exc:
            raise RequestError(f"chat template failed: {str(exc)[:300]}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError) as exc:
            raise RequestError(f"chat template failed on this conversation: {str(exc)[:300]}") from None
        except RecursionError:
            raise RequestError("chat template failed: it recursed too deeply") from None
        except MemoryError:
            raise RequestError("chat template failed: it ran out of memory") from None
        finally:
            _budget.reset(token)


# --- normalization ------------------------------------------------------------------------


IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
MAX_IMAGE_BYTES = 20 << 20


class ImageSink:
    """Collects the images of one request (raw bytes, in prompt order) while messages are normalized;
    passed where a `vision` flag is expected (truthy = vision on)."""

    def __init__(self, allow_files=None, allow_remote: bool = False, max_bytes: int = MAX_IMAGE_BYTES):
        """allow_files: None (local files refused) or the directory local image paths must lie under."""
        self.images: list[bytes] = []
        self.allow_files, self.allow_remote, self.max_bytes = allow_files, allow_remote, max_bytes

    def __bool__(self) -> bool:
        return True

    def add(self, data: bytes, where: str) -> str:
        if len(data) > self.max_bytes:
            raise RequestError(f"{where}: image of {len(data)} bytes exceeds the {self.max_bytes}-byte limit")
        self.images.append(data)
        return IMAGE_PLACEHOLDER

    def from_url(self, url, where: str) -> str:
        import base64
        import binascii

        if not isinstance(url, str) or not url:
            raise RequestError(f"{where}: an image needs a url string")
        if url.startswith("data:"):
            head, _, payload = url.partition(",")
            if ";base64" not in head:
                raise RequestError(f"{where}: data URLs must be base64 encoded")
            try:
                data = base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                raise RequestError(f"{where}: the data URL is not valid base64") from None
            return self.add(data, where)
        if url.startswith(("http://", "https://")):
            if not self.allow_remote:
                raise RequestError(f"{where}: remote image URLs are off; send a data: URL (or start with --allow-remote-images)")
            import httpx

            data = bytearray()
            try:  # streamed: a huge or endless body stops at the size limit, a slow one at the timeout
                with httpx.stream("GET", url, timeout=10, follow_redirects=True) as r:
                    r.raise_for_status()
                    for piece in r.iter_bytes():
                        data += piece
                        if len(data) > self.max_bytes:
                            break
            except httpx.HTTPError:
                raise RequestError(f"{where}: the image URL could not be fetched") from None
            return self.add(bytes(data), where)
        path = url[len("file://"):] if url.startswith("file://") else url
        if not self.allow_files:
            raise RequestError(f"{where}: local image files are off; send a data: URL (or start the server with "
                               "--allow-local-images DIR)")
        import os

        root = os.path.realpath(self.allow_files)
        real = os.path.realpath(os.path.join(root, path))
        # one answer for every path it cannot serve: a client learns nothing about what exists where
        unreadable = RequestError(f"{where}: the image file is not readable under the server's allowed image directory")
        if os.path.commonpath([root, real]) != root:
            raise unreadable
        try:
            with open(real, "rb") as f:
                return self.add(f.read(self.max_bytes + 1), where)
        except OSError:
            raise unreadable from None


def _image_part(part: dict, where: str, vision) -> str:
    """An OpenAI image_url / Responses input_image / Anthropic image block -> placeholder text."""
    if not vision:
        raise RequestError("vision_disabled: this server was started without --vision; remove image parts")
    if not isinstance(vision, ImageSink):
        raise RequestError(f"{where}: image parts are not accepted here")
    kind = part.get("type")
    if kind == "image_url":
        ref = part.get("image_url")
        return vision.from_url(ref.get("url") if isinstance(ref, dict) else ref, where)
    if kind == "input_image":
        return vision.from_url(part.get("image_url"), where)
    source = part.get("source") if isinstance(part.get("source"), dict) else {}
    if source.get("type") == "base64":
        return vision.from_url(f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}", where)
    if source.get("type") == "url":
        return vision.from_url(source.get("url"), where)
    raise RequestError(f"{where}: an image block needs a base64 or url source")


def _text_of(content, where: str, vision) -> str:
    """String content as is; a list of parts concatenated without separators (text only here)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: content must be a string or a list of parts")
    out = []
    for part in content:
        if not isinstance(part, dict) or "type" not in part:
            raise RequestError(f"{where}: every content part needs a 'type'")
        kind = part["type"]
        if kind in ("text", "input_text", "output_text"):
            if not isinstance(part.get("text"), str):
                raise RequestError(f"{where}: a text part needs a string 'text'")
            out.append(part["text"])
        elif kind in ("image_url", "input_image", "image"):
            out.append(_image_part(part, where, vision))
        else:
            raise RequestError(f"{where}: unsupported content part type {kind!r}")
    return "".join(out)


def _arguments(raw, where: str) -> dict:
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, str):
        try:
            value = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as exc:
            raise RequestError(f"{where}: tool call arguments are not valid JSON ({exc.msg})") from None
        if isinstance(value, dict):
            return value
    raise RequestError(f"{where}: tool call arguments must be a JSON object")


CUSTOM_INPUT = "input"  # the one string parameter a freeform (custom) tool is offered to the model with


def normalize_openai_tools(tools, where: str = "tools", customs: set | None = None) -> list[dict] | None:
    """Function tools in the template's shape. Tools the model cannot call as functions (web_search,
    local_shell, ... sent by real clients) are left out; a namespace's function tools are taken in.
    With `customs` (the Responses API), freeform `custom` tools are offered as functions of one string
    parameter, `input`, and their names are added to the set (their calls go back as custom_tool_call)."""
    if not tools:
        return None
    if not isinstance(tools, list):
        raise RequestError(f"{where} must be a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise RequestError(f"{where}[{i}] must be an object")
        if t.get("type") == "namespace" and isinstance(t.get("tools"), list):
            out += normalize_openai_tools(t["tools"], f"{where}[{i}].tools", customs) or []
            continue
        if t.get("type") == "custom" and customs is not None and isinstance(t.get("name"), str):
            customs.add(t["name"])
            fmt = t.get("format") if isinstance(t.get("format"), dict) else {}
            syntax = f" Its input follows this {fmt.get('syntax', '')} grammar:\n{fmt['definition']}" \
                if isinstance(fmt.get("definition"), str) else ""
            out.append({"type": "function", "function": {
                "name": t["name"], "description": (t.get("description") or "") + syntax,
                "parameters": {"type": "object", "properties": {CUSTOM_INPUT: {
                    "type": "string", "description": "The tool's raw input (not JSON)."}}, "required": [CUSTOM_INPUT]}}})
            continue
        if t.get("type") != "function":
            continue
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if fn is None and isinstance(t, dict) and t.get("type") == "function" and "name" in t:
            fn = t  # Responses API flattens the function into the tool
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{where}[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}")
        out.append({"type": "function", "function": {"name": fn["name"], "description": fn.get("description", ""),
                                                     "parameters": fn.get("parameters") or {"type": "object", "properties": {}},
                                                     **({"strict": True} if fn.get("strict") is True else {})}})
    return out or None


def responses_tools(tools, items) -> tuple[list[dict] | None, set]:
    """A Responses request's tools: `tools` plus those of `additional_tools` input items (the Codex CLI
    sends its tools there), and the names of the freeform (custom) ones among them."""
    customs: set = set()
    out = normalize_openai_tools(tools, "tools", customs) or []
    for i, item in enumerate(items if isinstance(items, list) else []):
        if isinstance(item, dict) and item.get("type") == "additional_tools":
            out += normalize_openai_tools(item.get("tools"), f"input[{i}].tools", customs) or []
    return out or None, customs


def system_first(messages: list[dict]) -> list[dict]:
    """One system message, first: every system / developer message (Responses instructions and developer
    items, Anthropic system entries among the messages, later reminders) folded into it in order, because
    the template accepts a system message only at the beginning."""
    system = [m["content"] for m in messages if m["role"] == "system" and m["content"]]
    rest = [m for m in messages if m["role"] != "system"]
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + rest


def normalize_anthropic_tools(tools) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise RequestError(f"tools[{i}] needs a string 'name'")
        out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                     "parameters": t.get("input_schema") or {"type": "object", "properties": {}},
                                                     **({"strict": True} if t.get("strict") is True else {})}})
    return out


def normalize_openai_messages(messages, vision: bool = False) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"{where} needs a string 'role'")
        role = "system" if m["role"] == "developer" else m["role"]
        if role not in ("system", "user", "assistant", "tool"):
            raise RequestError(f"{where}: unknown role {m['role']!r}")
        msg = {"role": role, "content": _text_of(m.get("content"), where, vision)}
        if role == "assistant":
            if isinstance(m.get("reasoning_content"), str):
                msg["reasoning_content"] = m["reasoning_content"]
            calls = []
            for j, c in enumerate(m.get("tool_calls") or []):
                fn = c.get("function") if isinstance(c, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise RequestError(f"{where}.tool_calls[{j}] needs function.name")
                calls.append({"id": c.get("id"), "type": "function",
                              "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments"), f"{where}.tool_calls[{j}]")}})
            if calls:
                msg["tool_calls"] = calls
        if role == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return system_first(out)


def normalize_anthropic_messages(system, messages, vision: bool = False) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    out = []
    if system:
        out.append({"role": "system", "content": _text_of(system, "system", vision)})
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
            raise RequestError(f"{where}: role must be 'user' or 'assistant'")
        if m["role"] == "system":  # some clients put system entries among the messages
            out.append({"role": "system", "content": _text_of(m.get("content"), where, vision)})
            continue
        blocks = m.get("content")
        if isinstance(blocks, str):
            out.append({"role": m["role"], "content": blocks})
            continue
        if not isinstance(blocks, list):
            raise RequestError(f"{where}: content must be a string or a list of blocks")
        text, calls, reasoning = [], [], None
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                text.append(b.get("text", ""))
            elif kind == "thinking":
                reasoning = (reasoning or "") + b.get("thinking", "")
            elif kind == "redacted_thinking":
                continue
            elif kind == "tool_use" and m["role"] == "assistant":
                calls.append({"id": b.get("id"), "type": "function",
                              "function": {"name": b.get("name"), "arguments": _arguments(b.get("input", {}), f"{where}.content[{j}]")}})
            elif kind == "tool_result" and m["role"] == "user":
                if text:
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                out.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                            "content": _text_of(b.get("content"), f"{where}.content[{j}]", vision)})
            elif kind == "image":
                text.append(_image_part(b, f"{where}.content[{j}]", vision))
            else:
                raise RequestError(f"{where}.content[{j}]: unsupported block type {kind!r}")
        if text or calls or reasoning is not None or m["role"] == "assistant":
            msg = {"role": m["role"], "content": "".join(text)}
            if reasoning is not None:
                msg["reasoning_content"] = reasoning
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    return system_first(out)


def normalize_responses_input(instructions, items, vision: bool = False) -> list[dict]:
    """OpenAI Responses `input` (a string or a list of items) -> canonical messages."""
    out = []
    if instructions:
        out.append({"role": "system", "content": _text_of(instructions, "instructions", vision)})
    if isinstance(items, str):
        return system_first(out + [{"role": "user", "content": items}])
    if not isinstance(items, list) or not items:
        raise RequestError("input must be a string or a non-empty list of items")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item.get("role") == "developer" else item.get("role")
            if role not in ("system", "user", "assistant"):
                raise RequestError(f"{where}: unknown role {item.get('role')!r}")
            out.append({"role": role, "content": _text_of(item.get("content"), where, vision)})
        elif kind in ("function_call", "custom_tool_call"):
            # a freeform (custom) call's raw input is the one parameter it was offered with
            arguments = _arguments(item.get("arguments"), where) if kind == "function_call" \
                else {CUSTOM_INPUT: str(item.get("input") or "")}
            call = {"id": item.get("call_id"), "type": "function", "function": {"name": item.get("name"), "arguments": arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output")
            if isinstance(output, list):  # content items: their text, in order
                output = "\n".join(str(part.get("text", "")) for part in output if isinstance(part, dict))
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "additional_tools":
            continue  # tools sent among the input items: taken in with the request's tools (responses_tools)
        elif kind == "reasoning":
            continue  # the template decides which turns keep reasoning; clients' summaries are not replayed
        else:
            raise RequestError(f"{where}: unsupported item type {kind!r}")
    return system_first(out)
