"""SIGTERM on an engine under a steady stream of requests through real Envoy and the real EPP:
the EPP stops routing to it within about one scrape interval and no request fails."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import pytest

from kvgate.testing import eventually
from kvgate.testing import processes as harness

pytestmark = pytest.mark.timeout(120)
UPSTREAM = "x-kvgate-upstream"
GRACE = 2.0


def test_sigterm_under_load_loses_no_request(tmp_path) -> None:
    with harness.gateway_stack(
        tmp_path, engines=2, engine_args=("--drain-grace-period", str(GRACE), "--shutdown-timeout", "10")
    ) as (engines, _epp, envoy):
        victim = engines[0]

        results: list[tuple[float, int, str, str]] = []  # (sent, status, upstream, body)
        stop = threading.Event()

        def client(n: int) -> None:
            with httpx.Client(timeout=10) as c:
                i = 0
                while not stop.is_set():
                    sent = time.monotonic()
                    # distinct prompts: no prefix affinity, so both engines get traffic
                    body = {"model": "default", "prompt": f"{n}-{i} " * 8, "max_tokens": 2}
                    try:
                        r = c.post(f"{envoy.url}/v1/completions", json=body)
                        results.append((sent, r.status_code, r.headers.get(UPSTREAM, ""), r.text[:200]))
                    except httpx.HTTPError as exc:
                        results.append((sent, 0, "", repr(exc)))
                    i += 1

        threads = [threading.Thread(target=client, args=(n,)) for n in range(4)]
        for t in threads:
            t.start()
        eventually(lambda: any(up == victim.address for _, _, up, _ in results), 10, "traffic on the victim")
        victim.proc.popen.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        # past the grace period, into the refusing phase and the engine's exit
        eventually(lambda: not victim.proc.alive(), 20, "victim exits")
        assert victim.proc.popen.returncode == 0
        eventually(lambda: time.monotonic() > signalled + GRACE + 0.5, 5, "after the grace period")
        stop.set()
        for t in threads:
            t.join(15)

        failed = [r for r in results if r[1] != 200]
        assert not failed, failed[:5]
        to_victim = [sent for sent, _, up, _ in results if up == victim.address and sent >= signalled]
        last = max(to_victim, default=signalled) - signalled
        after = [r for r in results if r[0] > signalled + 0.5]
        print(f"last request routed to the draining engine was sent {last * 1000:.0f} ms after SIGTERM")
        assert last < 0.5  # one 50 ms scrape plus a loaded machine's scheduling
        assert after and all(up == engines[1].address for _, _, up, _ in after)
