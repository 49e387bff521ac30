"""Moving a LoRA adapter between engines under load, as the operator does: clients send requests
for it continuously through real Envoy and the EPP over gRPC while it is loaded on the engine
that does not hold it and then unloaded from the one that does, several times back and forth.
Not one request fails. The EPP drops the old holder within ~50-100 ms of the unload (its next
look at that engine's GET /v1/models); requests it routed there meanwhile land because the
engine still serves an unloaded adapter for --lora-unload-grace (default 2 s). A move back
within the grace cancels that unload. Without the grace this lost ~1.7 requests per move (404)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from kvgate.testing import processes as harness
from kvgate.testing.polling import eventually

pytestmark = pytest.mark.timeout(90)
UPSTREAM = "x-kvgate-upstream"
ADAPTER = "moving-lora"
CLIENTS = 4
# Seconds after each move: 0.7 is within the grace (2 s), so the move back cancels the unload
# still pending there; 2.6 is past it, so the old holder really unregisters the adapter.
MOVE_WAITS_S = (0.7, 2.6, 0.7, 2.6, 0.7, 2.6)
ENGINE_ARGS = ("--enable-lora", "--sim-itl", "0.005", "--sim-time-scale", "1")


def _post(address: str, path: str, body: dict[str, str]) -> None:
    resp = httpx.post(f"http://{address}{path}", json=body, timeout=10)
    assert resp.status_code == 200, resp.text


def test_moving_an_adapter_under_load_fails_no_request(tmp_path) -> None:
    with harness.gateway_stack(tmp_path, engines=2, engine_args=ENGINE_ARGS) as (engines, _, envoy):
        load = {"lora_name": ADAPTER, "lora_path": str(tmp_path)}  # simulated: any folder is one
        unload = {"lora_name": ADAPTER}
        _post(engines[0].address, "/v1/load_lora_adapter", load)

        def served() -> bool:
            r = httpx.post(
                f"{envoy.url}/v1/completions", json={"model": ADAPTER, "prompt": "x", "max_tokens": 1}
            )
            return r.status_code == 200

        eventually(served, 5, "the gateway serves the adapter")

        stop = threading.Event()
        failures: list[str] = []
        served_by: dict[str, int] = {}
        lock = threading.Lock()

        def client(n: int) -> None:
            with httpx.Client(base_url=envoy.url, timeout=20) as c:
                i = 0
                while not stop.is_set():
                    body = {"model": ADAPTER, "prompt": f"client {n} asks {i} " * 3, "max_tokens": 4}
                    r = c.post("/v1/completions", json=body)
                    with lock:
                        if r.status_code != 200:
                            failures.append(f"{r.status_code} from {r.headers.get(UPSTREAM)}: {r.text[:160]}")
                        else:
                            upstream = r.headers.get(UPSTREAM) or "?"
                            served_by[upstream] = served_by.get(upstream, 0) + 1
                    i += 1

        threads = [threading.Thread(target=client, args=(n,)) for n in range(CLIENTS)]
        for t in threads:
            t.start()
        try:
            time.sleep(0.3)
            holder, other = engines
            for wait in MOVE_WAITS_S:
                _post(other.address, "/v1/load_lora_adapter", load)  # the new holder first...
                _post(holder.address, "/v1/unload_lora_adapter", unload)  # ...then off the old one
                holder, other = other, holder
                time.sleep(wait)
        finally:
            stop.set()
            for t in threads:
                t.join()
        total = sum(served_by.values()) + len(failures)
        assert not failures, f"{len(failures)} of {total} failed: {failures[:5]}"
        assert total > 50, served_by  # the clients did keep sending all along
        # both engines took a share in turn: the adapter did move
        assert set(served_by) == {e.address for e in engines}, served_by
        # and it ends on the last holder only
        models = {e.address: httpx.get(f"http://{e.address}/v1/models").json()["data"] for e in engines}
        listed = {a for a, cards in models.items() if any(m["id"] == ADAPTER for m in cards)}
        assert listed == {holder.address}
        gone = httpx.post(f"http://{other.address}/v1/completions", json={"model": ADAPTER, "prompt": "x"})
        assert gone.status_code == 404  # past its grace the old holder no longer serves it
