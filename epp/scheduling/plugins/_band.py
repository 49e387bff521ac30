"""The lowest band of a value over the candidates (GIE's least-queue and least-kv-cache filters)."""

from __future__ import annotations

from kvgate.epp.datastore import EndpointState


def lowest_band(endpoints: list[EndpointState], values: list[float]) -> list[EndpointState]:
    """The endpoints whose value lies within (max - min) / n of the minimum (GIE's band)."""
    if not endpoints:
        return endpoints
    lo, hi = min(values), max(values)
    band = (hi - lo) / len(endpoints)
    return [e for e, v in zip(endpoints, values, strict=True) if v <= lo + band]
