"""Do two active EPP replicas agree? The share of requests both would send to the same engine.

    .venv/bin/python bench/epp_agreement.py [--requests 800] [--probe-every 4] [--engines 4] [--concurrency 8]

Real processes on loopback: simulated engines publishing KV events, two EPP replicas each
subscribed to every engine. Traffic is split between the replicas as Envoy's round robin would
(request i is picked by replica i % 2, then sent to the engine it chose and run to the end), so
each replica sees only half of the picks, as in production. The *other* replica is asked too,
over the same gRPC protocol, and the two destinations are compared. Only
the owner's choice is followed, and the owner's response headers go to the engine as Envoy
sends them (x-kvgate-picked-by: the engine then announces the admission to the other replica,
as in production). A question leaves the asked replica a pick that is never sent (queued work it
believes in until the engine's next scrape, on top of the announced real one), which biases it
against that engine; so only every `--probe-every`th pair of requests (default 4; a pair is one
request owned by each replica) is asked of both, and agreement is the share of those.

The workload: groups of requests sharing a long system prompt (the precise-prefix index
decides), a unique question each, short outputs, KV pools small enough that prefixes are
evicted. Agreement is reported for all requests and after a warm-up (once KV events flowed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path


def body_for(i: int, groups: int, rng: random.Random) -> dict:
    g = rng.randrange(groups)
    system = f"You are assistant {g} of a large team. " + " ".join(
        f"Rule {k} for team {g}: be precise and brief." for k in range(60)
    )
    return {
        "model": "default",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Question {i}: what is {i} plus {g}?"},
        ],
        "max_tokens": 8,
        "stream": True,
    }


async def pick(stub, body: bytes, request_id: str) -> tuple[str, dict[str, str]]:
    """One ext_proc request phase; returns the destination the replica chose ('' if none) and
    the request headers it set (Envoy sends them on to the engine: x-kvgate-picked-by is what
    makes the engine announce the admission to the other replicas)."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    headers = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
            base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
            base_pb2.HeaderValue(key="x-request-id", raw_value=request_id.encode()),
        ]
    )
    call = stub.Process()
    await call.write(ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=headers)))
    await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)))
    first = await call.read()
    await call.done_writing()
    call.cancel()
    if not first.HasField("request_headers"):
        return "", {}
    headers = {
        h.header.key: (h.header.raw_value or h.header.value.encode()).decode()
        for h in first.request_headers.response.header_mutation.set_headers
    }
    return headers.pop("x-gateway-destination-endpoint", ""), headers


async def run(args: argparse.Namespace) -> dict:
    import grpc
    import httpx
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    from kvgate.testing import processes as harness

    logs = Path(tempfile.mkdtemp(prefix="kvgate-agreement-"))
    engines = [
        harness.start_engine(
            logs, "--sim-kv-blocks", str(args.kv_blocks), "--sim-time-scale", str(args.time_scale)
        )
        for _ in range(args.engines)
    ]
    procs = [e.proc for e in engines]
    try:
        for e in engines:
            e.wait_ready()
        epps = [harness.start_epp(logs, engines) for _ in range(2)]
        procs += [p.proc for p in epps]
        for p in epps:
            p.wait_ready()
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p.grpc_port}") for p in epps]
        stubs = [ep_grpc.ExternalProcessorStub(ch) for ch in channels]
        rng = random.Random(args.seed)
        bodies = [json.dumps(body_for(i, args.groups, rng)).encode() for i in range(args.requests)]
        same = [False] * args.requests
        served = [False] * args.requests
        next_i = 0

        async def client(http: httpx.AsyncClient) -> None:
            nonlocal next_i
            while next_i < args.requests:
                i = next_i
                next_i += 1
                owner = i % 2
                rid = f"agree-{i}"
                # pairs of requests (one owned by each replica), so both are asked alike
                if (i // 2) % args.probe_every == 0:
                    (chosen, headers), (other, _) = await asyncio.gather(
                        pick(stubs[owner], bodies[i], rid), pick(stubs[1 - owner], bodies[i], rid)
                    )
                    same[i] = bool(chosen) and chosen == other
                else:
                    chosen, headers = await pick(stubs[owner], bodies[i], rid)
                if not chosen:
                    continue
                async with http.stream(
                    "POST", f"http://{chosen}/v1/chat/completions", content=bodies[i], headers=headers
                ) as resp:
                    async for _ in resp.aiter_bytes():
                        pass
                    served[i] = resp.status_code == 200

        t0 = time.perf_counter()
        async with httpx.AsyncClient(timeout=60) as http:
            await asyncio.gather(*(client(http) for _ in range(args.concurrency)))
        wall = time.perf_counter() - t0
        for ch in channels:
            await ch.close()
    finally:
        harness.stop_all(*procs)
    warm = args.warmup
    probed = [i for i in range(args.requests) if (i // 2) % args.probe_every == 0]
    after = [i for i in probed if i >= warm]
    result = {
        "requests": args.requests,
        "probed": len(probed),
        "served": sum(served),
        "agreement_all": sum(same[i] for i in probed) / len(probed),
        "agreement_after_warmup": sum(same[i] for i in after) / max(1, len(after)),
        "wall_s": round(wall, 1),
    }
    print(
        f"2 EPP replicas, {args.engines} engines, {args.requests} requests ({args.groups} prefixes, "
        f"{args.concurrency} concurrent, {sum(served)} served, every {args.probe_every}th pair asked of both): "
        f"same pick {result['agreement_all']:.1%} of those asked, {result['agreement_after_warmup']:.1%} "
        f"after the first {warm} requests"
    )
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=800)
    p.add_argument(
        "--probe-every",
        type=int,
        default=4,
        help="ask the other replica too for every Nth pair of requests only: each question leaves a pick "
        "there that is never sent (load it believes in until its next scrape), so asking it of "
        "every request biases the other replica against the engines it is asked about",
    )
    p.add_argument("--warmup", type=int, default=40, help="requests not counted in the warm figure")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--groups", type=int, default=12, help="distinct system prompts")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--kv-blocks", type=int, default=240, help="each simulated engine's KV pool")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--time-scale", type=float, default=1.0, help="simulated engines' speed (below 1: faster requests)"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON too")
    args = p.parse_args()
    result = asyncio.run(run(args))
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
