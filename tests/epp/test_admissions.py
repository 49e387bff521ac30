"""Admission announcements: active-active EPP replicas learn each other's picks from the engines
(kvgate.api.contracts.admissions) — the wire format, what a replica does with one, and one over
real ZMQ from the engine's publisher to the EPP's subscriber."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from kvgate.api.contracts import admissions
from kvgate.api.contracts.admissions import Admission, AdmissionDecodeError, Pick
from kvgate.epp.datastore import Datastore, Endpoint, EndpointMetrics
from kvgate.epp.director import Director
from kvgate.epp.kv_subscriber import KVEventSubscribers
from kvgate.epp.request import InferenceRequest
from kvgate.epp.saturation import SaturationDetector
from kvgate.epp.scheduling.config import build_profiles, load_config
from kvgate.testing import eventually_async

NOW = 100.0
ENGINES = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]


class Tokens:
    """One token per character."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def request(prompt: str, rid: str) -> InferenceRequest:
    body = {"model": "m", "prompt": prompt, "max_tokens": 10}
    return InferenceRequest(rid, "m", "m", body, tokenizer=Tokens())  # type: ignore[arg-type]


def replica(profile: str = "precise-prefix") -> tuple[Datastore, Director]:
    store = Datastore()
    store.set_endpoints([Endpoint(a, kv_events=f"tcp://{a}") for a in ENGINES])
    for state in store.all():
        state.kv_events_live = True
        store.update_metrics(
            state.address, EndpointMetrics(updated_at=NOW, sent_at=NOW, prefill_tokens_pending=0)
        )
    (built,) = [p for p in build_profiles(load_config(None, profile)) if p.name == profile]
    return store, Director(store, built, SaturationDetector(), clock=lambda: NOW)


# -- the wire format ----------------------------------------------------------------------------


def test_round_trip() -> None:
    sent = Admission("replica-a", [1, 2, 3, 70000], lora_id=7, ts=5.0)
    assert admissions.decode(admissions.encode(sent)) == sent
    assert len(msgpack.unpackb(admissions.encode(sent))) == 4  # no tenant: the old layout
    told = Admission("replica-a", [1, 2], ts=5.0, fairness_id="team-a", service_tokens=1536.5)
    assert len(msgpack.unpackb(admissions.encode(told))) == 6
    assert admissions.decode(admissions.encode(told)) == told
    assert admissions.topic_for("10.0.0.1:8000", "m") == b"kvgate-admitted@10.0.0.1:8000@m"
    assert admissions.is_admission_topic(b"kvgate-admitted@x@m")
    assert not admissions.is_admission_topic(b"kv@x@m")


def test_old_and_newer_layouts_decode() -> None:
    old = admissions.decode(msgpack.packb([5.0, "replica-a", None, [1, 2]]))
    assert old == Admission("replica-a", [1, 2], ts=5.0)
    assert (old.fairness_id, old.service_tokens) == (None, 0.0)
    # an integer service, and a field from a later version after the six: taken, ignored
    newer = admissions.decode(msgpack.packb([5, "replica-a", 3, [1], "t.1", 100, {"later": 1}]))
    assert newer == Admission("replica-a", [1], lora_id=3, ts=5.0, fairness_id="t.1", service_tokens=100.0)
    assert admissions.decode(msgpack.packb([5.0, "a", None, [1], None, 0.0])).fairness_id is None


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1garbage",
        msgpack.packb([1.0, "a", None, [1], "t"]),  # five fields
        msgpack.packb([1.0, "a", None, [1], "bad tenant", 1.0]),
        msgpack.packb([1.0, "a", None, [1], "-leading-dash", 1.0]),
        msgpack.packb([1.0, "a", None, [1], "t" * 64, 1.0]),
        msgpack.packb([1.0, "a", None, [1], "t\n", 1.0]),
        msgpack.packb([1.0, "a", None, [1], 7, 1.0]),
        msgpack.packb([1.0, "a", None, [1], "t", "12"]),
        msgpack.packb([1.0, "a", None, [1], "t", True]),
        msgpack.packb([1.0, "a", None, [1], "t", -1.0]),
        msgpack.packb([1.0, "a", None, [1], "t", 1e10]),
        msgpack.packb([1.0, "a", None, [1], "t", float("nan")]),
        msgpack.packb([1.0, "a", None, [1], "t", float("inf")]),
        msgpack.packb([1.0, "a\n", None, [1]]),
        msgpack.packb({"not": "a list"}),
        msgpack.packb([1.0, "a", None]),  # three fields
        msgpack.packb([1.0, "bad id with spaces", None, [1]]),
        msgpack.packb([1.0, "a" * 65, None, [1]]),
        msgpack.packb([1.0, "a", "lora", [1]]),
        msgpack.packb([1.0, "a", None, [1, True]]),
        msgpack.packb([1.0, "a", None, [1, -1]]),
        msgpack.packb([1.0, "a", None, [1, 2**40]]),
        msgpack.packb([1.0, "a", None, "tokens"]),
    ],
)
def test_forged_payloads_are_refused(raw: bytes) -> None:
    with pytest.raises(AdmissionDecodeError):
        admissions.decode(raw)


def test_header_values_that_name_no_replica_ask_for_nothing() -> None:
    assert admissions.valid_replica_id("3f2a9c01b7e4") == "3f2a9c01b7e4"
    for bad in (None, "", "a b", "x" * 65, "é", "a\nb", "a\n"):
        assert admissions.valid_replica_id(bad) is None


def test_service_tokens_header() -> None:
    for good, value in (("0", 0.0), ("12", 12.0), ("1536.25", 1536.25), ("1e9", 1e9), ("2.5E3", 2500.0)):
        assert admissions.valid_service_tokens(good) == value
    for number in (0.1 + 0.2, 0.060113050056425206, 1e-7, 999999999.9999999, 1234.5678901234567):
        assert admissions.valid_service_tokens(str(number)) == number  # what str(float) writes
    for bad in (None, "", "-1", "1e10", "1000000001", "nan", "inf", "Infinity", "1e999", " 1", "1 ", "1_0",
                "0x10", "+1", "1.", ".5", "1\n", "١٢"):  # fmt: skip
        assert admissions.valid_service_tokens(bad) is None, bad


def test_fairness_id_header() -> None:
    for good in ("default", "team-a", "t.1_x", "A" * 63, "0"):
        assert admissions.valid_fairness_id(good) == good
    for bad in (None, "", "-a", ".a", "a b", "A" * 64, "é", "a\n", "a/b"):
        assert admissions.valid_fairness_id(bad) is None, bad


@pytest.mark.parametrize(
    ("headers", "pick"),
    [
        ({}, None),
        ({"x-kvgate-service-tokens": "10", "x-gateway-inference-fairness-id": "t"}, None),  # no replica
        ({"x-kvgate-picked-by": "bad id"}, None),
        ({"x-kvgate-picked-by": "r1"}, Pick("r1")),
        # an EPP that does not tell the service: the old announcement, whatever the fairness id
        ({"x-kvgate-picked-by": "r1", "x-gateway-inference-fairness-id": "t"}, Pick("r1")),
        (
            {"x-kvgate-picked-by": "r1", "x-gateway-inference-fairness-id": "t", "x-kvgate-service-tokens": "12.5"},
            Pick("r1", "t", 12.5),
        ),
        # one of the two invalid: neither is announced
        ({"x-kvgate-picked-by": "r1", "x-gateway-inference-fairness-id": "t", "x-kvgate-service-tokens": "-3"},
         Pick("r1")),
        ({"x-kvgate-picked-by": "r1", "x-gateway-inference-fairness-id": "t t", "x-kvgate-service-tokens": "3"},
         Pick("r1")),
        ({"x-kvgate-picked-by": "r1", "x-kvgate-service-tokens": "3"}, Pick("r1")),
    ],
)  # fmt: skip
def test_what_the_headers_ask_the_engine_to_announce(headers: dict[str, str], pick: Pick | None) -> None:
    assert admissions.pick_from_headers(headers) == pick


# -- what a replica does with one ---------------------------------------------------------------


def test_a_replica_ignores_its_own_picks_and_unknown_endpoints() -> None:
    store, _ = replica()
    seen: list[str] = []
    store.subscribe_admissions(lambda address, adm: seen.append(address))
    store.note_admission(ENGINES[0], Admission(store.replica_id, [1, 2, 3]))
    store.note_admission("10.9.9.9:8000", Admission("other", [1, 2, 3]))
    assert seen == []
    store.note_admission(ENGINES[0], Admission("other", [1, 2, 3]))
    assert seen == [ENGINES[0]]


def test_replicas_get_distinct_ids() -> None:
    assert len({Datastore().replica_id for _ in range(50)}) == 50


def test_another_replicas_pick_counts_as_queued_work_there() -> None:
    store, _ = replica()
    target = store.get(ENGINES[1])
    assert target is not None and target.pending_prefill_tokens() == 0
    store.note_admission(ENGINES[1], Admission("replica-a", [ord("x")] * 500))
    assert target.pending_prefill_tokens() == 500
    # the engine's next scrape (sent after the settle time) shows it: no longer counted twice
    store.update_metrics(ENGINES[1], EndpointMetrics(updated_at=NOW + 5, sent_at=NOW + 5))
    assert target.pending_prefill_tokens() == 0


@pytest.mark.parametrize("profile", ["precise-prefix", "precise-prefix-weights"])
def test_a_new_prefix_picked_by_one_replica_is_followed_by_the_other(profile: str) -> None:
    """Replica A places a new 2,000-token system prompt; before that engine has stored a block,
    replica B gets a request with the same prompt. With the engine's announcement B sends it to
    the same engine (a cache hit to come); without, it places the prompt a second time."""
    prefix = "s" * 2000
    a_store, a = replica(profile)
    first = a.pick(request(prefix + " first question", "r1"))
    assert first.routed
    chosen = first.targets[0]

    def second_pick(announced: bool) -> str:
        b_store, b = replica(profile)
        # Both replicas' scrapes now show the chosen engine busy with that first prefill.
        for store in (a_store, b_store):
            store.update_metrics(
                chosen, EndpointMetrics(updated_at=NOW, sent_at=NOW, waiting=1, prefill_tokens_pending=2015)
            )
        if announced:
            b_store.note_admission(
                chosen, Admission(a_store.replica_id, Tokens().encode(prefix + " first question"))
            )
        decision = b.pick(request(prefix + " second question", "r2"))
        assert decision.routed
        return decision.targets[0]

    assert second_pick(announced=False) != chosen
    assert second_pick(announced=True) == chosen


# -- over real ZMQ: engine publisher -> EPP subscriber -------------------------------------------


async def test_subscriber_delivers_announcements_from_the_engine_publisher() -> None:
    pytest.importorskip("kvgate.engine.server.kv_publisher")
    from kvgate.engine.server.kv_publisher import KVEventPublisher

    address = ENGINES[0]
    pub = KVEventPublisher("tcp://127.0.0.1:*", topic=f"kv@{address}@m")
    store = Datastore()
    got: list[tuple[str, Admission]] = []
    store.subscribe_admissions(lambda a, adm: got.append((a, adm)))
    subs = KVEventSubscribers(store)
    try:
        store.set_endpoints([Endpoint(address, kv_events=pub.endpoint)])

        async def delivered() -> bool:
            # PUB drops what it sends before the SUB has connected: resend until one lands
            pub.publish_admission(store.replica_id, [9, 9], None)  # our own: never delivered
            pub.publish_admission("replica-b", [1, 2, 3], 4)
            await asyncio.sleep(0.05)
            return bool(got)

        await eventually_async(delivered, 10, "an admission announcement delivered")
        where, adm = got[0]
        assert where == address
        assert adm.picked_by == "replica-b" and adm.token_ids == [1, 2, 3] and adm.lora_id == 4
        assert all(a.picked_by == "replica-b" for _, a in got)
        # announcements are not KV events: the index and its sequence are untouched
        assert store.index.block_count(address) == 0
        assert subs.subscribers[address].last_seq is None
    finally:
        await subs.close()
        pub.close()


def _scrape(store: Datastore, address: str, sent_at: float) -> None:
    store.update_metrics(address, EndpointMetrics(updated_at=sent_at, sent_at=sent_at))


def test_an_own_pick_stays_counted_until_a_scrape_after_its_admission() -> None:
    """An engine that announces admissions shows a pick once it has admitted it. A scrape sent
    before that (the request still behind Envoy, or the engine still parsing a long prompt)
    must not clear the pick, or the engine looks idle while the prompt is on its way."""
    store = Datastore(replica_id="me")
    address = ENGINES[0]
    store.add(Endpoint(address))
    state = store.get(address)
    assert state is not None
    store.note_admission(address, Admission("other", [1, 2]), now=NOW)  # it announces
    state.note_pick(NOW)
    state.note_pick(NOW + 0.001)
    _scrape(store, address, NOW + 0.2)  # no admission heard yet: both still counted
    assert state.pending == 2
    store.note_admission(address, Admission("me", [1, 2]), now=NOW + 0.3)
    _scrape(store, address, NOW + 0.31)  # sent within the settle time: may not show it yet
    assert state.pending == 2
    _scrape(store, address, NOW + 0.4)
    assert state.pending == 1
    _scrape(store, address, NOW + 1.2)  # never announced: counted as shown after a second
    assert state.pending == 0 and not state.own_admissions


def test_without_announcements_a_pick_counts_as_shown_a_settle_time_later() -> None:
    store = Datastore(replica_id="me")
    address = ENGINES[0]
    store.add(Endpoint(address))
    state = store.get(address)
    assert state is not None
    state.note_pick(NOW)
    _scrape(store, address, NOW + 0.01)
    assert state.pending == 1
    _scrape(store, address, NOW + 0.05)
    assert state.pending == 0
