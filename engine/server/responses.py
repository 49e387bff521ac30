"""Response bodies of the OpenAI API, as plain dicts and SSE frames.

Built by hand rather than through pydantic: a streamed token costs one small dict and one
`json.dumps`, which matters when eight engines share two cores.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvgate.engine.outputs import PositionLogprobs, RequestOutput


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

    def usage(self, finals: dict[int, RequestOutput]) -> dict[str, Any]:
        completion = sum(len(o.token_ids) for o in finals.values())
        prompt = sum(self.prompt_lens)
        # Cached tokens of each prompt's first choice: what the prefix cache saved that prompt.
        cached = sum(
            finals[i * self.n].num_cached_tokens for i in range(len(self.prompt_lens)) if i * self.n in finals
        )
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
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
