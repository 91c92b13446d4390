"""Structured output: a request's JSON schema (OpenAI `response_format`, Responses `text.format`, Anthropic
`output_config.format`) compiled by llguidance into a token matcher that masks the logits of the answer.

The matcher sees the answer only: tokens inside the thinking block are free, and when the request has tools
the tool-call marker stays allowed beside the grammar (a call ends the constraint for that turn, so agents
that pass both tools and an output schema can still call tools before answering).
"""

from __future__ import annotations

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

    def __init__(self, tokenizer, vocab_size: int, eos_id: int):
        self.tokenizer, self.vocab_size, self.eos_id = tokenizer, vocab_size, eos_id
        self._lltok = None
        self._lock = threading.Lock()

    def _llm_tokenizer(self):
        with self._lock:
            if self._lltok is None:
                import llguidance

                self._lltok = llguidance.LLTokenizer(self.tokenizer.to_str(), n_vocab=self.vocab_size,
                                                     eos_token=self.eos_id)
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

    def choice_matcher(self, options: list[str], where: str):
        """A matcher for exactly one of `options` (literal texts), e.g. a tool name and its closing '>'."""
        llguidance = _llguidance(where)
        grammar = llguidance.grammar_from("lark", "start: " + " | ".join(json.dumps(o) for o in options))
        return self._matcher(grammar, where)

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


def _first_line(value) -> str:
    text = str(value).strip()
    return (text.splitlines() or [""])[0][:300]


class AnswerGrammar:
    """One request's matcher over its answer tokens; `escape` (the tool-call marker) may be chosen at
    any point where the answer has not started, and ends the constraint."""

    def __init__(self, matcher, escape: int | None, release: bool = False):
        self.matcher = matcher
        self.escape = escape
        self.release = release  # the constraint ends once the grammar is satisfied (a prefix, e.g. a tool name)
        self.active = True  # until a tool call opens (or a released grammar is satisfied)
        self.started = False

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits with every token the grammar forbids set to -inf (a copy)."""
        allowed = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.uint8)
        bits = torch.arange(8, dtype=torch.uint8)
        ok = ((allowed[:, None] >> bits) & 1).bool().reshape(-1)[: logits.shape[-1]]
        if ok.shape[0] < logits.shape[-1]:
            ok = torch.cat([ok, torch.zeros(logits.shape[-1] - ok.shape[0], dtype=torch.bool)])
        if self.escape is not None and not self.started:
            ok[self.escape] = True
        return logits.masked_fill(~ok.to(logits.device, non_blocking=True), float("-inf"))

    def advance(self, token: int) -> str | None:
        """Feed an emitted answer token; returns an error when the grammar rejects it."""
        if token == self.escape and not self.started:
            self.active = False
            return None
        self.started = True
        if not self.matcher.consume_token(token):
            return f"structured output: token {token} breaks the schema ({_first_line(self.matcher.get_error())})"
        if self.release and self.matcher.is_accepting():
            self.active = False
        return None
