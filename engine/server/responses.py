"""Response bodies of the OpenAI API, as plain dicts and SSE frames.

Built by hand rather than through pydantic: a streamed token costs one small dict and one
`json.dumps`, which matters when eight engines share two cores.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvgate.api.tracing import NO_SPAN, Span
from kvgate.engine.outputs import PositionLogprobs, PromptTokenLogprobs, RequestOutput


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj: Any) -> bytes:
    return f"data: {dumps(obj)}\n\n".encode()


SSE_DONE = b"data: [DONE]\n\n"


@dataclass
class ResponseMeta:
    """What every chunk and the usage block of one client request share."""

    rid: str
    created: int
    model: str
    n: int
    prompt_lens: list[int]
    span: Span = field(default=NO_SPAN, repr=False)  # the request's (kvgate.engine.request)

    def trace_finals(self, finals: dict[int, RequestOutput]) -> None:
        """What the finished sequences say about themselves that only the engine knows, on the
        request's span: speculative decoding's drafts and acceptance (summed over choices), when
        the engine speculates."""
        spec = [o for o in finals.values() if o.spec_num_draft_tokens is not None]
        if self.span is NO_SPAN or not spec:
            return
        self.span.set_attributes(
            {
                "kvgate.spec_decode.num_drafts": sum(o.spec_num_drafts or 0 for o in spec),
                "kvgate.spec_decode.num_draft_tokens": sum(o.spec_num_draft_tokens or 0 for o in spec),
                "kvgate.spec_decode.num_accepted_tokens": sum(o.spec_num_accepted_tokens or 0 for o in spec),
            }
        )

    def usage(self, finals: dict[int, RequestOutput]) -> dict[str, Any]:
        completion = sum(len(o.token_ids) for o in finals.values())
        prompt = sum(self.prompt_lens)
        # Cached tokens of each prompt's first choice: what the prefix cache saved that prompt.
        firsts = [finals[i * self.n] for i in range(len(self.prompt_lens)) if i * self.n in finals]
        cached = sum(o.num_cached_tokens for o in firsts)
        details: dict[str, int] = {"cached_tokens": cached}
        host = sum(o.num_host_cached_tokens for o in firsts)
        if host:
            # kvgate's extension: of cached_tokens, those loaded from the host KV tier
            details["cached_tokens_cpu"] = host
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": details,
        }


def stream_error(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": status}}


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprobs(positions: list[PositionLogprobs]) -> list[dict[str, Any]]:
    return [
        {
            "token": p.sampled.decoded,
            "logprob": p.sampled.logprob,
            "bytes": _token_bytes(p.sampled.decoded),
            "top_logprobs": [
                {"token": t.decoded, "logprob": t.logprob, "bytes": _token_bytes(t.decoded)} for t in p.top
            ],
        }
        for p in positions
    ]


def completion_logprobs(positions: list[PositionLogprobs] | None, start_offset: int) -> dict[str, Any]:
    positions = positions or []
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = start_offset
    for p in positions:
        tokens.append(p.sampled.decoded)
        token_logprobs.append(p.sampled.logprob)
        entry = {t.decoded: t.logprob for t in p.top}
        entry.setdefault(p.sampled.decoded, p.sampled.logprob)
        top.append(entry)
        offsets.append(offset)
        offset += len(p.sampled.decoded)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


# JSON has no -inf; vLLM clamps logprobs to this floor in its responses.
_LOGPROB_FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(value, _LOGPROB_FLOOR)


def prompt_logprobs_json(entries: list[PromptTokenLogprobs | None]) -> list[dict[str, Any] | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then per position a map
    token id -> {logprob, rank, decoded_token}: the actual prompt token first, then the top-K."""
    out: list[dict[str, Any] | None] = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        d = {
            str(e.token.token_id): {
                "logprob": _lp(e.token.logprob),
                "rank": e.rank,
                "decoded_token": e.token.decoded,
            }
        }
        for rank, t in enumerate(e.top, start=1):
            d.setdefault(
                str(t.token_id), {"logprob": _lp(t.logprob), "rank": rank, "decoded_token": t.decoded}
            )
        out.append(d)
    return out


def echo_completion_logprobs(
    entries: list[PromptTokenLogprobs | None], first_token: str, generated: list[PositionLogprobs] | None
) -> dict[str, Any]:
    """Completions with echo + logprobs: the prompt tokens' logprobs (OpenAI's null for the first
    token) followed by the generated ones, text offsets running on through both."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = 0
    for e in entries:
        if e is None:
            tokens.append(first_token)
            token_logprobs.append(None)
            top.append(None)
        else:
            tokens.append(e.token.decoded)
            token_logprobs.append(_lp(e.token.logprob))
            entry = {t.decoded: _lp(t.logprob) for t in e.top}
            entry.setdefault(e.token.decoded, _lp(e.token.logprob))
            top.append(entry)
        offsets.append(offset)
        offset += len(tokens[-1])
    rest = completion_logprobs(generated, offset)
    return {
        "tokens": tokens + rest["tokens"],
        "token_logprobs": token_logprobs + rest["token_logprobs"],
        "top_logprobs": top + rest["top_logprobs"],
        "text_offset": offsets + rest["text_offset"],
    }
