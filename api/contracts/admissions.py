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

    frames: [b"kvgate-admitted@<host:port>@<model>",
             msgpack([ts, picked_by, lora_id, token_ids])
             or msgpack([ts, picked_by, lora_id, token_ids, fairness_id, service_tokens])]

``picked_by`` is the picking replica's id, which the EPP sends in the ``x-kvgate-picked-by``
request header; a replica skips its own picks (it recorded them when it made them). Requests
without the header (another router, a direct client) are not announced. Both sides import only
this module.

The six-element form also carries what the pick cost in fair shares, so replicas that each hold
part of the traffic keep one pool-wide count of each tenant's service (kvgate.epp.flow_sharing):
``fairness_id`` from the ``x-gateway-inference-fairness-id`` header and ``service_tokens`` (the
weighted tokens the picking replica charged the tenant) from ``x-kvgate-service-tokens``. An
engine sends it only when the EPP set a valid ``x-kvgate-service-tokens``: an EPP from before
this field sends no such header, so it never gets a message it cannot decode. A decoder takes
four elements, or six and more (later fields are ignored, so a seventh can be added the same way).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

import msgpack

PICKED_BY_HEADER = "x-kvgate-picked-by"
# GIE's fairness header; the EPP sets it on every request it forwards (its tenant's name).
FAIRNESS_ID_HEADER = "x-gateway-inference-fairness-id"
# The service (weighted tokens, a non-negative decimal number: str(float) writes one) the
# picking replica charged the request's tenant at dispatch; the engine copies it into the
# admission.
SERVICE_TOKENS_HEADER = "x-kvgate-service-tokens"
MAX_SERVICE_TOKENS = 1e9
TOPIC_PREFIX = "kvgate-admitted@"
# A replica id: short and plain, since an engine copies it from a request header.
_REPLICA_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# A fairness id (a tenant's name): short and plain, as the EPP's tenants file requires.
_FAIRNESS_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
# A plain decimal number: what str() writes for any float in [0, MAX_SERVICE_TOKENS].
_DECIMAL = re.compile(r"^[0-9]{1,10}(?:\.[0-9]{1,24})?(?:[eE][+-]?[0-9]{1,3})?$")
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
    fairness_id: str | None = None  # the tenant served (None: not told)
    service_tokens: float = 0.0  # weighted tokens the picking replica charged it


@dataclass(frozen=True, slots=True)
class Pick:
    """What a request's headers ask its engine to announce on admission."""

    picked_by: str
    fairness_id: str | None = None
    service_tokens: float = 0.0


def valid_replica_id(value: str | None) -> str | None:
    """The header value when it is a usable replica id, else None (then nothing is announced)."""
    if value is None or not _REPLICA_ID.fullmatch(value):
        return None
    return value


def valid_fairness_id(value: str | None) -> str | None:
    """The header value when it could name a tenant, else None."""
    if value is None or not _FAIRNESS_ID.fullmatch(value):
        return None
    return value


def valid_service_tokens(value: str | None) -> float | None:
    """The header value as a number of weighted tokens when it is a plain decimal number in
    [0, MAX_SERVICE_TOKENS], else None."""
    if value is None or not _DECIMAL.fullmatch(value):
        return None
    tokens = float(value)
    if not math.isfinite(tokens) or not 0 <= tokens <= MAX_SERVICE_TOKENS:
        return None
    return tokens


def pick_from_headers(headers: Mapping[str, str]) -> Pick | None:
    """The announcement a request's headers ask for: None without a valid replica id; the
    tenant and its service only when both headers are valid (else the plain announcement)."""
    picked_by = valid_replica_id(headers.get(PICKED_BY_HEADER))
    if picked_by is None:
        return None
    tokens = valid_service_tokens(headers.get(SERVICE_TOKENS_HEADER))
    fairness_id = valid_fairness_id(headers.get(FAIRNESS_ID_HEADER)) if tokens is not None else None
    if fairness_id is None or tokens is None:
        return Pick(picked_by)
    return Pick(picked_by, fairness_id, tokens)


def topic_for(endpoint: str, model: str) -> bytes:
    return f"{TOPIC_PREFIX}{endpoint}@{model}".encode()


def is_admission_topic(topic: bytes) -> bool:
    return topic.startswith(TOPIC_PREFIX.encode())


def encode(admission: Admission) -> bytes:
    """Four elements unless the admission names a tenant or a service (then six)."""
    ts = admission.ts or time.time()
    fields = [ts, admission.picked_by, admission.lora_id, list(admission.token_ids)]
    if admission.fairness_id is not None or admission.service_tokens:
        fields += [admission.fairness_id, float(admission.service_tokens)]
    return msgpack.packb(fields)


def decode(payload: bytes) -> Admission:
    try:
        raw = msgpack.unpackb(payload, strict_map_key=True, max_array_len=MAX_TOKENS)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise AdmissionDecodeError(f"undecodable admission: {exc}") from None
    if not isinstance(raw, list) or not (len(raw) == 4 or len(raw) >= 6):
        raise AdmissionDecodeError(
            "an admission is [ts, picked_by, lora_id, token_ids(, fairness_id, service_tokens)]"
        )
    ts, picked_by, lora_id, token_ids = raw[:4]
    fairness_id, service_tokens = raw[4:6] if len(raw) >= 6 else (None, 0.0)
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
    if fairness_id is not None and (
        not isinstance(fairness_id, str) or valid_fairness_id(fairness_id) is None
    ):
        raise AdmissionDecodeError("admission: fairness_id must be a tenant name or null")
    if (
        not isinstance(service_tokens, int | float)
        or isinstance(service_tokens, bool)
        or not math.isfinite(service_tokens)
        or not 0 <= service_tokens <= MAX_SERVICE_TOKENS
    ):
        raise AdmissionDecodeError(
            f"admission: service_tokens must be a number in [0, {MAX_SERVICE_TOKENS:g}]"
        )
    return Admission(
        picked_by=picked_by,
        token_ids=token_ids,
        lora_id=lora_id,
        ts=float(ts),
        fairness_id=fairness_id,
        service_tokens=float(service_tokens),
    )
