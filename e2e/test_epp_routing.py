"""Through real Envoy + the EPP to simulated engines: routing, streaming, prefix affinity,
bad requests, model rewrite, load shedding."""

from __future__ import annotations

import json
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from kvgate.api.contracts.metrics import SATURATION_QUEUE_DEPTH
from kvgate.testing import eventually
from kvgate.testing import processes as harness

pytestmark = pytest.mark.timeout(120)

UPSTREAM = "x-kvgate-upstream"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with harness.gateway_stack(
        tmp_path_factory.mktemp("epp-routing"),
        engines=3,
        engine_args=("--max-num-seqs", "4"),
        epp_args=("--objective", "batch=-1", "--log-level", "debug"),
        epp_secure=True,
        failure_mode="FailClose",
        epp_tls=True,
    ) as running:
        yield running


def completion(client: httpx.Client, prompt: str, max_tokens: int = 4, **extra) -> httpx.Response:
    return client.post(
        "/v1/completions", json={"model": "default", "prompt": prompt, "max_tokens": max_tokens, **extra}
    )


@pytest.fixture
def client(stack):
    _, _, envoy = stack
    with httpx.Client(base_url=envoy.url, timeout=30) as c:
        yield c


def test_requests_reach_the_picked_endpoint(stack, client) -> None:
    engines, _, _ = stack
    by_address = {e.address: e for e in engines}
    seen = set()
    for i in range(6):
        before = {a: e.metric("vllm:request_success_total") for a, e in by_address.items()}
        resp = completion(client, f"request number {i} goes somewhere")
        assert resp.status_code == 200, resp.text
        served = resp.headers[UPSTREAM]
        assert served in by_address
        seen.add(served)
        after = {a: e.metric("vllm:request_success_total") for a, e in by_address.items()}
        assert {a: after[a] - before[a] for a in by_address} == {a: float(a == served) for a in by_address}
    assert len(seen) >= 2  # idle, equal endpoints: load spreads


def test_request_without_body_is_routed(client) -> None:
    resp = client.get("/v1/models")
    assert resp.status_code == 200
    assert resp.json()["data"][0]["id"] == "default"
    assert resp.headers[UPSTREAM]


def test_streaming_passes_through_intact(client) -> None:
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": "stream me some tokens"}],
        "max_tokens": 24,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(resp.iter_raw())
    events = [e for e in raw.decode().split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["usage"]["completion_tokens"] == 24
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] == "length"


def test_same_prefix_sticks_to_holder_while_load_stays_balanced(stack, client) -> None:
    prefixes = [
        f"System: you are assistant number {p}. "
        + " ".join(f"rule {p}.{k}: be helpful and precise." for k in range(12))
        for p in range(6)
    ]
    placements: dict[int, list[str]] = {p: [] for p in range(len(prefixes))}
    cached: dict[int, list[int]] = {p: [] for p in range(len(prefixes))}

    def send(p: int, r: int) -> None:
        resp = completion(client, prefixes[p] + f"\nUser: question {r}?", max_tokens=8)
        assert resp.status_code == 200, resp.text
        placements[p].append(resp.headers[UPSTREAM])
        cached[p].append(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    with ThreadPoolExecutor(len(prefixes)) as pool:
        for r in range(5):  # rounds: every prefix has one request in flight at a time
            list(pool.map(lambda p, r=r: send(p, r), range(len(prefixes))))

    for p, where in placements.items():
        _holder, n = Counter(where).most_common(1)[0]
        assert n >= 4, f"prefix {p} scattered: {where}"
        assert sum(1 for c in cached[p][1:] if c > 0) >= 3, f"prefix {p} got few cache hits: {cached[p]}"
    load = Counter(Counter(w).most_common(1)[0][0] for w in placements.values())
    assert len(load) >= 2 and max(load.values()) <= 4, f"prefixes piled onto one engine: {load}"
    # the precise index learnt those prefixes from the engines' own KV events
    _, epp, _ = stack
    live = [
        line for line in epp.metrics_text().splitlines() if line.startswith("kvgate_epp_prefix_index_blocks")
    ]
    assert live and all('kv_events_live="true"' in line for line in live)
    assert sum(float(line.rsplit(" ", 1)[1]) for line in live) > 0


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "not valid JSON"),
        (b'{"prompt": "no model here"}', "'model'"),
        (b"[1, 2]", "JSON object"),
    ],
)
def test_malformed_body_is_400_from_the_epp(stack, client, body, needle) -> None:
    engines, _, _ = stack
    before = sum(e.metric("vllm:prompt_tokens_total") for e in engines)
    resp = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error" and err["code"] == 400
    assert UPSTREAM not in resp.headers and "x-envoy-upstream-service-time" not in resp.headers
    assert sum(e.metric("vllm:prompt_tokens_total") for e in engines) == before


def test_model_name_rewrite(stack, client, tmp_path) -> None:
    body = {"model": "my-alias", "prompt": "rewrite me", "max_tokens": 3}
    rewrite = {"x-gateway-model-name-rewrite": "default"}
    # default gateway: the EPP stays out of the response path, so the engine's name shows
    resp = client.post("/v1/completions", json=body, headers=rewrite)
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == "default"
    # with the response phase on, the EPP rewrites it back: the client sees its own name
    _, epp, _ = stack
    envoy = harness.start_envoy(tmp_path, epp.grpc_port, epp_tls=True, response_phase=True)
    try:
        envoy.wait_ready()
        envoy.wait_epp_healthy()
        resp = httpx.post(f"{envoy.url}/v1/completions", json=body, headers=rewrite, timeout=30)
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == "my-alias"
    finally:
        harness.stop_all(envoy.proc)


@dataclass
class Saturation:
    """What the gateway answered while 45 long critical requests saturated the pool, and after."""

    shed: httpx.Response  # sheddable work while the EPP's scrape showed the pool saturated
    critical: httpx.Response  # critical work at the same time
    background: list[int]  # the statuses of the critical requests (45, and any sent to saturate)
    again: httpx.Response  # sheddable work once the pool drained


@pytest.fixture(scope="module")
def saturation(stack) -> Saturation:
    """Saturates the pool once per module (every test that needs a 429 seen shares it)."""
    engines, epp, envoy = stack
    client = httpx.Client(base_url=envoy.url, timeout=30)
    results: list[int] = []

    def background(i: int) -> None:
        with httpx.Client(base_url=envoy.url, timeout=60) as c:
            # long enough (~5 s each at the simulator's pace) that the pool's service rate,
            # 12 slots / 5 s, stays below any arrival rate the gateway manages: on a loaded
            # CI machine 120 tokens each (1.5 s) were served as fast as they came, 75 of them
            # without a queue ever forming
            r = completion(c, f"long critical job {i}", max_tokens=400, ignore_eos=True)
            results.append(r.status_code)

    def sheddable(prompt: str) -> httpx.Response:
        return client.post(
            "/v1/completions",
            json={"model": "default", "prompt": prompt, "max_tokens": 2},
            headers={"x-gateway-inference-objective": "batch"},
        )

    def shed_while_saturated() -> httpx.Response:
        # while the pool has no room (flow control holds critical work in the EPP: the engines
        # make requests wait), sheddable work is refused; the queues drain as we go, so check
        # and send together
        held = _gauge_sum(epp.metrics_text(), "inference_extension_flow_control_queue_size")
        # Or the engines queue it themselves: on a loaded machine the EPP's metrics can be too
        # old for flow control to judge room, and then it holds nothing and lets work through.
        waiting = [e.metric("vllm:num_requests_waiting") for e in engines]
        full = held >= 1 or min(waiting) >= SATURATION_QUEUE_DEPTH
        if not full and len(threads) < 75:
            # All 45 may have been routed before a scrape showed the engines' queues (a loaded
            # machine spreads them out less): one more arrival, now, is held if the pool is full.
            extra = threading.Thread(target=background, args=(len(threads),))
            threads.append(extra)
            extra.start()
        assert full, f"not saturated yet: {held} held, engines waiting {waiting}, done {Counter(results)}"
        shed = sheddable("sheddable work")
        assert shed.status_code == 429, shed.text
        return shed

    threads = [threading.Thread(target=background, args=(i,)) for i in range(45)]
    with client:
        for t in threads:
            t.start()
        try:
            shed = eventually(shed_while_saturated, 20, "a sheddable request refused while saturated")
            critical = client.post(
                "/v1/completions",
                json={"model": "default", "prompt": "critical work", "max_tokens": 2},
                headers={"x-gateway-inference-objective": "interactive"},
            )
        finally:
            for t in threads:
                t.join(60)
        # once the pool drains, sheddable traffic is admitted again
        eventually(lambda: _gauge(epp.metrics_text(), "inference_pool_average_queue_size") < 1.0, 10, "drain")
        again = sheddable("sheddable later")
    return Saturation(shed, critical, results, again)


def test_sheddable_gets_429_when_saturated_while_critical_is_served(saturation: Saturation) -> None:
    assert saturation.shed.status_code == 429, saturation.shed.text
    assert saturation.shed.json()["error"]["type"] == "rate_limit_exceeded"
    assert saturation.critical.status_code == 200, saturation.critical.text
    assert len(saturation.background) >= 45 and set(saturation.background) == {200}
    assert saturation.again.status_code == 200, saturation.again.text


GIE_METRICS = (
    "inference_objective_request_total",
    "inference_objective_request_error_total",
    "inference_objective_request_duration_seconds_bucket",
    "inference_extension_scheduler_e2e_duration_seconds_bucket",
    "inference_extension_plugin_duration_seconds_bucket",
    "inference_pool_average_kv_cache_utilization",
)
PRECISE_SCORER = (
    'extension_point="Scorer",plugin_name="predicted-latency-scorer",plugin_type="predicted-latency-scorer"'
)


def test_epp_exports_gie_metrics(stack, client, saturation: Saturation) -> None:
    """The EPP's own answers (a 400 here, the 429 of `saturation`) and routed requests show up
    in GIE's metric families; runs alone as well as after the other tests."""
    _, epp, _ = stack
    assert saturation.shed.status_code == 429
    assert client.post("/v1/completions", content=b"{not json").status_code == 400
    assert completion(client, "a routed request").status_code == 200

    def exported() -> str:
        text = epp.metrics_text()
        missing = [n for n in GIE_METRICS if n not in text]
        missing += [c for c in ('error_code="400"', 'error_code="429"', PRECISE_SCORER) if c not in text]
        assert not missing, f"not exported (yet): {missing}"
        return text

    # the duration of a request is recorded when its exchange with Envoy ends, after the reply
    text = eventually(exported, 10, "the GIE metrics")
    assert _gauge(text, "inference_pool_ready_pods") == 3


def _gauge_sum(text: str, name: str) -> float:
    """A gauge summed over its series (0 when none is exported yet)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_log_lines_carry_request_id_and_reason(stack, client) -> None:
    _, epp, _ = stack
    client.post(
        "/v1/completions",
        json={"model": "default", "prompt": "trace me", "max_tokens": 2},
        headers={"x-request-id": "trace-123"},
    )

    def traced() -> list[dict]:
        text = epp.proc.log_path.read_text()
        return [json.loads(line) for line in text.splitlines() if "trace-123" in line]

    lines = eventually(traced, 5, "the EPP's log line for trace-123")
    assert lines[0]["request_id"] == "trace-123" and "profile=precise-prefix" in lines[0]["msg"]
