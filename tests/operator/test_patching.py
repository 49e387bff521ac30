"""The operator's apply semantics: what counts as drift, and which merge patch repairs it."""

from __future__ import annotations

import json

from kvgate.operator.reconcile import (
    APPLIED_ANNOTATION,
    is_subset,
    patch_for,
    removals,
    with_applied_annotation,
)


def test_defaults_and_foreign_fields_are_not_drift() -> None:
    want = {"spec": {"ports": [{"port": 80}], "replicas": 2, "cpu": "2"}}
    have = {
        "spec": {"ports": [{"port": 80, "protocol": "TCP"}], "replicas": 2, "cpu": 2, "extra": True},
        "status": {"ready": 1},
    }
    assert is_subset(want, have)


def test_changed_values_list_lengths_and_booleans_are_drift() -> None:
    assert not is_subset({"a": 1}, {"a": 2})
    assert not is_subset({"a": [1, 2]}, {"a": [1]})
    assert not is_subset({"a": [1]}, {"a": [1, 2]})
    assert not is_subset({"a": True}, {"a": "True"})
    assert not is_subset({"a": {"b": 1}}, {})


def test_removals_null_what_we_set_before_except_handed_over_replicas() -> None:
    before = {
        "spec": {"replicas": 3, "template": {"lifecycle": {"preStop": {}}, "image": "x"}},
        "metadata": {},
    }
    now = {"spec": {"template": {"image": "y"}}, "metadata": {}}
    assert removals(before, now) == {"spec": {"template": {"lifecycle": None}}}


def test_patch_for_merges_nulls_into_the_desired_object() -> None:
    first = with_applied_annotation(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "c", "labels": {"a": "1", "b": "2"}},
            "data": {"k": "v", "old": "x"},
        }
    )
    second = with_applied_annotation(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "c", "labels": {"a": "1"}},
            "data": {"k": "v2"},
        }
    )
    live = {
        **first,
        "metadata": {**first["metadata"], "labels": {**first["metadata"]["labels"], "keda": "kept"}},
    }
    patch = patch_for(second, live)
    assert patch["data"] == {"k": "v2", "old": None}
    assert patch["metadata"]["labels"] == {"a": "1", "b": None}  # `keda` (not ours) is untouched
    assert "apiVersion" not in patch and "kind" not in patch
    recorded = json.loads(patch["metadata"]["annotations"][APPLIED_ANNOTATION])
    assert recorded["data"] == {"k": "v2"}


def test_an_unchanged_child_needs_no_patch() -> None:
    desired = with_applied_annotation(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"k": "v"}}
    )
    live = json.loads(json.dumps(desired))
    live["metadata"].update(uid="u", resourceVersion="7", creationTimestamp="2026-01-01T00:00:00Z")
    assert is_subset(desired, live)
