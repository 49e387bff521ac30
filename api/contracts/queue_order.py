"""Where a request stands in its engine's waiting queue: the EPP says, the engine orders by it.

The engine's default policy (`--scheduling-policy fair`) admits waiting requests by priority,
then the tenant served least, then arrival. The EPP stamps both on every request it forwards,
overwriting whatever a client sent:

- the tenant: GIE's ``x-gateway-inference-fairness-id`` (kvgate.api.contracts.admissions), the
  tenant its API key named with a tenants file;
- the priority: ``x-kvgate-priority``, the objective's priority as GIE counts it (higher is more
  important; sheddable work is negative);
- ``x-kvgate-over-share: 1`` when flow control found the tenant over its share of the pool's
  recent work: the engine runs it after the other requests of its priority.

A request without the header (a direct client) may set vLLM's body field ``priority``, where
lower goes first. Both sides import only this module.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from kvgate.api.contracts.admissions import FAIRNESS_ID_HEADER, valid_fairness_id

PRIORITY_HEADER = "x-kvgate-priority"
OVER_SHARE_HEADER = "x-kvgate-over-share"
# GIE priorities are small integers; anything else in the header is ignored, not trusted.
_PRIORITY = re.compile(r"^-?[0-9]{1,6}$")


@dataclass(frozen=True, slots=True)
class QueueOrder:
    """The engine's view: ``priority`` lower first (vLLM's convention), ``tenant`` "" untagged."""

    priority: int = 0
    tenant: str = ""
    over_share: bool = False


def order_from_headers(headers: Mapping[str, str], body_priority: int = 0) -> QueueOrder:
    """The queue order a request's headers ask for; the body's vLLM priority where the EPP set
    none (a malformed header counts as none)."""
    raw = headers.get(PRIORITY_HEADER)
    priority = -int(raw) if raw is not None and _PRIORITY.fullmatch(raw) else body_priority
    return QueueOrder(
        priority,
        valid_fairness_id(headers.get(FAIRNESS_ID_HEADER)) or "",
        headers.get(OVER_SHARE_HEADER) == "1",
    )
