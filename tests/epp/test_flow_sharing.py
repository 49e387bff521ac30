"""One pool-wide fairness across EPP replicas (kvgate.epp.flow_sharing): the service another replica
charged a tenant, announced by the engine that admitted its pick, counts in this replica's flow
controller — from the datastore, through a real flow controller's order, and over real ZMQ."""

from __future__ import annotations

import asyncio

import pytest

from kvgate.api.contracts.admissions import Admission
from kvgate.epp.datastore import Datastore, Endpoint, EndpointMetrics
from kvgate.epp.director import Director
from kvgate.epp.flow_control import FlowControlConfig, FlowController
from kvgate.epp.flow_sharing import share_service
from kvgate.epp.kv_subscriber import KVEventSubscribers
from kvgate.epp.request import InferenceRequest
from kvgate.epp.saturation import SaturationDetector
from kvgate.epp.scheduling.config import build_profiles, load_config
from kvgate.testing import eventually_async

NOW = 100.0
ENGINES = ["10.0.0.1:8000", "10.0.0.2:8000"]


class Noted:
    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []

    def note_remote_service(self, tenant: str, tokens: float) -> None:
        self.calls.append((tenant, tokens))


class Tokens:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def store_with_engines(waiting: int = 0) -> Datastore:
    store = Datastore()
    store.set_endpoints([Endpoint(a) for a in ENGINES])
    for address in ENGINES:
        store.update_metrics(
            address, EndpointMetrics(updated_at=NOW, sent_at=NOW, waiting=waiting, prefill_tokens_pending=0)
        )
    return store


def test_other_replicas_service_is_noted_and_nothing_else() -> None:
    store = store_with_engines()
    noted = Noted()
    share_service(noted, store)
    told = Admission("replica-a", [1, 2], fairness_id="team-a", service_tokens=300.0)
    store.note_admission(ENGINES[0], told)
    store.note_admission(ENGINES[1], Admission("replica-a", [1, 2]))  # an EPP that does not tell
    store.note_admission(ENGINES[1], Admission("replica-a", [1], fairness_id="team-a", service_tokens=0.0))
    store.note_admission(ENGINES[1], Admission("replica-a", [1], service_tokens=5.0))  # no tenant
    store.note_admission(
        ENGINES[1], Admission(store.replica_id, [1], fairness_id="team-a", service_tokens=9.0)
    )
    assert noted.calls == [("team-a", 300.0)]


def test_a_tenant_served_through_another_replica_waits_here() -> None:
    """Two tenants queued on replica B, no room anywhere; meanwhile replica A serves `heavy` a
    lot (announced by the engines). When room comes, B sends `light` first, though `heavy`
    queued first; without the announcement, `heavy` would go first."""

    def request(tenant: str, rid: str) -> InferenceRequest:
        body = {"model": "m", "prompt": f"hello from {tenant}", "max_tokens": 8}
        return InferenceRequest(rid, "m", "m", body, tokenizer=Tokens(), fairness_id=tenant)  # type: ignore[arg-type]

    def first_sent(announced: bool) -> str:
        store = store_with_engines(waiting=10)  # queues past the dispatch depth: no room
        (profile,) = [
            p for p in build_profiles(load_config(None, "precise-prefix")) if p.name == "precise-prefix"
        ]
        director = Director(store, profile, SaturationDetector(), clock=lambda: NOW)
        controller = FlowController(director, FlowControlConfig(ttl_s=60), clock=lambda: NOW)
        share_service(controller, store)
        held = [controller.submit(request("heavy", "r1")), controller.submit(request("light", "r2"))]
        assert [h.state for h in held] == ["queued", "queued"]
        if announced:
            store.note_admission(
                ENGINES[0], Admission("replica-a", [1], fairness_id="heavy", service_tokens=50_000.0)
            )
            assert controller.counters["heavy"] >= 50_000.0
        # room for a few (the announced pick counts as queued there too, until a scrape shows it)
        for address in ENGINES:
            store.update_metrics(
                address, EndpointMetrics(updated_at=NOW, sent_at=NOW, waiting=2, prefill_tokens_pending=0)
            )
        sent = controller.dispatch()
        assert sent
        return sent[0].key.fairness_id

    assert first_sent(announced=False) == "heavy"
    assert first_sent(announced=True) == "light"


async def test_service_announced_by_an_engine_reaches_the_flow_controller() -> None:
    pytest.importorskip("kvgate.engine.server.kv_publisher")
    from kvgate.engine.server.kv_publisher import KVEventPublisher

    address = ENGINES[0]
    pub = KVEventPublisher("tcp://127.0.0.1:*", topic=f"kv@{address}@m")
    store = Datastore()
    noted = Noted()
    share_service(noted, store)
    subs = KVEventSubscribers(store)
    try:
        store.set_endpoints([Endpoint(address, kv_events=pub.endpoint)])

        async def delivered() -> bool:
            # PUB drops what it sends before the SUB has connected: resend until one lands
            pub.publish_admission(store.replica_id, [9], None, "team-a", 7.0)  # our own: never counted
            pub.publish_admission("replica-b", [1, 2, 3], None, "team-b", 1536.5)
            await asyncio.sleep(0.05)
            return bool(noted.calls)

        await eventually_async(delivered, 10, "an announced service delivered")
        assert set(noted.calls) == {("team-b", 1536.5)}
    finally:
        await subs.close()
        pub.close()
