"""model-served-filter: never an engine that does not serve the request's model (an adapter
loaded at run time on some engines only), unknown lists kept, and no change where every engine
serves every model (so the built-in profiles pick exactly as before on the usual bench)."""

from __future__ import annotations

import random
import time

import pytest

from kvgate.epp.datastore import Datastore, Endpoint, EndpointMetrics
from kvgate.epp.scheduling.config import BUILTIN_PROFILES, build_profiles, load_config, parse_config
from kvgate.epp.scheduling.framework import SchedulingContext
from kvgate.epp.scheduling.plugins.model_served_filter import ModelServedFilter


def ctx(store: Datastore, req, model: str) -> SchedulingContext:
    return SchedulingContext(req("a prompt", model=model), store, time.monotonic())


def serve(store: Datastore, *lists: set[str]) -> None:
    for state, names in zip(store.all(), lists, strict=True):
        state.served_models = frozenset(names)


def addresses(endpoints) -> list[str]:
    return [e.address for e in endpoints]


def test_keeps_only_the_engines_that_list_the_model(store: Datastore, req) -> None:
    a, b, c = addresses(store.all())
    serve(store, {"base", "sql"}, {"base"}, {"base", "sql"})
    f = ModelServedFilter()
    assert addresses(f.filter(ctx(store, req, "sql"), store.all())) == [a, c]
    # the base model is everywhere: every engine stays, in order
    assert addresses(f.filter(ctx(store, req, "base"), store.all())) == [a, b, c]


def test_an_engine_without_a_model_list_yet_is_kept(store: Datastore, req) -> None:
    a, _b, c = addresses(store.all())
    serve(store, {"base", "sql"}, {"base"}, set())  # c has not answered GET /v1/models yet
    assert addresses(ModelServedFilter().filter(ctx(store, req, "sql"), store.all())) == [a, c]


def test_a_model_listed_nowhere_passes_everything_through(store: Datastore, req) -> None:
    # no new error path: the engine's own 404 answers (or the adapter is too new for the poll)
    serve(store, {"base"}, {"base"}, {"base"})
    f = ModelServedFilter()
    assert len(f.filter(ctx(store, req, "nope"), store.all())) == 3
    serve(store, set(), set(), set())  # nothing reported at all
    assert len(f.filter(ctx(store, req, "sql"), store.all())) == 3


def test_an_adapter_running_there_counts_as_served(store: Datastore, req) -> None:
    # vllm:lora_requests_info (every scrape) shows it before the next GET /v1/models poll
    _a, b, c = addresses(store.all())
    serve(store, {"base"}, {"base"}, {"base"})
    store.update_metrics(
        b, EndpointMetrics(updated_at=time.monotonic(), max_lora=2, running_loras=frozenset({"x"}))
    )
    store.update_metrics(
        c, EndpointMetrics(updated_at=time.monotonic(), max_lora=2, waiting_loras=frozenset({"x"}))
    )
    assert addresses(ModelServedFilter().filter(ctx(store, req, "x"), store.all())) == [b, c]


def test_a_model_list_beats_a_running_label(store: Datastore, req) -> None:
    # the adapter moved from a to b: a's list dropped it, but a request still runs under it
    # there (lora_requests_info: running) and a answers 404 to any new one
    a, b, _c = addresses(store.all())
    serve(store, {"base"}, {"base", "x"}, {"base"})
    store.update_metrics(
        a, EndpointMetrics(updated_at=time.monotonic(), max_lora=2, running_loras=frozenset({"x"}))
    )
    assert addresses(ModelServedFilter().filter(ctx(store, req, "x"), store.all())) == [b]


def test_it_filters_the_candidates_it_is_given(store: Datastore, req) -> None:
    a, b, c = addresses(store.all())
    serve(store, {"sql"}, {"base"}, {"sql"})
    some = [s for s in store.all() if s.address != a]
    assert addresses(ModelServedFilter().filter(ctx(store, req, "sql"), some)) == [c]
    # a candidate set where none serves it: pass through (the others were filtered out before)
    assert addresses(ModelServedFilter().filter(ctx(store, req, "sql"), some[:1])) == [b]


# (conformance: the suite's client names the pod, and its fake model is served nowhere)
@pytest.mark.parametrize("name", [n for n in BUILTIN_PROFILES if n != "conformance"])
def test_every_builtin_profile_starts_with_it(name: str) -> None:
    (profile,) = build_profiles(load_config(None, name))
    assert profile.filters[0].type_name == "model-served-filter"


def test_it_is_configurable_by_name() -> None:
    cfg = parse_config(
        {
            "plugins": [{"type": "model-served-filter"}, {"type": "random-picker"}],
            "schedulingProfiles": [
                {
                    "name": "p",
                    "plugins": [{"pluginRef": "model-served-filter"}, {"pluginRef": "random-picker"}],
                }
            ],
        }
    )
    (profile,) = build_profiles(cfg)
    assert isinstance(profile.filters[0], ModelServedFilter)


@pytest.mark.parametrize("name", list(BUILTIN_PROFILES))
def test_where_every_engine_serves_every_model_the_picks_are_unchanged(name: str, req) -> None:
    """The same random load, the same picks, with and without the filter in the profile."""

    def picks(with_filter: bool) -> list[str]:
        store = Datastore()
        store.set_endpoints([Endpoint(f"10.0.0.{i}:8000") for i in range(1, 5)])
        rng = random.Random(7)
        (profile,) = build_profiles(load_config(None, name))
        if not with_filter:
            profile.filters = [f for f in profile.filters if f.type_name != "model-served-filter"]
        if hasattr(profile.picker, "rng"):
            profile.picker.rng = random.Random(3)
        out = []
        for i in range(60):
            for s in store.all():
                s.served_models = frozenset({"base", "a", "b"})
                s.served_adapters = frozenset({"a", "b"})
                store.update_metrics(
                    s.address,
                    EndpointMetrics(
                        updated_at=time.monotonic(),
                        waiting=rng.randrange(4),
                        running=rng.randrange(8),
                        kv_usage=rng.random(),
                        max_lora=2,
                        running_loras=frozenset(rng.sample(["a", "b"], rng.randrange(3))),
                    ),
                )
            model = rng.choice(["base", "a", "b"])
            c = SchedulingContext(req(f"prompt {i % 5} " * 8, model=model), store, time.monotonic())
            target = profile.run(c, store.all()).targets[0]
            profile.pre_request(c, target)  # the approximate prefix scorer learns the pick
            out.append(target.address)
        return out

    assert picks(True) == picks(False)
