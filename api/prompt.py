"""Chat messages → prompt text, one function for the engine and the EPP.

The EPP must tokenize a request exactly as the engine will (its prefix index is keyed on the
engine's tokens), so both call `chat_prompt_text`; the rules about request-supplied templates
live here once too.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from kvgate.api.chat_template import (
    REQUEST_TEMPLATE_FLAG,
    ChatTemplateError,
    UntrustedTemplateLimits,
    render_untrusted_chat_template,
)

__all__ = [
    "RequestTemplateNotAllowed",
    "chat_prompt_text",
    "content_text",
    "surely_too_long",
    "template_message",
    "template_tools",
]


class RequestTemplateNotAllowed(ChatTemplateError):
    """A request carried its own chat template and the server does not run request templates."""

    def __init__(self) -> None:
        super().__init__(
            "Chat templates sent in requests are not allowed on this server (they run as code); "
            f"start the server with {REQUEST_TEMPLATE_FLAG} to allow them."
        )


def surely_too_long(tokenizer: Any, text: str, max_model_len: int) -> int:
    """The token count `text` has at least, when that alone rules it out of a `max_model_len`
    context (0 otherwise, and when the tokenizer offers no free bound): the check that refuses
    a 10 MB prompt without tokenizing it."""
    bound = getattr(tokenizer, "min_token_count", None)
    if not max_model_len or bound is None:
        return 0
    n = int(bound(text))
    return n if n >= max_model_len else 0


def content_text(content: Any) -> str:
    """A message's content as text: a string, or the text of OpenAI content parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """One OpenAI chat message as chat templates read it (transformers' and vLLM's convention):
    content as text, `name`; an assistant's `tool_calls` with each call's `arguments` parsed
    from its JSON string into an object (tool-use templates iterate over them); a tool
    message's `tool_call_id`. Raises ChatTemplateError for arguments that are not a JSON object."""
    entry: dict[str, Any] = {"role": message.get("role"), "content": content_text(message.get("content"))}
    if message.get("name"):
        entry["name"] = message["name"]
    tool_calls = message.get("tool_calls")
    if isinstance(tool_calls, list) and tool_calls:
        entry["tool_calls"] = [_template_tool_call(c) for c in tool_calls]
    if message.get("tool_call_id") is not None:
        entry["tool_call_id"] = str(message["tool_call_id"])
    return entry


def _template_tool_call(call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ChatTemplateError("each tool call needs a function with a name")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise ChatTemplateError(
                f"the arguments of tool call {function['name']!r} are not valid JSON"
            ) from None
    if not isinstance(arguments, dict):
        raise ChatTemplateError(f"the arguments of tool call {function['name']!r} must be a JSON object")
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if call.get("id") is not None:
        out["id"] = str(call["id"])
    return out


def template_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The request's `tools` as the template sees them: the objects as sent (as transformers
    passes JSON-schema tools), None when there are none."""
    if not isinstance(tools, list) or not tools:
        return None
    return [t for t in tools if isinstance(t, dict)] or None


class _Templated(Protocol):
    chat_template: str | None
    special_tokens: dict[str, str]

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str: ...


def chat_prompt_text(
    tokenizer: _Templated,
    convo: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    request_template: str | None = None,
    trust_request_template: bool = False,
    limits: UntrustedTemplateLimits | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text for `convo` (`template_message` dicts), with `tools` (`template_tools`)
    visible to the template as `tools`, as transformers' apply_chat_template passes them.

    `request_template`: a template the request carried (top-level `chat_template`, or inside
    `chat_template_kwargs`); refused unless `trust_request_template`, then rendered in a
    bounded child process (blocking: call from a worker thread). Raises ChatTemplateError.
    """
    kwargs = dict(template_kwargs or {})
    kwargs.pop("chat_template", None)
    for reserved in ("messages", "add_generation_prompt", "tools", "documents"):
        if reserved in kwargs:
            raise ChatTemplateError(f"chat_template_kwargs may not set {reserved!r}")
    if request_template is not None:
        if not trust_request_template:
            raise RequestTemplateNotAllowed()
        variables = {**getattr(tokenizer, "special_tokens", {}), **kwargs, "tools": tools}
        text = render_untrusted_chat_template(
            request_template, convo, limits=limits, add_generation_prompt=add_generation_prompt, **variables
        )
    else:
        try:
            text = tokenizer.apply_chat_template(
                convo, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs
            )
        except TypeError as exc:  # a kwarg the renderer does not take
            raise ChatTemplateError(f"bad chat_template_kwargs: {exc}") from None
    if continue_final_message and convo:
        # Cut the end-of-turn markup after the last message, so the model continues it.
        final = convo[-1].get("content") or ""
        cut = text.rfind(final) if final else -1
        if cut >= 0:
            text = text[: cut + len(final)]
    return text
