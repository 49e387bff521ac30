"""`kvgate up --prefill-engines 1 --decode-engines 2 --simulate` (issue 15): long uncached prompts
are prefilled on the prefill engine and decoded on a decode engine, short ones served whole by a
decode engine; the prefill engine never receives a request from the gateway."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from kvgate.testing.local_up import UpProcess, engine_gauges, start_up, stop_up
from kvgate.testing.processes import run_kvgate

THRESHOLD = 256
LONG_REQUESTS = 4
SHORT_REQUESTS = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    up = start_up(
        tmp_path_factory.mktemp("pd"),
        "--simulate",
        "--prefill-engines",
        "1",
        "--decode-engines",
        "2",
        "--pd-threshold",
        str(THRESHOLD),
        "--epp-replicas",
        "1",
        "--expose-upstream-header",
    )
    try:
        up.wait_for_line(r"^curl ")
        yield up
    finally:
        stop_up(up)


def _epp_decisions(up: UpProcess) -> dict[str, float]:
    text = httpx.get(up.stack["epp_metrics_url"], timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("kvgate_epp_pd_decisions_total{"):
            decision = line.split('decision="', 1)[1].split('"', 1)[0]
            out[decision] = out.get(decision, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _complete(up: UpProcess, prompt: str) -> httpx.Response:
    body = {"model": up.stack["model"], "prompt": prompt, "max_tokens": 8, "temperature": 0}
    resp = httpx.post(up.stack["gateway_url"] + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp


def test_stack_json_lists_prefill_and_decode_engines_and_envoy_knows_only_decode(stack: UpProcess) -> None:
    info = stack.stack
    assert len(info["prefill_engine_urls"]) == 1 and len(info["decode_engine_urls"]) == 2
    assert sorted(info["engine_urls"]) == sorted(info["prefill_engine_urls"] + info["decode_engine_urls"])
    text = "\n".join(stack.lines)
    assert "engine-prefill-0 ready" in text and "engine-decode-1 ready" in text
    bootstrap = json.loads((stack.log_dir / "envoy.json").read_text())
    prefill_port = info["prefill_engine_urls"][0].rsplit(":", 1)[1]
    decode_ports = [u.rsplit(":", 1)[1] for u in info["decode_engine_urls"]]
    dumped = json.dumps(bootstrap)
    assert all(f'"port_value": {p}' in dumped for p in decode_ports)
    assert f'"port_value": {prefill_port}' not in dumped  # never a gateway destination


def test_long_prompts_are_disaggregated_short_ones_aggregated(stack: UpProcess) -> None:
    info = stack.stack
    before = _epp_decisions(stack)
    upstreams = []
    for i in range(LONG_REQUESTS):  # ~2,000 tokens each, nothing shared
        prompt = f"Request {i}. " + " ".join(f"w{i}x{j}" for j in range(600))
        upstreams.append(_complete(stack, prompt).headers["x-kvgate-upstream"])
    for i in range(SHORT_REQUESTS):
        upstreams.append(_complete(stack, f"Say hello number {i}.").headers["x-kvgate-upstream"])
    decode = {u.removeprefix("http://") for u in info["decode_engine_urls"]}
    assert set(upstreams) <= decode, upstreams  # the prefill engine never answers the gateway
    after = _epp_decisions(stack)
    assert after.get("disaggregated", 0) - before.get("disaggregated", 0) == LONG_REQUESTS
    assert after.get("aggregated", 0) - before.get("aggregated", 0) == SHORT_REQUESTS
    # the engines ran the hand-off: the decode engines pulled KV from the prefill engine
    prefill = engine_gauges(info["prefill_engine_urls"][0])
    consumers = [engine_gauges(u) for u in info["decode_engine_urls"]]
    assert prefill.get("kvgate:kv_transfer_requests_total", 0) == LONG_REQUESTS
    assert sum(c.get("kvgate:kv_transfer_requests_total", 0) for c in consumers) == LONG_REQUESTS
    assert sum(c.get("kvgate:kv_transfer_bytes_total", 0) for c in consumers) > 0
    assert sum(c.get("kvgate:kv_transfer_fallbacks_total", 0) for c in consumers) == 0


def test_pd_flags_are_checked(tmp_path) -> None:
    for args, message in (
        (["--prefill-engines", "1"], "needs both --prefill-engines and --decode-engines"),
        (["--prefill-engines", "1", "--decode-engines", "1", "--engines", "2"], "replace --engines"),
        (["--pd-threshold", "10"], "--pd-threshold needs"),
        (["--prefill-engines", "1", "--decode-engines", "1", "--pool", "a=default"], "with --pool"),
        (["--prefill-engines", "0", "--decode-engines", "1"], "--prefill-engines"),
        (["--prefill-engines", "1", "--decode-engines", "1", "--pd-threshold", "-3"], "--pd-threshold"),
    ):
        r = run_kvgate("up", "--simulate", "--log-dir", str(tmp_path / "logs"), *args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
