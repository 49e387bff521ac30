"""Prefill/decode disaggregation: the names the EPP, the engines and the operator share.

The EPP picks a decode engine (the destination Envoy connects to) and, when the prompt's
uncached part is long enough to pay for a KV hand-off, a prefill engine; the choice travels to
the decode engine in the ``x-prefiller-host-port`` request header (llm-d's name). The decode
engine's server runs the hand-off itself: it asks that prefill engine to prefill the prompt,
pulls the KV blocks, and decodes (llm-d puts this in a routing sidecar next to vLLM).

An endpoint's role says which side it serves: ``prefill`` engines are never a destination,
``decode`` engines are never picked to prefill for another, ``both`` serve either.
In Kubernetes the role is the pod label ``kvgate.dev/role``; locally a ``@role`` suffix on an
``--endpoints`` entry.
"""

from __future__ import annotations

PREFILLER_HEADER = "x-prefiller-host-port"
ROLE_LABEL = "kvgate.dev/role"

ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
ROLE_BOTH = "both"
ROLES = (ROLE_PREFILL, ROLE_DECODE, ROLE_BOTH)


def serves_decode(role: str) -> bool:
    """May be the destination of a request (decodes it, prefilling itself or pulling the KV)."""
    return role != ROLE_PREFILL


def serves_prefill(role: str) -> bool:
    """May be picked to prefill a prompt for another engine."""
    return role != ROLE_DECODE
