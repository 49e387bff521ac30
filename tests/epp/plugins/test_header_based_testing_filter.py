"""header-based-testing-filter (kvgate.epp.scheduling.plugins.header_based_testing_filter); the
conformance profile around it is tested in tests/epp/test_conformance_profile.py."""

from __future__ import annotations

from kvgate.epp.datastore import Datastore
from kvgate.epp.scheduling.plugins.header_based_testing_filter import (
    TEST_ENDPOINT_SELECTION_HEADER,
    HeaderBasedTestingFilter,
)
from kvgate.testing.scheduling import ctx_for, make_request


def _kept(store: Datastore, selection: str | None) -> list[str]:
    req = make_request()
    if selection is not None:
        req.headers[TEST_ENDPOINT_SELECTION_HEADER] = selection
    return [e.address for e in HeaderBasedTestingFilter().filter(ctx_for(store, req), store.all())]


def test_keeps_the_endpoints_the_header_names_by_address_or_ip(store: Datastore) -> None:
    a, b, c = (s.address for s in store.all())
    assert _kept(store, c) == [c]
    assert _kept(store, f"{a}, {b.rsplit(':', 1)[0]}") == [a, b]


def test_without_the_header_or_a_match_every_endpoint_passes(store: Datastore) -> None:
    everyone = [s.address for s in store.all()]
    assert _kept(store, None) == everyone
    assert _kept(store, "") == everyone
    assert _kept(store, "10.9.9.9,10.0.0.1:9999") == everyone
