"""Structured output: a request's JSON schema (OpenAI `response_format`, Responses `text.format`, Anthropic
`output_config.format`) compiled by llguidance into a token matcher that masks the logits of the answer.

The matcher sees the answer only: tokens inside the thinking block are free, and when the request has tools
the tool-call marker stays allowed beside the grammar (a call ends the constraint for that turn, so agents
that pass both tools and an output schema can still call tools before answering). Tool calls get their own
grammar (call_grammar) when a tool is `strict` or tool_choice requires a call: the name is one of the
allowed tools', and a strict tool's parameters follow its JSON schema, so its arguments always parse.
"""

from __future__ import annotations

import importlib.util
import json
import threading

import torch

# compact JSON: whitespace between tokens would be a free choice a greedy decoder can repeat forever
JSON_OPTIONS = {"whitespace_flexible": False}
MAX_SCHEMA_BYTES = 256 << 10


class StructuredOutputError(ValueError):
    """The requested format cannot be enforced (its one-line reason names what to change)."""


class GrammarCompiler:
    """Server-wide: the tokenizer as llguidance sees it, built once on first use (~1 s at 248K tokens)."""

    def __init__(self, tokenizer, vocab_size: int, eos_id: list[int]):
        self.tokenizer, self.vocab_size, self.eos_id = tokenizer, vocab_size, eos_id
        self._lltok = None
        self._lock = threading.Lock()

    def prepare(self) -> bool:
        """Build the tokenizer as llguidance sees it now, at start-up, rather than inside the first constrained
        request while other lanes decode; False where llguidance is missing (constrained requests are refused)."""
        if importlib.util.find_spec("llguidance") is None:
            return False
        self._llm_tokenizer()
        return True

    def _llm_tokenizer(self):
        with self._lock:
            if self._lltok is None:
                import llguidance

                def build(eos):
                    return llguidance.LLTokenizer(self.tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=eos)

                try:  # every stop token may end the answer
                    self._lltok = build(self.eos_id)
                except TypeError:  # older llguidance (1.6 on the H100 of session 28) takes one end token: the
                    # end of turn where the model has one, which is how a chat answer ends
                    turn_end = self.tokenizer.token_to_id("<|im_end|>")
                    self._lltok = build(turn_end if turn_end in self.eos_id else self.eos_id[0])
            return self._lltok

    def matcher(self, schema: dict, where: str):
        """A fresh matcher for answers valid under `schema` (a JSON-schema object)."""
        llguidance = _llguidance(where)
        text = json.dumps(schema)
        if len(text) > MAX_SCHEMA_BYTES:
            raise StructuredOutputError(f"{where}: the schema is {len(text)} bytes; at most {MAX_SCHEMA_BYTES} are accepted")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        except Exception as exc:  # noqa: BLE001 - the compiler's message names the unsupported part
            raise StructuredOutputError(f"{where}: the schema cannot be enforced: {_first_line(exc)}") from None
        return self._matcher(grammar, where)

    def call_matchers(self, tools: list[dict], names: list[str], where: str):
        """A factory of matchers for one tool call each, after its `<tool_call>` token (see call_grammar): the
        name held to `names`, and a strict tool's parameters to its schema. The grammar is built and checked
        here, once; each call gets a fresh matcher of it."""
        import llguidance

        _llguidance(where)
        text = call_grammar([t for t in tools if t["function"]["name"] in names], self._token_ref("</tool_call>"))
        if len(text) > MAX_SCHEMA_BYTES:
            raise StructuredOutputError(f"{where}: the tools' schemas make a {len(text)}-byte grammar; at most "
                                        f"{MAX_SCHEMA_BYTES} are accepted")
        grammar = llguidance.grammar_from("lark", text)
        self._matcher(grammar, where)  # a grammar llguidance cannot enforce is refused now, not at the call
        return lambda: llguidance.LLMatcher(self._llm_tokenizer(), grammar, log_level=0)

    def _token_ref(self, text: str) -> str:
        """`text` as a lark item: a special token by id (its bytes are not text), else a string literal."""
        token_id = self.tokenizer.token_to_id(text)
        special = any(t.content == text and t.special for t in self.tokenizer.get_added_tokens_decoder().values())
        return f"<[{token_id}]>" if token_id is not None and special else _lark_string(text)

    def _matcher(self, grammar: str, where: str):
        import llguidance

        tokenizer = self._llm_tokenizer()
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise StructuredOutputError(f"{where}: the schema cannot be enforced: {_first_line(error)}")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise StructuredOutputError(f"{where}: the schema cannot be enforced: {_first_line(matcher.get_error())}")
        return matcher


def _llguidance(where: str):
    try:
        import llguidance
    except ImportError:
        raise StructuredOutputError(f"{where} needs the llguidance package on the server (pip install llguidance)") from None
    return llguidance


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _is_text(schema) -> bool:
    """A parameter the template writes as raw text (the output parser's rule): strings, bare enums."""
    t = schema.get("type") if isinstance(schema, dict) else None
    types = t if isinstance(t, list) else [t] if isinstance(t, str) else []
    if isinstance(schema, dict) and not types and isinstance(schema.get("anyOf"), list):
        types = [s.get("type") for s in schema["anyOf"] if isinstance(s, dict)]
    return "string" in types or (not types and isinstance(schema, dict) and "enum" in schema)


CALL_OPENING = "\n<function="  # after the <tool_call> token, as the template writes a call
PARAM_END = "\n</parameter>"  # a text value runs lazily up to this


def call_grammar(tools: list[dict], close: str) -> str:
    """The lark grammar of one qwen3_coder call, from the newline after `<tool_call>` to `</tool_call>`
    (`close`, a lark item). A tool whose function has `strict` set gets its parameters in schema order,
    the required ones present, no others: a text parameter (a string, or an enum of strings) as raw text
    up to the closing tag, any other as compact JSON valid under its schema (llguidance's %json). Other
    tools are held to their name; the constraint ends after it (their arguments stay free)."""
    lit = _lark_string
    rules, calls = [], []
    for i, tool in enumerate(tools):
        fn = tool["function"]
        if not fn.get("strict"):
            calls.append(lit(fn["name"] + ">"))
            continue
        params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
        props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
        required = set(params.get("required") or [])
        items = []
        for j, (key, schema) in enumerate(props.items()):
            rule, opening = f"p{i}_{j}", lit(f"<parameter={key}>\n")
            enum = schema.get("enum") if isinstance(schema, dict) else None
            if _is_text(schema) and isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
                rules.append(f"{rule}: {opening} ({' | '.join(lit(e) for e in enum)}) {lit(PARAM_END + chr(10))}")
            elif _is_text(schema):  # a value may span lines: lazy up to the closing tag
                rules.append(f"{rule}: {opening} v{rule} {lit(chr(10))}")
                rules.append(f"v{rule}[stop={lit(PARAM_END)}]: /(?s:.*)/")
            else:  # the root's definitions travel along, so a "#/$defs/..." reference resolves inside the value
                shared = {k: params[k] for k in ("$defs", "definitions") if isinstance(params.get(k), dict)}
                body = {**shared, **(schema if isinstance(schema, dict) else {}),
                        "x-guidance": {"whitespace_flexible": False}}
                rules.append(f"{rule}: {opening} %json {json.dumps(body)} {lit(PARAM_END + chr(10))}")
            items.append(rule if key in required else rule + "?")
        rules.append(f"f{i}: {lit(fn['name'] + '>' + chr(10))} {' '.join(items)} {lit('</function>' + chr(10))} {close}")
        calls.append(f"f{i}")
    return "\n".join([f"start: {lit(CALL_OPENING)} ({' | '.join(calls)})", *rules])


def _first_line(value) -> str:
    text = str(value).strip()
    return (text.splitlines() or [""])[0][:300]


class AnswerGrammar:
    """One request's constraints over its answer tokens (after any thinking block):

    - `matcher`: the answer's output schema (None: free text). `escape` (the `<tool_call>` token) may be
      chosen wherever the answer has not started; it ends this constraint for the turn.
    - `calls`: a factory of call matchers (GrammarCompiler.call_matchers): after each `<tool_call>` the call
      is held to it until the matcher is satisfied (a strict tool's `</tool_call>`, or a free tool's name),
      then the text is free again (parallel calls get a fresh matcher each).

    Forced tokens (a required call's opening) are fed like sampled ones, so a call matcher sees them."""

    def __init__(self, matcher, escape: int | None, calls=None):
        self.matcher = matcher
        self.escape = escape
        self.calls = calls
        self.call = None  # the open call's matcher
        self.started = False

    @property
    def active(self) -> bool:
        """Whether any token may still be constrained (the scheduler skips a finished grammar)."""
        return self.matcher is not None or self.call is not None or self.calls is not None

    def _current(self):
        return self.call if self.call is not None else self.matcher

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits with every token the grammar forbids set to -inf (a copy); free text: unchanged."""
        matcher = self._current()
        if matcher is None:
            return logits
        allowed = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
        bits = torch.arange(8, dtype=torch.uint8)
        ok = ((allowed[:, None] >> bits) & 1).bool().reshape(-1)[: logits.shape[-1]]
        if ok.shape[0] < logits.shape[-1]:
            ok = torch.cat([ok, torch.zeros(logits.shape[-1] - ok.shape[0], dtype=torch.bool)])
        if self.call is None and self.escape is not None and not self.started:
            ok[self.escape] = True
        return logits.masked_fill(~ok.to(logits.device, non_blocking=True), float("-inf"))

    def advance(self, token: int) -> str | None:
        """Feed an emitted answer token; returns an error when the grammar rejects it."""
        if self.call is not None:
            if not self.call.consume_token(token):
                return f"tool call: token {token} breaks the tool's schema ({_first_line(self.call.get_error())})"
            if self.call.is_accepting():
                self.call = None
            return None
        if token == self.escape and (self.matcher is None or not self.started):
            self.matcher = None  # a call ends the answer's constraint for this turn
            if self.calls is not None:
                self.call = self.calls()
            return None
        if self.matcher is None:
            return None
        self.started = True
        if not self.matcher.consume_token(token):
            return f"structured output: token {token} breaks the schema ({_first_line(self.matcher.get_error())})"
        return None
