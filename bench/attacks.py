"""What hostile input costs the gateway: the figures e2e/test_attacks.py bounds, printed.

    .venv/bin/python -P bench/attacks.py

Real processes on loopback: two simulated engines, the EPP (precise-prefix: it tokenizes every
prompt), the default hardened Envoy. Prints, for the EPP and an engine, peak RSS (VmHWM) after
each attack against the baseline; bystander latency p50/p99 idle and while maximal prompts are
processed; the EPP's /metrics size after 3,000 random model names; how long the gateway and an
engine keep a slowloris connection open. Bounded: a few hundred requests, about a minute.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

MiB = 1024 * 1024
TEMPLATE = "{% set s = 'x' * 1000000000 %}{{ s|length }}"


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def chat(content: str, **extra: object) -> dict:
    return {"model": "default", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


def main() -> None:
    from kvgate.testing import processes as harness

    def mem_mib(pid: int) -> tuple[float, float]:
        rss, peak = harness.rss_kib(pid)
        return rss / 1024, peak / 1024

    def slowloris(port: int) -> float:
        return harness.slowloris_close_time(port, budget=60)

    logs = Path(tempfile.mkdtemp(prefix="kvgate-attacks-"))
    with harness.gateway_stack(logs, expose_upstream_header=False) as (engines, epp, envoy):
        url = f"{envoy.url}/v1/chat/completions"
        pids = {"EPP": epp.proc.pid, "engine": engines[0].proc.pid}
        for _ in range(20):  # warm: tokenizer caches, connections
            httpx.post(url, json=chat(f"warm {uuid.uuid4()}"), timeout=30)
        base = {k: mem_mib(p) for k, p in pids.items()}
        print("baseline RSS: " + ", ".join(f"{k} {v[0]:.0f} MiB" for k, v in base.items()))

        def attack(name: str, send) -> None:
            t0 = time.perf_counter()
            status = send()
            took = time.perf_counter() - t0
            peaks = ", ".join(f"{k} peak {mem_mib(p)[1]:.0f} MiB" for k, p in pids.items())
            print(f"{name}: HTTP {status} in {took * 1e3:.0f} ms; {peaks}")

        attack(
            "177-byte template (gateway)",
            lambda: httpx.post(url, json=chat("hi", chat_template=TEMPLATE), timeout=60).status_code,
        )
        attack(
            "177-byte template (engine direct)",
            lambda: (
                httpx.post(
                    f"http://{engines[0].address}/v1/chat/completions",
                    json=chat("hi", chat_template=TEMPLATE),
                    timeout=60,
                ).status_code
            ),
        )
        big = "lorem ipsum dolor sit amet " * (7 * MiB // 27)
        attack("7 MB prompt (gateway)", lambda: httpx.post(url, json=chat(big), timeout=60).status_code)
        attack(
            "10 MB prompt (engine direct)",
            lambda: (
                httpx.post(
                    f"http://{engines[0].address}/v1/completions",
                    json={"model": "default", "prompt": big + big[: 3 * MiB]},
                    timeout=60,
                ).status_code
            ),
        )
        attack(
            "100 MB body (gateway)",
            lambda: httpx.post(url, content=b"x" * (100 * MiB), timeout=60).status_code,
        )

        def bystanders(n: int) -> list[float]:
            out = []
            for i in range(n):
                t0 = time.perf_counter()
                httpx.post(url, json=chat(f"bystander {uuid.uuid4()} {i}"), timeout=30)
                out.append(time.perf_counter() - t0)
            return out

        idle = bystanders(100)
        words = [f"w{i} {uuid.uuid4().hex[:6]}" for i in range(16_000)]
        maximal = " ".join(words)  # under the cheap length bound: fully tokenized, then refused
        stop = threading.Event()

        def attacker() -> None:
            while not stop.is_set():
                httpx.post(url, json=chat(maximal + str(time.time())), timeout=60)

        t = threading.Thread(target=attacker, daemon=True)
        t.start()
        time.sleep(0.3)
        busy = bystanders(100)
        stop.set()
        t.join(60)
        print(
            f"bystanders idle p50 {statistics.median(idle) * 1e3:.1f} ms p99 {pct(idle, 0.99) * 1e3:.1f} ms; "
            f"during maximal prompts p50 {statistics.median(busy) * 1e3:.1f} ms p99 {pct(busy, 0.99) * 1e3:.1f} ms"
        )
        size0 = len(epp.metrics_text())
        with httpx.Client(timeout=10) as client:
            for i in range(3000):
                client.post(
                    f"{envoy.url}/v1/completions",
                    json={"model": f"m-{uuid.uuid4().hex}", "prompt": f"x{i}", "max_tokens": 1},
                )
        print(
            f"EPP /metrics: {size0 / 1024:.0f} KB before, {len(epp.metrics_text()) / 1024:.0f} KB after 3,000 random model names"
        )
        print(
            f"slowloris: gateway closed it after {slowloris(envoy.port):.1f} s, engine after {slowloris(engines[1].port):.1f} s"
        )


if __name__ == "__main__":
    # no options: --help only describes the run
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    main()
