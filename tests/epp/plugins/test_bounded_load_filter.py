"""The bounded-load filter: affinity holds only while the holder stays within reach of its peers."""

from __future__ import annotations

from kvgate.epp.datastore import Datastore, Endpoint, EndpointMetrics
from kvgate.epp.request import InferenceRequest
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.plugins.bounded_load_filter import BoundedLoadFilter

NOW = 100.0


def pool(loads: dict[str, tuple[int, int]]) -> Datastore:
    """Endpoints with (running, waiting) as their last scrape says."""
    store = Datastore()
    store.set_endpoints([Endpoint(a) for a in loads])
    for address, (running, waiting) in loads.items():
        store.update_metrics(
            address, EndpointMetrics(running=running, waiting=waiting, updated_at=NOW, sent_at=NOW)
        )
    return store


def kept(store: Datastore, **kw: float) -> set[str]:
    ctx = SchedulingContext(InferenceRequest("r", "m", "m", {"model": "m"}), store, NOW)
    return {e.address for e in BoundedLoadFilter(**kw).filter(ctx, store.all())}  # type: ignore[arg-type]


def test_an_engine_far_busier_than_the_least_busy_is_dropped() -> None:
    store = pool({"hot": (30, 5), "a": (2, 0), "b": (4, 0)})
    assert kept(store) == {"a", "b"}


def test_an_ordinary_queue_keeps_the_holder() -> None:
    # 16 more than the least busy is within the absolute slack: affinity still decides
    store = pool({"holder": (14, 2), "a": (0, 0), "b": (3, 0)})
    assert kept(store) == {"holder", "a", "b"}


def test_under_pressure_the_bound_grows_with_the_least_load() -> None:
    # every engine busy: twice the least load (40) keeps the holder at 38, drops the one at 50
    store = pool({"holder": (30, 8), "a": (20, 0), "b": (30, 20)})
    assert kept(store) == {"holder", "a"}


def test_unconfirmed_picks_count_as_load() -> None:
    store = pool({"hot": (10, 0), "a": (0, 0)})
    hot = store.get("hot")
    assert hot is not None
    for _ in range(7):
        hot.note_pick(NOW, 100)
    assert kept(store) == {"a"}  # 17 against 0
    assert kept(store, absolute_slack=20) == {"hot", "a"}


def test_equal_loads_and_no_endpoints_pass_through() -> None:
    assert kept(pool({"a": (5, 5), "b": (5, 5)})) == {"a", "b"}
    assert kept(Datastore()) == set()
