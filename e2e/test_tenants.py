"""Tenants through real Envoy and a real EPP (`kvgate epp serve --tenants`): the openai client
with a tenant's key is served, without one or with a wrong one it gets OpenAI's 401, and the
fairness id the engine receives is the tenant the key names, whatever header the client forges.

The engine is a stub that records each request's headers (no engine cost: what is tested is
what the gateway lets through and what it tells the engine).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from kvgate.local.stack import kvgate_argv
from kvgate.testing import eventually
from kvgate.testing import processes as harness
from kvgate.testing.upstream_stub import stub_handler, stub_in_thread, vllm_metrics

pytestmark = pytest.mark.timeout(120)

ALICE_KEY = "sk-alice-e2e-0123456789abcdef"
BOB_KEY = "sk-bob-e2e-0123456789abcdef00"
ENGINE_KEY = "engine-e2e-0123456789abcdef0123"  # the engines' --api-key, which the EPP knows
FAIRNESS_HEADER = "x-gateway-inference-fairness-id"


@dataclass
class Gateway:
    url: str
    heads: list[bytes]  # every POST the engine stub received, request line and headers
    tenants: Path  # the EPP's tenants file
    epp_log: Path

    def fairness_ids_seen(self, since: int) -> list[str]:
        """The fairness-id header values of the POSTs the engine got after the first `since`."""
        return self.header_seen(since, FAIRNESS_HEADER)

    def header_seen(self, since: int, header: str) -> list[str]:
        """A header's values in the POSTs the engine got after the first `since`."""
        out = []
        for head in self.heads[since:]:
            for line in head.decode("latin-1").split("\r\n")[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == header:
                    out.append(value.strip())
        return out


@pytest.fixture(scope="module")
def engine_stub() -> Iterator[tuple[str, list[bytes]]]:
    """An engine stand-in on a loop and thread of its own, recording request heads."""
    heads: list[bytes] = []
    with stub_in_thread(stub_handler(vllm_metrics("default"), heads=heads)) as address:
        yield address, heads


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, engine_stub) -> Iterator[Gateway]:
    log_dir = tmp_path_factory.mktemp("tenants")
    tenants = log_dir / "tenants.yaml"
    tenants.write_text(
        f"- {{name: alice, key: {ALICE_KEY}, weight: 2}}\n- {{name: bob, key: {BOB_KEY}, priority: 1}}\n"
    )
    address, heads = engine_stub
    grpc, health, metrics = harness.free_ports(3)
    argv = kvgate_argv(
        "epp",
        "serve",
        "--endpoints",
        address,
        "--grpc-port",
        str(grpc),
        "--grpc-health-port",
        str(health),
        "--metrics-port",
        str(metrics),
        "--secure-serving=false",
        "--profile",
        "random",  # no tokenizer to load
        "--tenants",
        str(tenants),
    )
    epp_proc = harness.Process(
        f"epp-{grpc}", argv, log_dir / f"epp-{grpc}.log", env={"KVGATE_API_KEY": ENGINE_KEY}
    ).start()
    procs = [epp_proc]
    try:
        epp = harness.Epp(epp_proc, grpc, health, metrics, secure=False)
        envoy = harness.start_envoy(log_dir, grpc, health, failure_mode="FailClose")
        procs.append(envoy.proc)
        harness.wait_gateway(epp, envoy)
        yield Gateway(envoy.url, heads, tenants, epp_proc.log_path)
    finally:
        harness.stop_all(*procs)


def client(gw: Gateway, key: str, **kw: object) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30, **kw)  # type: ignore[arg-type]


def test_a_tenants_key_is_served_and_the_engine_sees_the_tenant(gateway: Gateway) -> None:
    before = len(gateway.heads)
    reply = client(gateway, ALICE_KEY).completions.create(model="default", prompt="hello", max_tokens=1)
    assert reply.choices[0].text == "ok"
    assert gateway.fairness_ids_seen(before) == ["alice"]
    # the queue order the engine is told; the tenant's key stays at the gateway and the engines'
    # own key takes its place (engines that require it serve only what the EPP picked)
    assert gateway.header_seen(before, "x-kvgate-priority") == ["0"]
    assert gateway.header_seen(before, "authorization") == [f"Bearer {ENGINE_KEY}"]
    assert len(gateway.heads) == before + 1 and ALICE_KEY.encode() not in gateway.heads[before]


def test_no_key_and_a_wrong_key_are_openais_401(gateway: Gateway) -> None:
    before = len(gateway.heads)
    with pytest.raises(openai.AuthenticationError) as caught:
        client(gateway, "sk-wrong-0000000000000000").completions.create(
            model="default", prompt="hi", max_tokens=1
        )
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key" and caught.value.type == "invalid_request_error"
    assert "Incorrect API key provided" in caught.value.message

    # No Authorization header at all (the openai client always sends one).
    resp = httpx.post(
        f"{gateway.url}/v1/completions",
        json={"model": "default", "prompt": "hi", "max_tokens": 1},
        timeout=30,
    )
    assert resp.status_code == 401, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    assert resp.headers["www-authenticate"] == "Bearer"
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "invalid_api_key" and err["message"].startswith("You didn't provide an API key")
    # a bodyless request needs the key too
    assert httpx.get(f"{gateway.url}/v1/models", timeout=30).status_code == 401
    assert len(gateway.heads) == before  # nothing reached the engine


def test_a_forged_fairness_header_does_not_change_the_tenant(gateway: Gateway) -> None:
    before = len(gateway.heads)
    bob = client(gateway, BOB_KEY, default_headers={FAIRNESS_HEADER: "alice"})
    bob.completions.create(model="default", prompt="pretend to be alice", max_tokens=1)
    bob.completions.create(
        model="default", prompt="still bob", max_tokens=1, extra_headers={FAIRNESS_HEADER: "default"}
    )
    assert gateway.fairness_ids_seen(before) == ["bob", "bob"]


def test_keys_rotate_without_a_restart(gateway: Gateway) -> None:
    """The EPP reads its tenants file again when it changes (kvgate.epp.tenants.TenantsReloader,
    every 2 s): a key added is served, a key removed gets 401 from then on, and a broken edit
    leaves the keys in force."""
    carol = "sk-carol-e2e-0123456789abcdef"
    original = gateway.tenants.read_text()

    def status(key: str) -> int:
        return httpx.post(
            f"{gateway.url}/v1/completions",
            json={"model": "default", "prompt": "hi", "max_tokens": 1},
            headers={"authorization": f"Bearer {key}"},
            timeout=30,
        ).status_code

    assert status(carol) == 401
    try:
        gateway.tenants.write_text(original + f"- {{name: carol, key: {carol}}}\n")
        eventually(lambda: status(carol) == 200, 15, "the added key served")
        refusals = gateway.epp_log.read_text().count("tenants file not reloaded")
        gateway.tenants.write_text("- {name: [not, a, name], key: short}\n")  # a bad edit
        eventually(
            lambda: gateway.epp_log.read_text().count("tenants file not reloaded") > refusals,
            15,
            "the bad edit read and refused",
        )
        assert status(carol) == 200 and status(ALICE_KEY) == 200  # the keys in force stay
    finally:
        gateway.tenants.write_text(original)
    eventually(lambda: status(carol) == 401, 15, "the removed key refused")
    assert status(ALICE_KEY) == 200


def test_a_bypass_header_from_a_client_skips_nothing(gateway: Gateway) -> None:
    """`x-kvgate-route: direct` (the latency bench's route around the EPP) exists only where a
    gateway is built with --direct-upstream, which no tenant stack is: from a client it routes
    through the EPP like any request, and without a key that is OpenAI's 401."""
    before = len(gateway.heads)
    for headers in (
        {"x-kvgate-route": "direct"},
        {"x-kvgate-route": "direct", "authorization": "Bearer nope"},
    ):
        r = httpx.post(
            f"{gateway.url}/v1/completions",
            json={"model": "default", "prompt": "hi", "max_tokens": 1},
            headers=headers,
            timeout=30,
        )
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert len(gateway.heads) == before  # nothing reached the engine
