"""One inference request as the scheduler sees it, parsed from the HTTP body Envoy forwarded."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Protocol


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str: ...


class BadRequest(ValueError):
    """The body is not something an engine could serve: answered 400 without reaching one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class InferenceRequest:
    request_id: str
    model: str  # as the client sent it
    target_model: str  # after x-gateway-model-name-rewrite
    body: dict[str, Any] | None  # None: a request without a body (GET)
    objective: str | None = None
    priority: int = 0
    fairness_id: str | None = None
    path: str = ""
    subset: list[str] | None = None  # Envoy's subset hint; None = no hint
    tokenizer: Tokenizer | None = None
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
        """The prompt tokens exactly as the engine will tokenize them (chat template applied)."""
        if self._token_ids is None:
            self._token_ids = _tokenize(self.body, self.tokenizer)
        return self._token_ids


def parse_body(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object with a 'model' field")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
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


def _tokenize(body: dict[str, Any] | None, tokenizer: Tokenizer | None) -> list[int]:
    """Mirrors the engine's own prompt handling (engine/server/serving.py) token for token:
    chat → template over {role, content text, name} then encode without special tokens;
    completions → encode(prompt, add_special_tokens=body.add_special_tokens, default true)."""
    if not body or tokenizer is None:
        return []
    messages = body.get("messages")
    if isinstance(messages, list):
        convo: list[dict[str, Any]] = []
        for m in messages:
            if not isinstance(m, dict):
                return []
            entry: dict[str, Any] = {"role": m.get("role"), "content": _content_text(m.get("content"))}
            if m.get("name"):
                entry["name"] = m["name"]
            convo.append(entry)
        raw_kwargs = body.get("chat_template_kwargs")
        kwargs: dict[str, Any] = raw_kwargs if isinstance(raw_kwargs, dict) else {}
        try:
            text = tokenizer.apply_chat_template(
                convo, add_generation_prompt=bool(body.get("add_generation_prompt", True)), **kwargs
            )
        except Exception:
            return []  # the engine will reject it; routing must not fail because of it
        if body.get("continue_final_message") and convo and convo[-1]["content"]:
            cut = text.rfind(convo[-1]["content"])
            if cut >= 0:
                text = text[: cut + len(convo[-1]["content"])]
        return tokenizer.encode(text, add_special_tokens=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=bool(body.get("add_special_tokens", True)))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return list(prompt)  # already token ids
    return []
