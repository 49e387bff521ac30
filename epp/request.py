"""One inference request as the scheduler sees it, parsed from the HTTP body Envoy forwarded."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvgate.api.chat_template import ChatTemplateError, request_chat_template
from kvgate.api.prompt import (
    RequestTemplateNotAllowed,
    chat_prompt_text,
    surely_too_long,
    template_message,
    template_tools,
)
from kvgate.api.tokenizer import TooManyTokens


class Tokenizer(Protocol):
    # what kvgate.api.prompt.chat_prompt_text renders with
    chat_template: str | None
    special_tokens: dict[str, str]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str: ...


class BadRequest(ValueError):
    """The body is not something an engine could serve: answered 400 without reaching one."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class PromptPolicy:
    """What the EPP refuses before routing, so hostile prompts cost it (almost) nothing."""

    trust_request_chat_template: bool = False  # vLLM's --trust-request-chat-template
    max_model_len: int = 0  # the pool's context in tokens; 0: not known (no length checks)


@dataclass
class InferenceRequest:
    request_id: str
    model: str  # as the client sent it
    target_model: str  # after x-gateway-model-name-rewrite
    body: dict[str, Any] | None  # None: a request without a body (GET)
    objective: str | None = None
    priority: int = 0
    fairness_id: str | None = None
    # flow control found its flow over its share of the recent work: engines run it after the
    # others of its priority (kvgate.api.contracts.queue_order)
    over_share: bool = False
    slo_ttft_s: float | None = None  # x-slo-ttft-ms: the client's time-to-first-token objective
    slo_tpot_s: float | None = None  # x-slo-tpot-ms: its time-per-output-token objective
    path: str = ""
    subset: list[str] | None = None  # Envoy's subset hint; None = no hint
    headers: dict[str, str] = field(default_factory=dict)  # as Envoy sent them, lower-case names
    tokenizer: Tokenizer | None = None
    policy: PromptPolicy = field(default_factory=PromptPolicy)
    _token_ids: list[int] | None = field(default=None, repr=False)
    _prompt_text: str | None = field(default=None, repr=False)

    @property
    def prompt_text(self) -> str:
        """A flat text view of the prompt (approximate prefix hashing keys on it)."""
        if self._prompt_text is None:
            self._prompt_text = _flat_prompt(self.body)
        return self._prompt_text

    @property
    def token_ids(self) -> list[int]:
        """The prompt tokens exactly as the engine will tokenize them (chat template applied).

        Routing never fails because of the prompt: a prompt the engine would refuse has no
        tokens here. Call `prepare()` first to refuse it with a 400 instead."""
        if self._token_ids is None:
            try:
                self._token_ids = _tokenize(self.body, self.tokenizer, self.policy)
            except BadRequest:
                self._token_ids = []
        return self._token_ids

    def prepare(self) -> None:
        """Tokenize now (in whatever thread calls this), raising BadRequest for prompts no
        engine can serve."""
        if self._token_ids is None:
            self._token_ids = _tokenize(self.body, self.tokenizer, self.policy)


def parse_body(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object with a 'model' field")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("request body has no 'model' (a non-empty string is required)", param="model")
    if "messages" in body and not isinstance(body["messages"], list):
        raise BadRequest("'messages' must be a list of chat messages", param="messages")
    return body


def _flat_prompt(body: dict[str, Any] | None) -> str:
    if not body:
        return ""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        for msg in messages:
            if isinstance(msg, dict):
                parts.append(str(msg.get("role", "")))
                parts.append(_content_text(msg.get("content")))
        return "\x1e".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return json.dumps(prompt)
    return ""


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _too_long(policy: PromptPolicy, tokens: int, at_least: bool) -> BadRequest:
    limit = policy.max_model_len
    n = f"at least {tokens}" if at_least else str(tokens)
    return BadRequest(
        f"This model's maximum context length is {limit} tokens. However, your prompt has {n} "
        "tokens. Please reduce the length of the prompt.",
        param="messages",
        code="context_length_exceeded",
    )


def _encode(tokenizer: Any, text: str, add_special_tokens: bool, policy: PromptPolicy) -> list[int]:
    """encode(), refusing over-context text from its length alone when the tokenizer can say so,
    and input the tokenizer cannot take (lone surrogates) as a client error."""
    limit = policy.max_model_len
    kwargs: dict[str, Any] = {"add_special_tokens": add_special_tokens}
    if n := surely_too_long(tokenizer, text, limit):
        raise _too_long(policy, n, at_least=True)
    if limit and getattr(tokenizer, "accepts_max_tokens", False):
        kwargs["max_tokens"] = limit - 1
    try:
        ids = tokenizer.encode(text, **kwargs)
    except TooManyTokens as exc:
        raise _too_long(policy, exc.count, at_least=False) from None
    except (TypeError, ValueError, UnicodeError) as exc:
        raise BadRequest(f"the prompt cannot be tokenized (invalid Unicode text?): {exc}") from None
    if limit and len(ids) >= limit:
        raise _too_long(policy, len(ids), at_least=False)
    return ids


def _tokenize(body: dict[str, Any] | None, tokenizer: Tokenizer | None, policy: PromptPolicy) -> list[int]:
    """The engine's own prompt path (kvgate.api.prompt), token for token: chat → template over
    `template_message`s and the request's tools, then encode without special tokens; completions →
    encode(prompt, add_special_tokens=body.add_special_tokens, default true).

    Raises BadRequest for what no engine would serve: a request template the server does not
    trust, a prompt over the context, text the tokenizer cannot take. Returns [] when only the
    engine can tell (e.g. the model's template rejects the conversation)."""
    if not body or tokenizer is None:
        return []
    messages = body.get("messages")
    if isinstance(messages, list):
        if not all(isinstance(m, dict) for m in messages):
            return []
        try:
            convo = [template_message(m) for m in messages]
        except ChatTemplateError:
            return []  # e.g. tool-call arguments that are no JSON: the engine answers the 400
        raw_kwargs = body.get("chat_template_kwargs")
        try:
            template = request_chat_template(body)
        except ChatTemplateError as exc:
            raise BadRequest(str(exc), param="chat_template") from None
        if template is not None and not policy.trust_request_chat_template:
            raise BadRequest(str(RequestTemplateNotAllowed()), "chat_template", "chat_template_not_allowed")
        if n := surely_too_long(tokenizer, "".join(e["content"] for e in convo), policy.max_model_len):
            raise _too_long(policy, n, at_least=True)
        try:
            text = chat_prompt_text(
                tokenizer,
                convo,
                add_generation_prompt=bool(body.get("add_generation_prompt", True)),
                continue_final_message=bool(body.get("continue_final_message")),
                template_kwargs=raw_kwargs if isinstance(raw_kwargs, dict) else None,
                request_template=template,
                trust_request_template=policy.trust_request_chat_template,
                tools=template_tools(body.get("tools")),
            )
        except ChatTemplateError as exc:
            if template is not None:  # the client's own template failed or hit its limits
                raise BadRequest(f"Cannot apply the chat template: {exc}", "chat_template") from None
            return []  # the engine will reject it with the template's own message
        return _encode(tokenizer, text, False, policy)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return _encode(tokenizer, prompt, bool(body.get("add_special_tokens", True)), policy)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)  # already token ids
    return []
