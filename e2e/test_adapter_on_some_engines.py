"""An adapter loaded at run time on one engine only (as the operator loads adapters, pod by pod):
through real Envoy and the EPP over gRPC, every request for it lands on that engine, none on
the other engine, which would answer 404. The EPP learns it from the engines' GET /v1/models
(model-served-filter); before the filter about half of these requests were 404s. The EPP asks
an engine's list again within a scrape of a load or unload there (epp/scraper.py), so moving
the adapter to the other engine is followed within a second, not at the 10 s poll."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from kvgate.testing import processes as harness
from kvgate.testing.polling import eventually

pytestmark = pytest.mark.timeout(90)
UPSTREAM = "x-kvgate-upstream"
ADAPTER = "late-lora"
REQUESTS = 16
SETTLE_S = 1.0  # the EPP follows a load/unload within 0.5 s (its list poll: every 10 s)


def _model_polls(engine: harness.Engine) -> float:
    """GET /v1/models answered by the engine: only the EPP's scraper asks it here."""
    text = harness.http_get(f"http://{engine.address}/metrics")[1]
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("http_requests_total{")
        and 'handler="/v1/models"' in line
        and 'method="GET"' in line
    )


def _running_adapters(engine: harness.Engine) -> set[str]:
    """running_lora_adapters of the engine's vllm:lora_requests_info."""
    text = harness.http_get(f"http://{engine.address}/metrics")[1]
    line = next(x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{"))
    found = re.search(r'running_lora_adapters="([^"]*)"', line)
    return {a for a in (found.group(1) if found else "").split(",") if a}


def _adapter_requests(url: str, tag: str) -> list[tuple[int, str | None]]:
    """REQUESTS completions for the adapter through the gateway: (status, engine) each."""
    with httpx.Client(base_url=url, timeout=20) as client:
        answers = []
        for i in range(REQUESTS):
            r = client.post(
                "/v1/completions",
                # different prompts: no prefix pulls them all to one engine by itself
                json={"model": ADAPTER, "prompt": f"{tag} {i}: " + "why " * (i + 1), "max_tokens": 2},
            )
            answers.append((r.status_code, r.headers.get(UPSTREAM)))
    return answers


def test_an_adapter_on_one_engine_is_only_routed_there(tmp_path) -> None:
    with harness.gateway_stack(tmp_path, engines=2, engine_args=("--enable-lora",)) as (engines, _, envoy):
        holder, other = engines
        polls = _model_polls(holder)
        # simulated engines: any existing folder is an adapter
        resp = httpx.post(
            f"http://{holder.address}/v1/load_lora_adapter",
            json={"lora_name": ADAPTER, "lora_path": str(tmp_path)},
            timeout=10,
        )
        assert resp.status_code == 200, resp.text
        # the load shows on the holder's /metrics; the EPP asks its model list again at once
        eventually(lambda: _model_polls(holder) > polls, SETTLE_S, "the EPP asks the holder's models again")
        time.sleep(0.3)
        answers = _adapter_requests(envoy.url, "question")
        assert [s for s, _ in answers] == [200] * REQUESTS, answers
        assert {u for _, u in answers} == {holder.address}
        # the adapter moves (unloaded from the holder, loaded on the other engine) while a long
        # request still runs under it on the holder: its lora_requests_info keeps showing it
        # running there, yet the holder answers 404 to any new request for it
        long_body = {
            "model": ADAPTER,
            "prompt": "a long one",
            "max_tokens": 2000,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream(
            "POST", f"http://{holder.address}/v1/completions", json=long_body, timeout=30
        ) as long:
            assert long.status_code == 200
            lines = long.iter_lines()  # kept: dropping the iterator would close the stream
            next(lines)  # under way
            resp = httpx.post(f"http://{holder.address}/v1/unload_lora_adapter", json={"lora_name": ADAPTER})
            assert resp.status_code == 200, resp.text
            resp = httpx.post(
                f"http://{other.address}/v1/load_lora_adapter",
                json={"lora_name": ADAPTER, "lora_path": str(tmp_path)},
                timeout=10,
            )
            assert resp.status_code == 200, resp.text
            time.sleep(SETTLE_S)
            assert _running_adapters(holder) == {ADAPTER}  # the case this checks: still running there
            answers = _adapter_requests(envoy.url, "moved")
            assert _running_adapters(holder) == {ADAPTER}
        assert [s for s, _ in answers] == [200] * REQUESTS, answers  # not one 404 from the old holder
        assert {u for _, u in answers} == {other.address}
        # the base model still spreads over both engines (every engine serves it)
        with httpx.Client(base_url=envoy.url, timeout=20) as client:
            cards = client.get("/v1/models").json()["data"]
            base = next(m["id"] for m in cards if m.get("parent") is None)
            seen = set()
            for i in range(REQUESTS):
                r = client.post(
                    "/v1/completions", json={"model": base, "prompt": f"base {i} " * (i + 1), "max_tokens": 2}
                )
                assert r.status_code == 200, r.text
                seen.add(r.headers.get(UPSTREAM))
        assert seen == {holder.address, other.address}
