"""EPP speed: latency Envoy+EPP adds over the same Envoy's direct route, and picks per second.

    .venv/bin/python bench/epp_latency.py                # everything
    .venv/bin/python bench/epp_latency.py picks          # in-process pick() with 16 endpoints
    .venv/bin/python bench/epp_latency.py long-picks     # the same on llm-d-shaped 7,200-token prompts
    .venv/bin/python bench/epp_latency.py grpc           # ext_proc streams/s through the gRPC server
    .venv/bin/python bench/epp_latency.py latency        # through Envoy at 50 and 200 req/s in total
    .venv/bin/python bench/epp_latency.py latency --rates 200,800  # 50 and 200 req/s through each EPP

Targets: added latency p50 ≤ 1.5 ms and p99 ≤ 5 ms; ≥ 1,000 picks/s on one core, 16 endpoints;
a pick (the scheduler alone) ≤ 0.25 ms on long prompts at 16 endpoints.
The latency run sends each request pair (one direct, one through the EPP, random order) to the
same simulated engine at the same moment, so both routes see the same machine load. The
no-scoring EPP runs twice, on grpclib (the default ext_proc server) and on grpcio's asyncio server
(--grpc-server grpcio), each behind its own Envoy: the servers compared in one run. A rate is the
total offered, split evenly over the four routes.

Each non-200 answer is counted by cause (the status and Envoy's response code details, or the
EPP's own error), with the Envoy counters of the EPP cluster and ext_proc filter that moved:
`--rates 800,1200` is the overload run (the machine saturated; the direct route must lose
nothing, and no EPP route may either: overload makes picks slower, never failed).

Quiet 2-core host (nothing else running), `--rates 200,800 --seconds 20`: the precise-prefix EPP
added p50 +1.37 / +1.11 ms and p99 +1.40 / +2.98 ms at 50 / 200 req/s through it (+1.08 / +4.35
ms at 200 in a second run); grpcio's server (no scoring) +1.68 / +1.32 ms p50.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvgate.testing.processes import Envoy

N_ENDPOINTS = 16
SYSTEM_PROMPTS = [
    f"You are a helpful assistant for team {i}. "
    + " ".join(f"Guideline {k}: answer carefully." for k in range(25))
    for i in range(8)
]


def chat_body(i: int) -> dict:
    return {
        "model": "default",
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPTS[i % len(SYSTEM_PROMPTS)]},
            {"role": "user", "content": f"Question number {i}: what is {i} times {i + 1}?"},
        ],
        "max_tokens": 1,
    }


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


# -- in-process picks ----------------------------------------------------------------------------
def busy_datastore(rng: random.Random, extra: Callable[[random.Random], dict] | None = None):
    """N_ENDPOINTS endpoints with random queues and KV use (plus `extra` metrics), scraped
    fresh for the next hour, publishing KV events."""
    from kvgate.epp.datastore import Datastore, Endpoint, EndpointMetrics

    ds = Datastore()
    ds.set_endpoints([Endpoint(f"10.0.0.{i}:8000") for i in range(N_ENDPOINTS)])
    now = time.monotonic()
    for st in ds.all():
        metrics = {"waiting": rng.randint(0, 4), "running": rng.randint(0, 16), "kv_usage": rng.random()}
        ds.update_metrics(
            st.address, EndpointMetrics(**metrics, **(extra(rng) if extra else {}), updated_at=now + 3600)
        )
        st.kv_events_live = True
    return ds


def build_director(profile: str):
    from kvgate.api.contracts.kv_events import BlockStored
    from kvgate.epp.director import Director
    from kvgate.epp.request import InferenceRequest
    from kvgate.epp.scheduling.config import build_profiles, load_config, saturation_detector
    from kvgate.epp.tokenization import load as load_tokenizer

    tok = load_tokenizer("default")
    ds = busy_datastore(random.Random(0))
    # every system prompt cached on two endpoints, as KV events would report it
    for i, _ in enumerate(SYSTEM_PROMPTS):
        req = InferenceRequest("x", "default", "default", chat_body(i), tokenizer=tok)
        ids = req.token_ids
        n = len(ids) // 16
        for ep in (i % N_ENDPOINTS, (i + 5) % N_ENDPOINTS):
            ds.index.apply(
                f"10.0.0.{ep}:8000",
                [BlockStored(list(range(i * 1000, i * 1000 + n)), None, ids[: n * 16], 16)],
            )
    cfg = load_config(None, profile)
    return Director(ds, build_profiles(cfg)[0], saturation_detector(cfg)), tok


def bench_picks(seconds: float = 3.0) -> dict:
    from kvgate.epp.request import InferenceRequest, parse_body

    out = {}
    for profile in ("precise-prefix", "default", "round-robin"):
        director, tok = build_director(profile)
        bodies = [json.dumps(chat_body(i)).encode() for i in range(512)]
        n = 0
        # CPU time of this process: what one core delivers, even on a machine shared with others
        c0, w0 = time.process_time(), time.perf_counter()
        while time.process_time() - c0 < seconds:
            body = parse_body(bodies[n % len(bodies)])
            d = director.pick(InferenceRequest(str(n), "default", "default", body, tokenizer=tok))
            director.finished(d.targets[0])
            n += 1
        rate = n / (time.process_time() - c0)
        wall = n / (time.perf_counter() - w0)
        out[profile] = round(rate)
        print(
            f"in-process pick(), {N_ENDPOINTS} endpoints, profile {profile:15s}: {rate:8.0f} picks/s per core "
            f"({1e6 / rate:.0f} µs CPU each, incl. JSON parse + chat template + tokenize; wall {wall:.0f}/s)"
        )
    return out


# -- through the gRPC server ---------------------------------------------------------------------
def build_long_prompt_director(profile: str, rng: random.Random):
    """16 endpoints shaped like the llm-d-shared-prefix preset: 64 system prompts of 6,000
    tokens, four held by each engine (its KV events), engines of 1,800 KV blocks, some queued
    prefill. Returns the director and the prefixes."""
    from kvgate.api.contracts.kv_events import BlockStored
    from kvgate.epp.director import Director
    from kvgate.epp.scheduling.config import build_profiles, load_config, saturation_detector

    ds = busy_datastore(
        rng,
        lambda r: {
            "kv_blocks_total": 1800,
            "prefill_tokens_pending": r.randint(0, 8000),
            "prompt_tokens_total": 1e6,
            "prefix_hits_total": 5e5,
        },
    )
    prefixes = [[rng.randrange(50_000) for _ in range(6000)] for _ in range(64)]
    first_hash = 1
    for group, prefix in enumerate(prefixes):
        n = len(prefix) // 16
        ds.index.apply(
            f"10.0.0.{group % N_ENDPOINTS}:8000",
            [BlockStored(list(range(first_hash, first_hash + n)), None, prefix[: n * 16], 16)],
        )
        first_hash += n
    cfg = load_config(None, profile)
    return Director(ds, build_profiles(cfg)[0], saturation_detector(cfg)), prefixes


def bench_long_prompt_picks(picks: int = 2000) -> dict:
    """pick() alone (the scheduler: filters, scorers, picker, bookkeeping; the prompt arrives
    tokenized) on 7,200-token prompts: issue 18's cost target, 0.25 ms at 16 endpoints."""
    from kvgate.epp.request import InferenceRequest

    out = {}
    for profile in ("precise-prefix", "default", "round-robin"):
        rng = random.Random(0)
        director, prefixes = build_long_prompt_director(profile, rng)
        prompts = [rng.choice(prefixes) + [rng.randrange(50_000) for _ in range(1200)] for _ in range(256)]
        # the text GIE's approximate scorer hashes: ~5 characters a token, as English runs
        texts = [" ".join(f"{t:04d}"[-4:] for t in tokens) for tokens in prompts]
        seconds = []
        for n in range(picks):
            tokens, text = prompts[n % len(prompts)], texts[n % len(prompts)]
            body = {"model": "default", "prompt": text}
            request = InferenceRequest(
                str(n), "default", "default", body, _token_ids=tokens, _prompt_text=text
            )
            decision = director.pick(request)
            director.finished(decision.targets[0])
            seconds.append(decision.scheduler_seconds)
        seconds = seconds[picks // 4 :]  # warmed: working sets and recent picks filled
        p50, p99 = 1000 * pct(seconds, 0.5), 1000 * pct(seconds, 0.99)
        out[profile] = {"pick_ms_p50": round(p50, 3), "pick_ms_p99": round(p99, 3)}
        print(
            f"in-process pick(), {N_ENDPOINTS} endpoints, 7,200-token prompts, profile {profile:15s}: "
            f"p50 {p50:.3f} ms, p99 {p99:.3f} ms"
        )
    return out


async def _grpc_client(port: int, seconds: float, concurrency: int) -> tuple[int, list[float]]:
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    done = 0
    lat: list[float] = []
    deadline = time.perf_counter() + seconds

    async def worker(w: int) -> None:
        nonlocal done
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = ep_grpc.ExternalProcessorStub(ch)
            i = w
            while time.perf_counter() < deadline:
                body = json.dumps(chat_body(i)).encode()
                hdrs = base_pb2.HeaderMap(
                    headers=[
                        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
                        base_pb2.HeaderValue(key="x-request-id", raw_value=str(i).encode()),
                    ]
                )
                status = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])
                t0 = time.perf_counter()
                call = stub.Process()
                await call.write(ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hdrs)))
                await call.write(
                    ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))
                )
                await call.read()  # header response
                await call.read()  # body
                lat.append(time.perf_counter() - t0)
                await call.write(ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=status)))
                await call.read()
                await call.write(
                    ep.ProcessingRequest(response_body=ep.HttpBody(body=b"{}", end_of_stream=True))
                )
                await call.read()
                await call.done_writing()
                done += 1
                i += concurrency

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return done, lat


def _client_proc(port: int, seconds: float, concurrency: int, q) -> None:
    q.put(asyncio.run(_grpc_client(port, seconds, concurrency)))


def bench_grpc(
    seconds: float = 5.0,
    clients: int = 2,
    concurrency: int = 8,
    profile_dir: Path | None = None,
    extra_epp_args: tuple[str, ...] = (),
    replicas: int = 1,
) -> dict:
    """Load from separate client processes; the EPPs' own CPU time gives picks per core.
    ``replicas``: that many EPP processes over the same 16 endpoints, the client processes split
    evenly between them (as Envoy spreads streams over the EPP cluster's hosts)."""
    import multiprocessing as mp
    import subprocess

    from kvgate.testing import processes as harness
    from kvgate.testing.polling import eventually

    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "kvgate-bench-epp"
    logs.mkdir(parents=True, exist_ok=True)
    clients = max(clients, replicas)
    ports = harness.free_ports(N_ENDPOINTS + 3 * replicas)
    epp_ports = [tuple(ports[N_ENDPOINTS + 3 * r : N_ENDPOINTS + 3 * r + 3]) for r in range(replicas)]
    ports = ports[:N_ENDPOINTS]
    stub = harness.Process(
        "metrics-stub", [sys.executable, __file__, "_metrics_stub", *map(str, ports)], logs / "stub.log"
    ).start()
    fake = [f"127.0.0.1:{p}" for p in ports]
    procs = []
    for r, (grpc_port, health, metrics) in enumerate(epp_ports):
        argv = [
            *harness.KVGATE,
            "epp",
            "serve",
            "--endpoints",
            ",".join(fake),
            "--grpc-port",
            str(grpc_port),
            "--grpc-health-port",
            str(health),
            "--metrics-port",
            str(metrics),
            "--secure-serving=false",
            *extra_epp_args,
        ]
        procs.append(harness.Process(f"epp-{r}", argv, logs / f"epp-grpc-{r}.log").start())
    try:
        for proc, (grpc_port, health, metrics) in zip(procs, epp_ports, strict=True):
            epp = harness.Epp(proc, grpc_port, health, metrics, False).wait_ready()
            eventually(
                lambda epp=epp: 'inference_pool_ready_pods{name="local"} 16.0' in epp.metrics_text(),
                20,
                "16 endpoints scraped",
            )
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        spy = None
        if profile_dir is not None:
            spy = subprocess.Popen(
                [
                    str(Path(sys.executable).parent / "py-spy"),
                    "record",
                    "-p",
                    str(procs[0].pid),
                    "-o",
                    str(profile_dir / "epp-grpc.folded"),
                    "--format",
                    "raw",
                    "-d",
                    str(int(seconds)),
                    "-r",
                    "200",
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
        ps = [
            ctx.Process(target=_client_proc, args=(epp_ports[i % replicas][0], seconds, concurrency, q))
            for i in range(clients)
        ]
        cpu0 = sum(_cpu_seconds(proc.pid) for proc in procs)
        for p in ps:
            p.start()
        results = [q.get() for _ in ps]
        cpu = sum(_cpu_seconds(proc.pid) for proc in procs) - cpu0
        for p in ps:
            p.join()
        if spy is not None:
            spy.wait(30)
    finally:
        harness.stop_all(*procs)
        stub.stop()
    total = sum(n for n, _ in results)
    lat = [x for _, sample in results for x in sample]
    rate = total / seconds
    per_core = total / cpu if cpu > 0 else float("nan")
    print(
        f"through the gRPC server, {replicas} EPP replica(s) ({clients}x{concurrency} streams): "
        f"{rate:7.0f} picks/s wall, "
        f"{per_core:7.0f} picks per EPP CPU-second (all replicas; scraping 16 endpoints every 50 ms "
        f"included), request-phase p50 {pct(lat, 0.5) * 1e3:.2f} ms p99 {pct(lat, 0.99) * 1e3:.2f} ms"
    )
    return {
        "replicas": replicas,
        "picks_per_s": round(rate),
        "picks_per_cpu_s": round(per_core),
        "p50_ms": pct(lat, 0.5) * 1e3,
        "p99_ms": pct(lat, 0.99) * 1e3,
    }


def _cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process (robust to a machine shared with other work)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _metrics_stub(ports: list[int]) -> None:
    """Stands in for 16 engines' /metrics (the pick benchmark needs them reachable, not busy)."""
    rng = random.Random(1)

    async def main() -> None:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    if not head:
                        return
                    text = (
                        f'vllm:num_requests_waiting{{model_name="default"}} {rng.randint(0, 3)}\n'
                        f'vllm:num_requests_running{{model_name="default"}} {rng.randint(0, 16)}\n'
                        f'vllm:kv_cache_usage_perc{{model_name="default"}} {rng.random():.3f}\n'
                    ).encode()
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: %d\r\n\r\n%s"
                        % (len(text), text)
                    )
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()

        servers = [await asyncio.start_server(serve, "127.0.0.1", p) for p in ports]
        await asyncio.gather(*(srv.serve_forever() for srv in servers))

    asyncio.run(main())


_COMPLETION = json.dumps(
    {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "created": 0,
        "model": "default",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "4"}, "finish_reason": "length"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()


def _upstream_stub(port: int) -> None:
    """A zero-latency OpenAI-shaped upstream with vLLM metrics: isolates what Envoy and the EPP
    add (the simulated engine's own request handling costs milliseconds on a busy 2-core host)."""
    from kvgate.testing.upstream_stub import stub_handler, vllm_metrics

    serve = stub_handler(vllm_metrics("default"), _COMPLETION)

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", port)
        await server.serve_forever()

    asyncio.run(main())


# -- through Envoy ---------------------------------------------------------------------------------
async def _open_loop(
    routes: dict[str, tuple[str, str]], rate: float, seconds: float, body: bytes
) -> dict[str, list[float]]:
    """Offered load ``rate`` req/s in total, split evenly over ``routes`` (name → (Envoy URL,
    extra header line)): each tick sends the same request down every route at the same
    instant, in random order, so all routes see the same machine load. A lean keep-alive client
    (httpx alone cost ~2 ms of CPU per request on this host)."""
    from kvgate.epp.http_get import KeepAliveGetter, ScrapeError

    lat: dict[str, list[float]] = {name: [] for name in routes}
    errors: dict[str, int] = dict.fromkeys(routes, 0)
    causes: dict[str, dict[str, int]] = {name: {} for name in routes}

    def failed(route: str, cause: str) -> None:
        errors[route] += 1
        causes[route][cause] = causes[route].get(cause, 0) + 1

    idle: dict[str, list[KeepAliveGetter]] = {name: [] for name in routes}
    raw: dict[str, bytes] = {}
    where: dict[str, tuple[str, int]] = {}
    for name, (url, header) in routes.items():
        host, port = url.removeprefix("http://").rsplit(":", 1)
        where[name] = (host, int(port))
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n{header}\r\n"
        )
        raw[name] = head.encode() + body

    async def one(route: str) -> None:
        pool = idle[route]
        conn = pool.pop() if pool else KeepAliveGetter(*where[route], timeout=30)
        t0 = time.perf_counter()
        try:
            status, body = await conn.request(raw[route])
        except ScrapeError as exc:
            failed(route, f"client: {str(exc).split(': ', 1)[-1][:60]}")
            return
        elapsed = time.perf_counter() - t0
        pool.append(conn)
        if status != 200:
            failed(route, f"{status} {_error_code(body)}")
            return
        lat[route].append(elapsed)

    tasks = []
    names = list(routes)
    period = len(names) / rate
    start = time.perf_counter()
    for i in range(int(seconds / period)):
        delay = start + i * period - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        random.shuffle(names)
        tasks += [asyncio.create_task(one(r)) for r in names]
    await asyncio.gather(*tasks)
    for pool in idle.values():
        for conn in pool:
            conn.close()
    lat["errors"] = [float(errors[name]) for name in routes]
    lat["causes"] = causes  # type: ignore[assignment]
    return lat


def _error_code(body: bytes) -> str:
    """Who answered an error: the gateway's local replies carry Envoy's response code details
    in error.code (e.g. ext_proc_error_gRPC_error_14, upstream_reset_before_response_started),
    the EPP's its own reason in error.message."""
    try:
        error = json.loads(body).get("error") or {}
    except (ValueError, AttributeError):
        return f"body {body[:40]!r}"
    return str(error.get("code") or error.get("message") or "")[:80]


# Envoy counters that say where an EPP route's errors came from (ext_proc stream failures and
# timeouts, the EPP cluster's resets, overflows and refused streams).
_ENVOY_STATS = (
    "ext_proc.",
    "cluster.epp.upstream_rq_",
    "cluster.epp.upstream_cx_",
    "cluster.epp.http2.",
    "cluster.epp.upstream_flow_control",
    "cluster.epp.circuit_breakers",
    "cluster.epp.health_check.",
    "cluster.epp.outlier_detection.",
    "http.ingress.downstream_rq_5xx",
)


def _envoy_counters(envoy: Envoy) -> dict[str, int]:
    return {name: value for name, value in envoy.stats().items() if any(key in name for key in _ENVOY_STATS)}


def _counter_delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The counters that moved (gauges that ended non-zero included), noise left out."""
    moved = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    quiet = ("_bytes", "_total", "upstream_rq_time", "_success", "_2xx", "_200", "_completed", "msgs_")
    return {k: v for k, v in sorted(moved.items()) if not any(q in k for q in quiet)}


def bench_latency(
    rates: tuple[float, ...] = (50, 200),
    seconds: float = 10.0,
    profile_dir: Path | None = None,
    upstream: str = "stub",
) -> dict:
    import subprocess

    from kvgate.testing import processes as harness

    logs = Path(os.environ.get("TMPDIR", "/tmp")) / "kvgate-bench-epp"
    logs.mkdir(parents=True, exist_ok=True)
    if upstream == "sim":
        engine = harness.start_engine(
            logs, "--sim-itl", "0", "--sim-prefill-time-per-token", "0", "--sim-itl-per-seq", "0"
        )
    else:
        port = harness.free_port()
        stub = harness.Process(
            "upstream-stub", [sys.executable, __file__, "_upstream_stub", str(port)], logs / "up.log"
        )
        engine = harness.Engine(stub.start(), port, "", "")
    procs = [engine.proc]
    results = {}
    try:
        engine.wait_ready()
        epp = harness.start_epp(logs, [engine], kv_events=upstream == "sim")
        # the protocol floor, measured in the same run: an EPP that scores nothing, on the
        # default ext_proc server (grpclib) and on grpcio's (--grpc-server grpcio)
        floor = harness.start_epp(logs, [engine], "--profile", "round-robin", kv_events=False)
        floor_grpcio = harness.start_epp(
            logs, [engine], "--profile", "round-robin", "--grpc-server", "grpcio", kv_events=False
        )
        procs += [epp.proc, floor.proc, floor_grpcio.proc]
        envoy = harness.start_envoy(logs, epp.grpc_port, epp.health_port, direct_upstream=engine.address)
        floor_envoy = harness.start_envoy(logs, floor.grpc_port, floor.health_port)
        grpcio_envoy = harness.start_envoy(logs, floor_grpcio.grpc_port, floor_grpcio.health_port)
        procs += [envoy.proc, floor_envoy.proc, grpcio_envoy.proc]
        for e in (epp, floor, floor_grpcio):
            e.wait_ready()
        for v in (envoy, floor_envoy, grpcio_envoy):
            v.wait_ready()
            v.wait_epp_healthy()
        routes = {
            "direct": (envoy.url, "x-kvgate-route: direct\r\n"),
            "epp": (envoy.url, ""),
            "floor": (floor_envoy.url, ""),
            "floor_grpcio": (grpcio_envoy.url, ""),
        }
        body = json.dumps(chat_body(0)).encode()
        asyncio.run(_open_loop(routes, 50, 2, body))  # warm-up: connections, caches
        for rate in rates:
            spy = None
            if profile_dir is not None:
                spy = subprocess.Popen(
                    [
                        str(Path(sys.executable).parent / "py-spy"),
                        "record",
                        "-p",
                        str(epp.proc.pid),
                        "-o",
                        str(profile_dir / f"epp-envoy-{int(rate)}rps.svg"),
                        "-d",
                        str(int(seconds)),
                        "-r",
                        "200",
                        "--nonblocking",
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.STDOUT,
                )
            envoys = {"epp": envoy, "floor": floor_envoy, "floor_grpcio": grpcio_envoy}
            before = {name: _envoy_counters(v) for name, v in envoys.items()}
            lat = asyncio.run(_open_loop(routes, rate, seconds, body))
            if spy is not None:
                spy.wait(30)
            row: dict = {
                "errors": dict(zip(routes, lat["errors"], strict=True)),
                "error_causes": lat["causes"],
                "envoy_counters": {
                    name: _counter_delta(before[name], _envoy_counters(v)) for name, v in envoys.items()
                },
            }
            for name in routes:
                row[f"{name}_p50_ms"] = pct(lat[name], 0.5) * 1e3
                row[f"{name}_p99_ms"] = pct(lat[name], 0.99) * 1e3
            for name in ("epp", "floor", "floor_grpcio"):
                row[f"{name}_added_p50_ms"] = row[f"{name}_p50_ms"] - row["direct_p50_ms"]
                row[f"{name}_added_p99_ms"] = row[f"{name}_p99_ms"] - row["direct_p99_ms"]
            results[rate] = row
            print(
                f"{rate:5.0f} req/s total: direct p50 {row['direct_p50_ms']:.2f} p99 {row['direct_p99_ms']:.2f} ms | "
                f"EPP (precise-prefix) added p50 {row['epp_added_p50_ms']:+.2f} p99 {row['epp_added_p99_ms']:+.2f} ms "
                f"(targets ≤ 1.5 / ≤ 5) | no-scoring EPP (protocol floor) added p50 {row['floor_added_p50_ms']:+.2f} "
                f"p99 {row['floor_added_p99_ms']:+.2f} ms | the same on grpcio's server added p50 "
                f"{row['floor_grpcio_added_p50_ms']:+.2f} p99 {row['floor_grpcio_added_p99_ms']:+.2f} ms | "
                f"errors {row['errors']}"
            )
            for name, causes in row["error_causes"].items():
                if causes:
                    print(f"      {name} errors by cause: {causes}")
                    print(f"      {name} Envoy counters that moved: {row['envoy_counters'].get(name, {})}")
    finally:
        harness.stop_all(*procs)
    return results


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_metrics_stub":
        _metrics_stub([int(p) for p in sys.argv[2:]])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "_upstream_stub":
        _upstream_stub(int(sys.argv[2]))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="*", help="parts to run: picks, long-picks, grpc, latency (default: all)")
    p.add_argument("--seconds", type=float, default=10.0, help="duration of each latency phase")
    p.add_argument(
        "--rates",
        default="50,200",
        help="latency part: offered req/s, each split evenly over the four routes (direct, the "
        "scoring EPP, the no-scoring EPP on grpclib and on grpcio): 800 puts 200 req/s through each EPP",
    )
    p.add_argument(
        "--upstream",
        choices=["stub", "sim"],
        default="stub",
        help="latency upstream: a zero-latency stub, or `kvgate engine serve --simulate` (itl 0)",
    )
    p.add_argument("--profile", type=Path, default=None, help="write py-spy flame graphs of the EPP here")
    p.add_argument("--json", type=Path, default=None, help="also write the figures as JSON")
    p.add_argument(
        "--epp-replicas",
        default="1",
        help="grpc part: EPP replica counts to measure, comma-separated (e.g. 1,2: picks/s and picks "
        "per EPP CPU-second for each, in one run)",
    )
    args = p.parse_args()
    args.what = args.what or ["picks", "long-picks", "grpc", "latency"]
    unknown = set(args.what) - {"picks", "long-picks", "grpc", "latency"}
    if unknown:
        p.error(f"unknown part(s): {', '.join(sorted(unknown))}")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    out: dict = {}
    if "picks" in args.what:
        out["picks"] = bench_picks()
    if "long-picks" in args.what:
        out["long_picks"] = bench_long_prompt_picks()
    if "grpc" in args.what:
        counts = [int(n) for n in args.epp_replicas.split(",")]
        runs = [bench_grpc(profile_dir=args.profile, replicas=n) for n in counts]
        out["grpc"] = runs[0] if len(runs) == 1 else runs
    if "latency" in args.what:
        rates = tuple(float(r) for r in args.rates.split(",") if r.strip())
        out["latency"] = bench_latency(
            rates=rates, seconds=args.seconds, profile_dir=args.profile, upstream=args.upstream
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
