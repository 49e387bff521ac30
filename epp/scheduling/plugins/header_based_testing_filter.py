"""The `header-based-testing-filter` filter (HeaderBasedTestingFilter)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvgate.epp.datastore import EndpointState
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.registry import Consumes, register

# GIE's conformance suite names the pods a request may go to in this header
TEST_ENDPOINT_SELECTION_HEADER = "test-epp-endpoint-selection"


@register
@dataclass
class HeaderBasedTestingFilter:
    """Keeps the endpoints a request's ``test-epp-endpoint-selection`` header names (comma
    separated, ``ip`` or ``ip:port``), as GIE's conformance EPP does; with no header, or none
    of its entries in the pool, every endpoint passes. For conformance runs only: it lets a
    client choose its endpoint, so no built-in profile but ``conformance`` has it."""

    type_name: ClassVar[str] = "header-based-testing-filter"
    consumes: ClassVar[frozenset[Consumes]] = frozenset()
    name: str = type_name

    def filter(self, ctx: SchedulingContext, endpoints: list[EndpointState]) -> list[EndpointState]:
        wanted = {
            w.strip()
            for w in ctx.request.headers.get(TEST_ENDPOINT_SELECTION_HEADER, "").split(",")
            if w.strip()
        }
        if not wanted:
            return endpoints
        chosen = [e for e in endpoints if e.address in wanted or e.address.rsplit(":", 1)[0] in wanted]
        return chosen or endpoints
