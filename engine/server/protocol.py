"""Request models for the OpenAI-compatible API (OpenAI field names; unknown fields ignored).

Field constraints here are what the API promises; anything outside them is a 400 with the
offending field as `param`. Responses are built as plain dicts on the hot path (see
`responses.py`) because pydantic serialization per streamed token costs more than it buys.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvgate.engine.server.errors import APIError
from kvgate.engine.server.structured import StructuredFields

MAX_LOGPROBS = 20
MAX_N = 128
_TOKEN_ID = Annotated[int, Field(ge=0)]


class _Lenient(BaseModel):
    # OpenAI clients send fields we do not know (user, metadata, store...); like OpenAI, ignore them.
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class KVTransferParams(_Lenient):
    """vLLM's `kv_transfer_params` (prefill/decode disaggregation). A producer is asked
    `do_remote_decode` and answers with the `do_remote_prefill` set a consumer pulls with."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = Field(None, max_length=128)
    remote_host: str | None = Field(None, max_length=253, pattern=r"^[A-Za-z0-9.\-:\[\]]+$")
    remote_port: int | None = Field(None, ge=1, le=65535)
    remote_block_ids: list[int] | None = Field(None, max_length=1_000_000)
    transfer_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_\-]{8,64}$")


class _SamplingFields(StructuredFields, _Lenient):
    """Fields both generation endpoints share (OpenAI's plus vLLM's extras; the structured
    output fields are in `structured.py`)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[_TOKEN_ID] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extension: top-K logprobs at every prompt position (plus the prompt token itself).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    kv_transfer_params: KVTransferParams | None = None
    # vLLM's: lower is admitted first, with --scheduling-policy priority or fair (the default)
    priority: int = Field(0, ge=-(2**31), lt=2**31)

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 16:
            raise ValueError("at most 16 stop sequences are allowed")
        if v == "" or (isinstance(v, list) and any(s == "" for s in v)):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[_TOKEN_ID] | list[list[_TOKEN_ID]]
    max_tokens: int | None = Field(16, ge=0)  # 0: only with echo (score the prompt, generate nothing)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ToolCallFunction(_Lenient):
    name: str
    arguments: str | dict[str, Any] | None = None  # a JSON string (OpenAI); an object is taken too


class MessageToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # refused unless --trust-request-chat-template (vLLM)
    chat_template_kwargs: dict[str, Any] | None = None
    # Kept as sent: the chat template sees the same objects here and in the EPP (kvgate.api.prompt);
    # validated in kvgate.engine.server.tools.request.
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template: str | None = None  # as on chat completions: needs --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None  # rendered by the chat template, as on chat completions


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[_TOKEN_ID]


def parse_body(model: type[BaseModel], raw: bytes) -> Any:
    """Parse a JSON body into `model`; every failure is a 400 naming the offending field."""
    if not raw.strip():
        raise APIError(400, "The request body is empty; expected a JSON object.", code="invalid_json")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise _validation_to_api_error(exc) from None


def _validation_to_api_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return APIError(
            400, f"The request body is not valid JSON: {first.get('msg', '')}", code="invalid_json"
        )
    if first.get("type") == "model_type" and not first.get("loc"):
        return APIError(400, "The request body must be a JSON object.", code="invalid_json")
    # For union fields pydantic reports one error per alternative; the first is representative.
    loc = [str(p) for p in first.get("loc", ()) if not str(p).startswith(("list[", "str", "int"))]
    param = ".".join(loc) or None
    kind = str(first.get("type", ""))
    detail = str(first.get("msg", "invalid"))
    if kind == "missing":
        message = f"Missing required field '{param}'."
    else:
        message = f"Invalid value for '{param}': {detail}." if param else detail
    return APIError(
        400,
        message,
        param=loc[0] if loc else None,
        code="invalid_value" if kind != "missing" else "missing_field",
    )
