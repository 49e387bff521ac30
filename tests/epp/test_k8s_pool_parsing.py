"""The EPP reads its InferencePool with GIE's v1 model (the one the CRD is generated from)."""

from __future__ import annotations

import pytest

from kvgate.epp.datastore import Datastore
from kvgate.epp.k8s import PoolSpec, PoolWatcher, pool_spec

GOOD = {
    "spec": {"selector": {"matchLabels": {"app": "llm"}}, "targetPorts": [{"number": 8000}], "newField": 1}
}


def test_a_v1_pool_parses_and_fields_from_a_newer_gie_are_ignored() -> None:
    assert pool_spec(GOOD) == PoolSpec({"app": "llm"}, (8000,))


@pytest.mark.parametrize(
    "spec",
    [
        {"selector": {"matchLabels": {"app": "llm"}}},  # no targetPorts
        {"selector": {"matchLabels": {"app": "llm"}}, "targetPorts": [{"number": 0}]},
        {"selector": {}, "targetPorts": [{"number": 8000}]},  # selects nothing
        {"targetPortNumber": 8000, "selector": {"app": "llm"}},  # v1alpha2's shape
    ],
)
def test_a_pool_that_does_not_parse_is_refused(spec: dict) -> None:
    with pytest.raises(ValueError):
        pool_spec({"spec": spec})


def test_the_watcher_keeps_the_last_good_spec_when_an_update_does_not_parse() -> None:
    watcher = PoolWatcher(Datastore(), "pool", "ns")
    watcher._set_spec(GOOD)
    watcher._set_spec({"spec": {"selector": {"matchLabels": {"app": "llm"}}, "targetPorts": []}})
    assert watcher.spec == PoolSpec({"app": "llm"}, (8000,))
