"""FailClose with no endpoint picker answering: the client gets a 503 in the OpenAI error shape.

Envoy alone answers here (its ext_proc stream cannot even connect), so no engine is needed. Envoy's
own reply for a failed ext_proc stream is a bodiless 500; the gateway turns it into 503 JSON.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvgate.testing import processes as harness

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("health_check", [True, False], ids=["health-checked", "unchecked"])
def test_fail_close_without_epp_is_503_json(tmp_path: Path, health_check: bool) -> None:
    dead = harness.free_ports(2)  # nothing listens on either EPP "replica"
    envoy = harness.start_envoy(
        tmp_path,
        dead[0],
        failure_mode="FailClose",
        epp_addresses=[f"127.0.0.1:{p}" for p in dead],
        epp_health_check=health_check,
    )
    try:
        envoy.wait_ready()
        for i in range(3):  # both replicas, whichever the round robin picks
            resp = httpx.post(
                f"{envoy.url}/v1/completions",
                json={"model": "default", "prompt": f"hello {i}", "max_tokens": 2},
                timeout=10,
            )
            assert resp.status_code == 503, (resp.status_code, resp.text)
            assert resp.headers["content-type"].startswith("application/json"), resp.headers
            err = resp.json()["error"]
            assert set(err) >= {"message", "type", "param", "code"}, err
            assert err["message"] == "no endpoint picker answered"
            assert err["code"].startswith("ext_proc_error"), err
    finally:
        harness.stop_all(envoy.proc)
