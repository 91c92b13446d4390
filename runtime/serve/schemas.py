"""Typed request bodies of the three APIs (pydantic, strict: no silent coercion of "5" to 5 or true to 1).

Validation at the edge: every field the server reads is typed and bounded here before anything is
rendered or queued; message contents are checked where they are normalized (chat_template.py), with
their own messages. Unknown fields are allowed (clients send many the server does not use).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError


def _finite(lo: float, hi: float):
    return Optional[Annotated[float, Field(ge=lo, le=hi, allow_inf_nan=False)]]


PositiveTokens = Optional[Annotated[StrictInt, Field(ge=1)]]
Stop = Optional[Union[StrictStr, list[StrictStr]]]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class Sampling(_Body):
    """Sampling fields every API accepts (each optional; the server's defaults apply)."""

    model: Optional[StrictStr] = None
    stream: Optional[StrictBool] = None
    temperature: _finite(0.0, 2.0) = None
    top_p: _finite(0.0, 1.0) = None
    min_p: _finite(0.0, 1.0) = None
    top_k: Optional[Annotated[StrictInt, Field(ge=0, lt=1 << 31)]] = None
    presence_penalty: _finite(-2.0, 2.0) = None
    frequency_penalty: _finite(-2.0, 2.0) = None
    repetition_penalty: _finite(0.01, 10.0) = None
    seed: Optional[StrictInt] = None  # any integer: reduced to 64 bits where it seeds a generator
    tools: Optional[list[dict[str, Any]]] = None
    metadata: Optional[dict[str, Any]] = None


class StreamOptions(_Body):
    include_usage: Optional[StrictBool] = None


class TemplateKwargs(_Body):
    enable_thinking: Optional[StrictBool] = None
    preserve_thinking: Optional[StrictBool] = None


class JsonSchemaSpec(_Body):
    name: Optional[StrictStr] = None
    description: Optional[StrictStr] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None


class ChatResponseFormat(_Body):
    """Chat `response_format`: {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaSpec] = None


class FlatResponseFormat(_Body):
    """Responses `text.format` and Anthropic `output_config.format`: the schema beside the type."""

    type: Literal["text", "json_object", "json_schema"]
    name: Optional[StrictStr] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None


class TextConfig(_Body):
    format: Optional[FlatResponseFormat] = None


class OutputConfig(_Body):
    format: Optional[FlatResponseFormat] = None


class ChatRequest(Sampling):
    """POST /v1/chat/completions"""

    messages: list[Any]
    max_tokens: PositiveTokens = None
    max_completion_tokens: PositiveTokens = None
    stop: Stop = None
    stream_options: Optional[StreamOptions] = None
    chat_template_kwargs: Optional[TemplateKwargs] = None
    reasoning_effort: Optional[StrictStr] = None
    tool_choice: Optional[Union[StrictStr, dict[str, Any]]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    n: Optional[Annotated[StrictInt, Field(ge=1, le=1)]] = None  # one choice per request
    user: Optional[StrictStr] = None
    thinking_budget: Optional[Annotated[StrictInt, Field(ge=0)]] = None  # reasoning tokens at most
    logprobs: Optional[StrictBool] = None
    top_logprobs: Optional[Annotated[StrictInt, Field(ge=0, le=20)]] = None
    response_format: Optional[ChatResponseFormat] = None
    # token id (as a string, the OpenAI wire form) -> bias added to its logit; the ids are checked against the
    # vocabulary where the tokenizer is known (Server.logit_bias)
    logit_bias: Optional[dict[StrictStr, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]]] = None


class ThinkingConfig(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[Annotated[StrictInt, Field(ge=0)]] = None


class MessagesRequest(Sampling):
    """POST /v1/messages"""

    messages: list[Any]
    max_tokens: Annotated[StrictInt, Field(ge=1)]
    system: Optional[Union[StrictStr, list[Any]]] = None
    stop_sequences: Optional[list[StrictStr]] = None
    thinking: Optional[ThinkingConfig] = None
    tool_choice: Optional[dict[str, Any]] = None
    output_config: Optional[OutputConfig] = None
    output_format: Optional[FlatResponseFormat] = None  # the beta spelling of output_config.format


class CountTokensRequest(_Body):
    """POST /v1/messages/count_tokens"""

    model: Optional[StrictStr] = None
    messages: list[Any]
    system: Optional[Union[StrictStr, list[Any]]] = None
    tools: Optional[list[dict[str, Any]]] = None
    thinking: Optional[ThinkingConfig] = None


class Reasoning(_Body):
    effort: Optional[StrictStr] = None
    summary: Optional[StrictStr] = None


class ResponsesRequest(Sampling):
    """POST /v1/responses"""

    input: Optional[Union[StrictStr, list[Any]]] = None  # checked where it is normalized
    instructions: Optional[StrictStr] = None
    max_output_tokens: PositiveTokens = None
    reasoning: Optional[Reasoning] = None
    text: Optional[TextConfig] = None
    tool_choice: Optional[Union[StrictStr, dict[str, Any]]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    previous_response_id: Optional[StrictStr] = None
    store: Optional[StrictBool] = None
    thinking_budget: Optional[Annotated[StrictInt, Field(ge=0)]] = None  # reasoning tokens at most
    top_logprobs: Optional[Annotated[StrictInt, Field(ge=0, le=20)]] = None
    include: Optional[list[StrictStr]] = None
    truncation: Optional[Literal["auto", "disabled"]] = None


def answer_schema(fmt: ChatResponseFormat | FlatResponseFormat | None) -> dict | None:
    """The JSON schema an answer must follow, or None for free text (json_object: any JSON object;
    json_schema without a schema: any JSON value)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    schema = fmt.json_schema.schema_ if isinstance(fmt, ChatResponseFormat) and fmt.json_schema else getattr(fmt, "schema_", None)
    return schema if schema is not None else {}


def first_error(exc: ValidationError) -> tuple[str, str]:
    """(the offending field as a dotted path, one line saying what is wrong with it)."""
    err = exc.errors(include_url=False)[0]
    loc = ".".join(str(part) for part in err["loc"]) or "body"
    return loc, f"{loc}: {err['msg']}"


__all__ = ["answer_schema", "ChatRequest", "CountTokensRequest", "MessagesRequest", "ResponsesRequest", "ValidationError", "first_error"]
