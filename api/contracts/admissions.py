"""Admission announcements: how EPP replicas learn each other's picks through the engines.

Active-active EPP replicas share the engines' KV events, so they agree on what is cached. What
they do not share is what each one has just sent where: a request routed by replica A is
invisible to replica B until the engine stores its blocks (after its prefill, seconds later
under load) or a scrape counts it. Meanwhile B places the same new prefix elsewhere, keeps
routing to an engine whose KV A has already filled, and misjudges queues (measured on the
virtual pool, llm-d-shaped preset, 2 replicas against 1: prefix hit 59% vs 70% at 8 req/s).

So an engine that admits a request a kvgate EPP picked tells every subscriber at once, on the
socket that already carries its KV events, in a message of its own topic (vLLM-style
subscribers that filter on ``kv@`` never see it):

    frames: [b"kvgate-admitted@<host:port>@<model>", msgpack([ts, picked_by, lora_id, token_ids])]

``picked_by`` is the picking replica's id, which the EPP sends in the ``x-kvgate-picked-by``
request header; a replica skips its own picks (it recorded them when it made them). Requests
without the header (another router, a direct client) are not announced. Both sides import only
this module.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

import msgpack

PICKED_BY_HEADER = "x-kvgate-picked-by"
TOPIC_PREFIX = "kvgate-admitted@"
# A replica id: short and plain, since an engine copies it from a request header.
_REPLICA_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# A prompt longer than any context window is a forged message, not an admission.
MAX_TOKENS = 1 << 20


class AdmissionDecodeError(ValueError):
    """A payload that is not a valid admission announcement."""


@dataclass(frozen=True, slots=True)
class Admission:
    picked_by: str
    token_ids: list[int]
    lora_id: int | None = None
    ts: float = 0.0


def valid_replica_id(value: str | None) -> str | None:
    """The header value when it is a usable replica id, else None (then nothing is announced)."""
    if value is None or not _REPLICA_ID.match(value):
        return None
    return value


def topic_for(endpoint: str, model: str) -> bytes:
    return f"{TOPIC_PREFIX}{endpoint}@{model}".encode()


def is_admission_topic(topic: bytes) -> bool:
    return topic.startswith(TOPIC_PREFIX.encode())


def encode(admission: Admission) -> bytes:
    ts = admission.ts or time.time()
    return msgpack.packb([ts, admission.picked_by, admission.lora_id, list(admission.token_ids)])


def decode(payload: bytes) -> Admission:
    try:
        raw = msgpack.unpackb(payload, strict_map_key=True, max_array_len=MAX_TOKENS)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise AdmissionDecodeError(f"undecodable admission: {exc}") from None
    if not isinstance(raw, list) or len(raw) != 4:
        raise AdmissionDecodeError("an admission is [ts, picked_by, lora_id, token_ids]")
    ts, picked_by, lora_id, token_ids = raw
    if (
        not isinstance(ts, int | float)
        or not isinstance(picked_by, str)
        or valid_replica_id(picked_by) is None
    ):
        raise AdmissionDecodeError("admission: bad ts or picked_by")
    if lora_id is not None and not (isinstance(lora_id, int) and not isinstance(lora_id, bool)):
        raise AdmissionDecodeError("admission: lora_id must be an integer or null")
    if not isinstance(token_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in token_ids
    ):
        raise AdmissionDecodeError("admission: token_ids must be a list of token ids")
    return Admission(picked_by=picked_by, token_ids=token_ids, lora_id=lora_id, ts=float(ts))
