"""Flow control's metrics (EppMetrics.watch_flow_control), read from the Prometheus text output:
GIE's inference_extension_flow_control_* names and labels, kvgate's rejection and per-tenant
service counters, and the cap on fairness-id labels (ids can come from a client header)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.epp.datastore import Datastore, Endpoint, EndpointMetrics
from kvgate.epp.director import Director
from kvgate.epp.flow_control import FlowControlConfig, FlowController, FlowKey, footprint
from kvgate.epp.metrics import MAX_FAIRNESS_LABELS, EppMetrics
from kvgate.epp.request import InferenceRequest
from kvgate.epp.saturation import SaturationDetector
from kvgate.epp.scheduling.config import build_profiles, load_config

ENGINE = "10.0.0.1:8000"
QUEUE_SIZE = "inference_extension_flow_control_queue_size"
QUEUE_BYTES = "inference_extension_flow_control_queue_bytes"
QUEUE_DURATION = "inference_extension_flow_control_request_queue_duration_seconds"
REJECTIONS = "kvgate_epp_flow_control_rejections_total"
SERVICE = "kvgate_epp_flow_control_tenant_service_tokens_total"
REFUNDED = "kvgate_epp_flow_control_tenant_refunded_tokens_total"


class Tokens:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Pool:
    """One engine, a flow controller over it, and the EPP's metrics watching it."""

    def __init__(self, config: FlowControlConfig | None = None) -> None:
        self.clock = Clock()
        self.store = Datastore()
        self.store.set_endpoints([Endpoint(ENGINE)])
        self.room(False)
        (profile,) = [
            p for p in build_profiles(load_config(None, "precise-prefix")) if p.name == "precise-prefix"
        ]
        director = Director(self.store, profile, SaturationDetector(), clock=self.clock)
        self.controller = FlowController(director, config or FlowControlConfig(ttl_s=30), clock=self.clock)
        self.metrics = EppMetrics(self.store, "pool-a")
        self.metrics.watch_flow_control(self.controller)

    def room(self, room: bool) -> None:
        waiting = 0 if room else 100
        self.store.update_metrics(
            ENGINE, EndpointMetrics(updated_at=self.clock(), sent_at=self.clock(), waiting=waiting)
        )

    def submit(self, tenant: str, priority: int = 0, body_bytes: int = 100, rid: str = "r"):
        body = {"model": "m", "prompt": "hello", "max_tokens": 4}
        req = InferenceRequest(rid, "m", "m", body, priority=priority, fairness_id=tenant, tokenizer=Tokens())  # type: ignore[arg-type]
        return self.controller.submit(req, body_bytes)

    def samples(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        text = generate_latest(self.metrics.registry).decode()
        return {
            (s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def series(samples: dict, name: str) -> list[dict[str, str]]:
    return [dict(labels) for n, labels in samples if n == name]


def test_queue_size_and_bytes_are_read_at_scrape_time() -> None:
    pool = Pool()
    assert pool.controller.observer is pool.metrics
    pool.submit("team-a", body_bytes=300, rid="1")
    pool.submit("team-a", body_bytes=200, rid="2")
    pool.submit("team-b", priority=1, body_bytes=50, rid="3")
    s = pool.samples()
    flow_a = {"fairness_id": "team-a", "priority": "0", "inference_pool": "pool-a"}
    flow_b = {"fairness_id": "team-b", "priority": "1", "inference_pool": "pool-a"}
    assert value(s, QUEUE_SIZE, **flow_a) == 2
    assert value(s, QUEUE_SIZE, **flow_b) == 1
    # what the memory bound counts: bodies raw and parsed, prompt tokens, bookkeeping
    prompt = len(Tokens().encode("hello"))
    assert value(s, QUEUE_BYTES, inference_pool="pool-a") == sum(footprint(b, prompt) for b in (300, 200, 50))
    # room: all dispatched; the flows stay exported at 0 (graphs drop to 0, not end)
    pool.room(True)
    pool.controller.dispatch()
    s = pool.samples()
    assert value(s, QUEUE_SIZE, **flow_a) == 0 and value(s, QUEUE_SIZE, **flow_b) == 0
    assert value(s, QUEUE_BYTES, inference_pool="pool-a") == 0


def test_queue_time_of_dispatched_requests() -> None:
    pool = Pool()
    pool.submit("team-a", rid="1")
    pool.clock.now += 2.0  # held 2 s
    pool.room(True)
    assert [h.state for h in pool.controller.dispatch()] == ["dispatched"]
    pool.submit("team-a", rid="2")  # room now: dispatched at once, held 0 s
    s = pool.samples()
    labels = {"fairness_id": "team-a", "priority": "0", "outcome": "Dispatched", "inference_pool": "pool-a"}
    assert value(s, QUEUE_DURATION + "_count", **labels) == 2  # the dispatch count
    assert value(s, QUEUE_DURATION + "_sum", **labels) == pytest.approx(2.0)
    assert value(s, QUEUE_DURATION + "_bucket", **labels, le="1.0") == 1
    assert value(s, QUEUE_DURATION + "_bucket", **labels, le="2.5") == 2


def test_rejections_by_reason_with_ttl_expired_ready_at_zero() -> None:
    pool = Pool(FlowControlConfig(ttl_s=5, max_queued=2))
    pool.submit("team-a", rid="1")
    s = pool.samples()
    ttl = {"fairness_id": "team-a", "priority": "0", "reason": "ttl_expired", "inference_pool": "pool-a"}
    # the flow's ttl_expired series exists before its first expiry, so increase() sees that one
    assert value(s, REJECTIONS, **ttl) == 0
    pool.submit("team-a", rid="2")
    full = pool.submit("team-b", rid="3")
    assert full.state == "rejected"
    pool.clock.now += 6  # past the TTL
    pool.controller.dispatch()
    s = pool.samples()
    assert value(s, REJECTIONS, **ttl) == 2
    assert value(s, REJECTIONS, **{**ttl, "fairness_id": "team-b", "reason": "queue_full"}) == 1
    assert value(s, REJECTIONS, **{**ttl, "fairness_id": "team-b"}) == 0


def test_fairness_id_labels_are_capped() -> None:
    pool = Pool(FlowControlConfig(ttl_s=30))
    pool.metrics.fairness_label.configure(["configured-tenant"])
    for i in range(MAX_FAIRNESS_LABELS + 50):
        pool.submit(f"client-{i}", rid=str(i))
    pool.submit("configured-tenant", rid="c")
    s = pool.samples()
    ids = {labels["fairness_id"] for labels in series(s, QUEUE_SIZE)}
    assert len(ids) == MAX_FAIRNESS_LABELS + 2  # the first 100, "other", the configured tenant
    assert "client-0" in ids and f"client-{MAX_FAIRNESS_LABELS}" not in ids
    assert value(s, QUEUE_SIZE, fairness_id="other", priority="0", inference_pool="pool-a") == 50
    assert value(s, QUEUE_SIZE, fairness_id="configured-tenant", priority="0", inference_pool="pool-a") == 1
    pool.clock.now += 31
    pool.controller.dispatch()  # all expire
    s = pool.samples()
    other = {"fairness_id": "other", "priority": "0", "reason": "ttl_expired", "inference_pool": "pool-a"}
    assert value(s, REJECTIONS, **other) == 50
    assert len({labels["fairness_id"] for labels in series(s, REJECTIONS)}) == MAX_FAIRNESS_LABELS + 2


def test_service_charged_per_tenant_and_an_earlier_on_charge_still_called() -> None:
    store = Datastore()
    (profile,) = [
        p for p in build_profiles(load_config(None, "precise-prefix")) if p.name == "precise-prefix"
    ]
    controller = FlowController(Director(store, profile, SaturationDetector()))
    told: list[tuple[str, float]] = []
    controller.on_charge = lambda tenant, tokens: told.append((tenant, tokens))
    metrics = EppMetrics(store, "pool-a")
    metrics.watch_flow_control(controller)
    controller.charge("team-a", 100.0)
    controller.charge("team-a", -30.0)  # a request ended shorter than its estimate
    controller.charge("team-b", 7.5)
    controller.note_remote_service("team-c", 1000.0)  # another replica's: not this one's service
    assert told == [("team-a", 100.0), ("team-a", -30.0), ("team-b", 7.5)]
    text = generate_latest(metrics.registry).decode()
    assert f'{SERVICE}{{fairness_id="team-a",inference_pool="pool-a"}} 100.0' in text
    assert f'{REFUNDED}{{fairness_id="team-a",inference_pool="pool-a"}} 30.0' in text
    assert f'{SERVICE}{{fairness_id="team-b",inference_pool="pool-a"}} 7.5' in text
    assert "team-c" not in text


def test_a_scrape_that_meets_a_changing_queue_retries() -> None:
    class Racing:
        observer = None
        on_charge = None
        queued_bytes = 10
        calls = 0

        def queue_sizes(self) -> dict[FlowKey, int]:
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("dictionary changed size during iteration")
            return {FlowKey(0, "team-a"): 3}

    metrics = EppMetrics(Datastore(), "pool-a")
    metrics.watch_flow_control(Racing())  # type: ignore[arg-type]
    text = generate_latest(metrics.registry).decode()
    assert f'{QUEUE_SIZE}{{fairness_id="team-a",inference_pool="pool-a",priority="0"}} 3.0' in text
