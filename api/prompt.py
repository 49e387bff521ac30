"""Chat messages → prompt text, one function for the engine and the EPP.

The EPP must tokenize a request exactly as the engine will (its prefix index is keyed on the
engine's tokens), so both call `chat_prompt_text`; the rules about request-supplied templates
live here once too.
"""

from __future__ import annotations

from typing import Any, Protocol

from kvgate.api.chat_template import (
    REQUEST_TEMPLATE_FLAG,
    ChatTemplateError,
    UntrustedTemplateLimits,
    render_untrusted_chat_template,
)

__all__ = ["RequestTemplateNotAllowed", "chat_prompt_text", "surely_too_long"]


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
) -> str:
    """The prompt text for `convo` ({role, content text[, name]} dicts).

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
        variables = {**getattr(tokenizer, "special_tokens", {}), **kwargs}
        text = render_untrusted_chat_template(
            request_template, convo, limits=limits, add_generation_prompt=add_generation_prompt, **variables
        )
    else:
        try:
            text = tokenizer.apply_chat_template(convo, add_generation_prompt=add_generation_prompt, **kwargs)
        except TypeError as exc:  # a kwarg the renderer does not take
            raise ChatTemplateError(f"bad chat_template_kwargs: {exc}") from None
    if continue_final_message and convo:
        # Cut the end-of-turn markup after the last message, so the model continues it.
        final = convo[-1].get("content") or ""
        cut = text.rfind(final) if final else -1
        if cut >= 0:
            text = text[: cut + len(final)]
    return text
