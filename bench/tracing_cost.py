"""Engine cost of tracing: one simulated engine (no simulated time, so every second is Python
overhead) with tracing off, then on (exporting to a real OTLP/HTTP collector on loopback),
alternating for several rounds in one run.

    .venv/bin/python -P bench/tracing_cost.py [--seconds 8] [--rounds 2]

Reports completion tokens/s (wall, shares the 2 cores with the client) and tokens per engine
CPU-second (the steadier figure). Every request carries a client traceparent, so with tracing
on each one makes a span. (The EPP's side is not measured here.)
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import tempfile
import time
from pathlib import Path

import httpx

from kvgate.testing.engine_server import launch
from kvgate.testing.otlp import otlp_collector
from kvgate.testing.processes import cpu_seconds

ENGINE = ("--simulate", "--sim-itl", "0", "--sim-itl-per-seq", "0", "--sim-prefill-time-per-token", "0",
          "--served-model-name", "sim", "--max-model-len", "1024")  # fmt: skip
TRACEPARENT = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
MAX_TOKENS = 64


async def load(url: str, seconds: float, concurrency: int = 8) -> tuple[float, int]:
    """Closed-loop chat requests for `seconds`: (completion tokens/s, requests)."""
    toks = n = 0
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        end = time.monotonic() + seconds

        async def worker(i: int) -> None:
            nonlocal toks, n
            while time.monotonic() < end:
                body = {"model": "sim", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                        "messages": [{"role": "user", "content": f"hello {i} {n}"}]}  # fmt: skip
                r = await client.post("/v1/chat/completions", json=body, headers={"traceparent": TRACEPARENT})
                toks += r.json()["usage"]["completion_tokens"]
                n += 1

        t0 = time.monotonic()
        await asyncio.gather(*[worker(i) for i in range(concurrency)])
        return toks / (time.monotonic() - t0), n


def measure(log_dir: Path, extra: list[str], seconds: float) -> tuple[float, int, float]:
    eng = launch(log_dir, *ENGINE, *extra)
    try:
        asyncio.run(load(eng.base_url, 2))  # warm-up
        cpu0 = cpu_seconds(eng.proc.pid)
        tps, n = asyncio.run(load(eng.base_url, seconds))
        return tps, n, cpu_seconds(eng.proc.pid) - cpu0
    finally:
        eng.stop(signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=8, help="load duration per measurement")
    ap.add_argument("--rounds", type=int, default=2, help="off/on pairs, alternating")
    args = ap.parse_args()
    with otlp_collector() as collector, tempfile.TemporaryDirectory() as d:
        for rnd in range(args.rounds):
            for name, extra in (("off", []), ("on", ["--otlp-endpoint", collector.url])):
                tps, n, cpu = measure(Path(d), extra, args.seconds)
                print(f"round {rnd} tracing {name}: {tps:.0f} tok/s, {n} requests, "
                      f"{n * MAX_TOKENS / cpu:.0f} tok per engine CPU-s", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
