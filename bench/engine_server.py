"""Engine server overhead: what the HTTP layer costs on top of the engine, measured in one run.

    .venv/bin/python -P bench/engine_server.py            # everything
    .venv/bin/python -P bench/engine_server.py requests   # non-streaming req/s and latency
    .venv/bin/python -P bench/engine_server.py stream     # streamed tokens/s
    .venv/bin/python -P bench/engine_server.py stack      # httptools+uvloop vs h11+asyncio
    .venv/bin/python -P bench/engine_server.py metrics    # /metrics render cost vs prometheus_client
    .venv/bin/python -P bench/engine_server.py startup    # 1 and 8 simulated engines

The engine runs simulated with time scale 0 (no sleeping), so every second measured is Python
overhead. Baseline: the same LLMEngine driven in-process (no HTTP, no threads) over the same
requests. A raw asyncio HTTP/1.1 client (keep-alive, no parsing library) keeps client cost low,
but it shares the 2 cores with the server: ratios, not absolute numbers, are the point.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

STARTED = re.compile(r"kvgate engine serving .* on http://(\S+?):(\d+)")
PROMPT = "Summarize the plot of a long novel about ships, sailors and the sea in a few words."


class Engine:
    def __init__(self, *args: str) -> None:
        cmd = [sys.executable, "-P", "-m", "kvgate", "engine", "serve", "--port", "0", *args]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self.host, self.port = "", 0
        ready = threading.Event()

        def pump() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                m = STARTED.search(line)
                if m and not ready.is_set():
                    self.host, self.port = m.group(1), int(m.group(2))
                    self.ready_after = time.monotonic() - self.started
                    self.cpu_at_ready = _cpu_seconds(self.proc.pid)
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(120) or not self.port:
            raise RuntimeError("engine did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _client(
    host: str, port: int, body: bytes, until: float, latencies: list[float], events: list[int]
) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    request = (
        f"POST /v1/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode() + body
    while time.monotonic() < until:
        started = time.perf_counter()
        writer.write(request)
        head = (await reader.readuntil(b"\r\n\r\n")).lower()
        assert head.startswith(b"http/1.1 200"), head[:200]
        if b"content-length:" in head:
            length = int(head.split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            n = 1
        else:  # chunked SSE
            n = 0
            while True:
                size = int((await reader.readline()).strip(), 16)
                if size == 0:
                    await reader.readline()
                    break
                n += (await reader.readexactly(size + 2)).count(b"data: {")
        latencies.append(time.perf_counter() - started)
        events.append(n)
    writer.close()


def _load(
    eng: Engine, body: dict[str, Any], concurrency: int, seconds: float
) -> tuple[list[float], list[int], float]:
    raw = json.dumps(body).encode()
    latencies: list[float] = []
    events: list[int] = []

    async def run() -> float:
        started = time.monotonic()
        until = started + seconds
        await asyncio.gather(
            *(_client(eng.host, eng.port, raw, until, latencies, events) for _ in range(concurrency))
        )
        return time.monotonic() - started

    wall = asyncio.run(run())
    return latencies, events, wall


def _engine_baseline(n_requests: int, concurrency: int, max_tokens: int) -> float:
    """Requests/s of the bare LLMEngine (same sim config, same prompt, same concurrency)."""
    from kvgate.engine.config import EngineConfig, SimulationConfig
    from kvgate.engine.llm_engine import LLMEngine
    from kvgate.engine.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(simulate=True, simulation=SimulationConfig(time_scale=0), max_num_seqs=256)
    )
    prompt = engine.tokenizer.encode(PROMPT)
    engine.add_request("warm", prompt, SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
    started = time.perf_counter()
    done = submitted = 0
    while done < n_requests:
        while submitted - done < concurrency and submitted < n_requests:
            engine.add_request(
                f"r{submitted}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True)
            )
            submitted += 1
        done += sum(1 for o in engine.step() if o.finished)
    return n_requests / (time.perf_counter() - started)


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) >= 2 else values[0]


def bench_requests(seconds: float) -> dict[str, Any]:
    eng = Engine("--simulate", "--sim-time-scale", "0", "--max-num-seqs", "256")
    out: dict[str, Any] = {}
    try:
        _load(eng, {"prompt": PROMPT, "max_tokens": 2}, 4, 1.0)  # warm-up (lazy tables, connections)
        for concurrency in (1, 16):
            for max_tokens in (1, 16):
                body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
                lat, _, wall = _load(eng, body, concurrency, seconds)
                rps = len(lat) / wall
                base = _engine_baseline(max(200, len(lat)), concurrency, max_tokens)
                key = f"c{concurrency}_t{max_tokens}"
                out[key] = {
                    "server_rps": round(rps, 1),
                    "engine_only_rps": round(base, 1),
                    "server_vs_engine": round(rps / base, 3),
                    "p50_ms": round(_pct(lat, 50) * 1000, 2),
                    "p99_ms": round(_pct(lat, 99) * 1000, 2),
                    "server_overhead_us_per_request": round((1 / rps - 1 / base) * 1e6, 1),
                }
                print(key, out[key], flush=True)
    finally:
        eng.stop()
    return out


def bench_stack(seconds: float) -> dict[str, Any]:
    """httptools + uvloop (the default when installed) against h11 + asyncio, same load."""
    out: dict[str, Any] = {}
    body = {"prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
    for name, args in (
        ("h11+asyncio", ("--http-parser", "h11", "--event-loop", "asyncio")),
        ("httptools+uvloop", ("--http-parser", "httptools", "--event-loop", "uvloop")),
    ):
        eng = Engine("--simulate", "--sim-time-scale", "0", "--max-num-seqs", "256", *args)
        try:
            _load(eng, body, 4, 1.0)
            for concurrency in (1, 16):
                cpu0 = _cpu_seconds(eng.proc.pid)
                lat, _, wall = _load(eng, body, concurrency, seconds)
                cpu = _cpu_seconds(eng.proc.pid) - cpu0
                out[f"{name}_c{concurrency}"] = {
                    "rps": round(len(lat) / wall, 1),
                    "p50_ms": round(_pct(lat, 50) * 1000, 2),
                    "p99_ms": round(_pct(lat, 99) * 1000, 2),
                    "server_cpu_us_per_request": round(cpu / len(lat) * 1e6),
                }
                print(f"{name} c{concurrency}", out[f"{name}_c{concurrency}"], flush=True)
        finally:
            eng.stop()
    for c in (1, 16):
        base, new = out[f"h11+asyncio_c{c}"], out[f"httptools+uvloop_c{c}"]
        out[f"cpu_per_request_ratio_c{c}"] = round(
            new["server_cpu_us_per_request"] / base["server_cpu_us_per_request"], 3
        )
    return out


def bench_stream(seconds: float) -> dict[str, Any]:
    eng = Engine("--simulate", "--sim-time-scale", "0", "--max-num-seqs", "256")
    out: dict[str, Any] = {}
    try:
        _load(eng, {"prompt": PROMPT, "max_tokens": 2, "stream": True}, 4, 1.0)
        for concurrency in (1, 32):
            body = {"prompt": PROMPT, "max_tokens": 64, "ignore_eos": True, "stream": True}
            lat, events, wall = _load(eng, body, concurrency, seconds)
            tps = sum(events) / wall
            base = _engine_baseline(max(100, len(lat)), concurrency, 64) * 64
            out[f"c{concurrency}"] = {
                "server_tokens_per_s": round(tps),
                "engine_only_tokens_per_s": round(base),
                "server_vs_engine": round(tps / base, 3),
                "server_overhead_us_per_token": round((1 / tps - 1 / base) * 1e6, 1),
            }
            print(f"stream c{concurrency}", out[f"c{concurrency}"], flush=True)
    finally:
        eng.stop()
    return out


def bench_metrics() -> dict[str, Any]:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from kvgate.engine.server.metrics import (
        E2E_BUCKETS,
        ITL_BUCKETS,
        TTFT_BUCKETS,
        CacheConfigInfo,
        EngineMetrics,
    )

    ours = EngineMetrics("default", CacheConfigInfo(16, 2048, True))
    reg = CollectorRegistry()
    labels = {"model_name": "default", "engine": "0"}
    for name in ("running", "waiting", "kv", "gpu"):
        Gauge(f"vllm:{name}", "d", list(labels), registry=reg).labels(**labels).set(1)
    for name in ("prompt", "gen", "q", "h", "p"):
        Counter(f"vllm:{name}", "d", list(labels), registry=reg).labels(**labels).inc()
    success = Counter("vllm:request_success", "d", [*labels, "finished_reason"], registry=reg)
    for r in ("stop", "length", "abort"):
        success.labels(**labels, finished_reason=r).inc()
    for name, buckets in (("ttft", TTFT_BUCKETS), ("itl", ITL_BUCKETS), ("e2e", E2E_BUCKETS)):
        Histogram(f"vllm:{name}", "d", list(labels), buckets=buckets, registry=reg).labels(**labels).observe(
            0.1
        )
    Gauge("vllm:cache_config_info", "d", list(CacheConfigInfo(16, 2048, True).labels()), registry=reg).labels(
        **CacheConfigInfo(16, 2048, True).labels()
    ).set(1)
    n = 500
    started = time.perf_counter()
    for _ in range(n):
        generate_latest(reg)
    baseline = (time.perf_counter() - started) / n
    started = time.perf_counter()
    for _ in range(n):
        with ours.lock:
            ours.touch()  # defeat the idle cache: measure a full render
        ours.render()
    full = (time.perf_counter() - started) / n
    started = time.perf_counter()
    for _ in range(n):
        ours.render()
    cached = (time.perf_counter() - started) / n
    out = {
        "prometheus_client_us": round(baseline * 1e6, 1),
        "ours_us": round(full * 1e6, 1),
        "ours_cached_us": round(cached * 1e6, 2),
        "speedup": round(baseline / full, 1),
    }
    print("metrics", out, flush=True)
    return out


def bench_startup() -> dict[str, Any]:
    one = Engine("--simulate")
    single = {"ready_s": round(one.ready_after, 2), "cpu_s": round(one.cpu_at_ready, 2)}
    one.stop()
    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        engines = list(pool.map(lambda _: Engine("--simulate"), range(8)))
    eight = time.monotonic() - started
    cpu = [e.cpu_at_ready for e in engines]
    for e in engines:
        e.stop()
    out = {
        "one": single,
        "eight_ready_s": round(eight, 2),
        "eight_cpu_s_mean": round(statistics.mean(cpu), 2),
    }
    print("startup", out, flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="*", default=["requests", "stream", "stack", "metrics", "startup"])
    p.add_argument("--seconds", type=float, default=4.0, help="load duration per measurement")
    p.add_argument("--out", default=None, help="write the JSON results here")
    args = p.parse_args()
    results: dict[str, Any] = {"load_avg_at_start": os.getloadavg()[0]}
    for what in args.what:
        if what == "requests":
            results["requests"] = bench_requests(args.seconds)
        elif what == "stream":
            results["stream"] = bench_stream(args.seconds)
        elif what == "stack":
            results["stack"] = bench_stack(args.seconds)
        elif what == "metrics":
            results["metrics"] = bench_metrics()
        elif what == "startup":
            results["startup"] = bench_startup()
        else:
            p.error(f"unknown benchmark {what!r}")
    print(json.dumps(results, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
