"""Drain-aware routing and a load signal that needs no response phase, against real simulated
engines (`kvgate engine serve --simulate`) scraped by the real scraper in this process."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from kvgate.epp.datastore import Datastore, Endpoint
from kvgate.epp.director import Director
from kvgate.epp.request import InferenceRequest
from kvgate.epp.saturation import SaturationDetector
from kvgate.epp.scheduling.config import build_profiles, load_config
from kvgate.epp.scraper import MAPPINGS, MetricsScraper, parse_metrics
from kvgate.testing import eventually_async
from kvgate.testing import processes as harness

pytestmark = pytest.mark.timeout(60)
INTERVAL = 0.05


async def held_at(check: Callable[[], bool], within: float, what: str) -> float:
    """The monotonic time ``check()`` was first seen to hold (polled every 5 ms)."""
    await eventually_async(check, within, what, interval=0.005)
    return time.monotonic()


@pytest.fixture(autouse=True)
def _requests(req) -> None:
    global make_request
    make_request = req


make_request: Callable[..., InferenceRequest]


def request(prompt: str) -> InferenceRequest:
    return make_request(prompt)


@pytest.fixture
async def engines(tmp_path) -> AsyncIterator[list[harness.Engine]]:
    started = [
        harness.start_engine(
            tmp_path, "--sim-itl", "0.02", "--drain-grace-period", "2", "--shutdown-timeout", "5"
        )
        for _ in range(2)
    ]
    try:
        for e in started:
            await asyncio.to_thread(e.wait_ready)
        yield started
    finally:
        harness.stop_all(*(e.proc for e in started))


@pytest.fixture
async def scraped(engines) -> AsyncIterator[tuple[Datastore, Director]]:
    ds = Datastore()
    ds.set_endpoints([Endpoint(e.address) for e in engines])
    scraper = MetricsScraper(ds, MAPPINGS["vllm"], INTERVAL)
    cfg = load_config(None, "precise-prefix")
    director = Director(ds, build_profiles(cfg)[0], SaturationDetector())
    try:
        await eventually_async(lambda: all(ds.reachable(s) for s in ds.all()), 5, "both engines scraped")
        yield ds, director
    finally:
        await scraper.close()


def test_parse_draining_gauge() -> None:
    text = 'vllm:num_requests_waiting{model_name="m"} 2.0\nkvgate:draining{model_name="m",engine="0"} 1.0\n'
    m = parse_metrics(text, MAPPINGS["vllm"], now=5.0, sent_at=4.9)
    assert m.draining and m.waiting == 2 and m.sent_at == 4.9
    assert not parse_metrics(text.replace("} 1.0", "} 0.0"), MAPPINGS["vllm"], now=5.0).draining


async def test_sigterm_takes_engine_out_within_a_scrape_while_it_still_serves(engines, scraped) -> None:
    ds, director = scraped
    victim = engines[0]
    victim.proc.popen.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    dropped = await held_at(lambda: not ds.reachable(ds.get(victim.address)), 2, "the victim dropped")
    print(f"SIGTERM -> dropped from candidates: {(dropped - sent) * 1000:.0f} ms")
    # one scrape interval plus the engine's signal handling, with room for a loaded machine
    assert dropped - sent < 0.5
    assert ds.get(victim.address).metrics.draining
    # from then on every pick goes to the other engine ...
    picks = {director.pick(request(f"after {i}")).targets[0] for i in range(20)}
    assert picks == {engines[1].address}
    # ... and a request routed just before the drop is still served during the grace period
    async with httpx.AsyncClient() as client:
        late = await client.post(
            f"http://{victim.address}/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=10
        )
    assert late.status_code == 200, late.text


async def test_picks_count_until_a_scrape_shows_them_without_response_phase(engines, scraped) -> None:
    """No `finished` is ever called (Envoy skips the response phase): the load signal still
    rises with picks at once and falls back to the engine's own counts."""
    ds, director = scraped
    async with httpx.AsyncClient() as client:
        sent: list[asyncio.Task[httpx.Response]] = []
        # a burst between two scrapes spreads over both engines instead of piling on one
        targets = []
        for i in range(8):
            decision = director.pick(request(chr(ord("a") + i) * 40))  # no shared prefix
            targets.append(decision.targets[0])
            body = {"prompt": f"burst {i}", "max_tokens": 150, "ignore_eos": True}  # ~3 s each
            url = f"http://{decision.targets[0]}/v1/completions"
            sent.append(asyncio.create_task(client.post(url, json=body, timeout=10)))
        assert sorted(targets.count(e.address) for e in engines) == [4, 4]
        assert sum(s.pending for s in ds.all()) == 8

        # scrapes that come after the picks settle take over: our picks are dropped as the
        # engines report the requests themselves
        def engines_show_all() -> bool:
            states = ds.all()
            shown = sum(st.metrics.running + st.metrics.waiting for st in states)
            return all(st.pending == 0 for st in states) and shown == 8

        await eventually_async(engines_show_all, 3, "the engines' own counts", interval=0.005)
        assert sum(st.load() for st in ds.all()) == 8
        assert all(r.status_code == 200 for r in await asyncio.gather(*sent))
    await eventually_async(lambda: sum(s.load() for s in ds.all()) == 0, 10, "no load left")
    assert not ds.inflight_tracked and all(s.inflight > 0 for s in ds.all())  # stale, ignored


async def test_engine_requiring_api_key_on_metrics_is_scraped_with_it(tmp_path) -> None:
    eng = harness.start_engine(tmp_path, "--api-key", "sekret", "--metrics-require-api-key")
    try:
        await asyncio.to_thread(eng.wait_ready)
        for key, ok in ((None, False), ("wrong", False), ("sekret", True)):
            ds = Datastore()
            ds.set_endpoints([Endpoint(eng.address)])
            scraper = MetricsScraper(ds, MAPPINGS["vllm"], INTERVAL, api_key=key)
            try:
                state = ds.get(eng.address)
                if ok:
                    await eventually_async(lambda: ds.reachable(state), 3, f"scraped with {key!r}")  # noqa: B023
                else:
                    await eventually_async(
                        lambda: state.metrics.consecutive_failures >= 2,  # noqa: B023
                        3,
                        f"scrapes refused with {key!r}",
                    )
                    assert not ds.reachable(state)
            finally:
                await scraper.close()
    finally:
        harness.stop_all(eng.proc)


async def test_hung_engine_leaves_the_candidate_set_and_returns(engines, scraped) -> None:
    ds, director = scraped
    victim = engines[0]
    victim.proc.popen.send_signal(signal.SIGSTOP)  # hangs: accepts connections, answers nothing
    try:
        stopped = time.monotonic()
        gone = await held_at(lambda: not ds.reachable(ds.get(victim.address)), 8, "the hung engine dropped")
        print(f"SIGSTOP -> dropped from candidates: {gone - stopped:.1f} s")
        picks = {director.pick(request(chr(ord("a") + i) * 20)).targets[0] for i in range(10)}
        assert picks == {engines[1].address}
    finally:
        victim.proc.popen.send_signal(signal.SIGCONT)
    await eventually_async(lambda: ds.reachable(ds.get(victim.address)), 5, "the engine back")
