"""Status conditions (metav1.Condition) that keep their transition time while unchanged."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Literal

Status = Literal["True", "False", "Unknown"]


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class Cond:
    type: str
    status: Status
    reason: str
    message: str


def merge_conditions(
    previous: list[dict[str, Any]] | None, new: list[Cond], generation: int | None
) -> list[dict[str, Any]]:
    """New conditions in order; a condition whose status did not change keeps its timestamp."""
    old = {c.get("type"): c for c in previous or []}
    stamp = now_rfc3339()
    out: list[dict[str, Any]] = []
    for cond in new:
        before = old.get(cond.type)
        if before is None or before.get("status") != cond.status:
            since = stamp  # new, or its status changed
        else:
            since = before.get("lastTransitionTime", stamp)
        entry: dict[str, Any] = {
            "type": cond.type,
            "status": cond.status,
            "reason": cond.reason,
            "message": cond.message,
            "lastTransitionTime": since,
        }
        if generation is not None:
            entry["observedGeneration"] = generation
        out.append(entry)
    return out


def find(conditions: list[dict[str, Any]] | None, type_: str) -> dict[str, Any] | None:
    return next((c for c in conditions or [] if c.get("type") == type_), None)
