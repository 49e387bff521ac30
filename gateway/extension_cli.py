"""`kvgate gateway extension-server`: InferencePool routing for Envoy Gateway (kvgate.gateway.eg_extension).

Envoy Gateway's `extensionManager` points at it (`backendResources`: InferencePool, post hooks
`Cluster` and `Translation`); it also keeps every InferencePool's `status.parents`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvgate.api.cli_args import add_log_level

HELP = "serve Envoy Gateway's extension hooks for InferencePool backends and write the pools' status"


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to serve the extension's gRPC on")
    p.add_argument("--port", type=int, default=5005, help="port to serve the extension's gRPC on")
    p.add_argument(
        "--unix", type=Path, metavar="PATH", help="serve on this Unix socket instead of --host/--port"
    )
    p.add_argument(
        "--kubeconfig",
        type=Path,
        help="a kubeconfig with a bearer token for the InferencePool status writer (default: the "
        "pod's service account)",
    )
    p.add_argument(
        "--status-period", type=float, default=2.0, help="seconds between InferencePool status syncs"
    )
    add_log_level(p, default_format="json")


def _api(kubeconfig: Path | None):  # type: ignore[no-untyped-def]
    import ssl

    import httpx
    import yaml

    if kubeconfig is None:
        from kvgate.epp.k8s import _client

        return _client(None)
    doc = yaml.safe_load(kubeconfig.read_text())
    cluster = doc["clusters"][0]["cluster"]
    ctx = ssl.create_default_context(cafile=cluster["certificate-authority"])
    return httpx.AsyncClient(
        base_url=cluster["server"],
        verify=ctx,
        headers={"Authorization": f"Bearer {doc['users'][0]['user']['token']}"},
        timeout=httpx.Timeout(10),
    )


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from kvgate.api import logs
    from kvgate.gateway.eg_extension import Extension, PoolStatus

    logs.configure(args.log_level, args.log_format, args.quiet)
    try:
        api = _api(args.kubeconfig)
    except (OSError, RuntimeError, KeyError, IndexError, TypeError) as exc:
        print(f"kvgate gateway extension-server: no API server access: {exc}", file=sys.stderr)
        return 2
    server = grpc.server(
        ThreadPoolExecutor(max_workers=4), options=[("grpc.max_receive_message_length", 64 << 20)]
    )
    status = PoolStatus(api, args.status_period)
    server.add_generic_rpc_handlers((Extension(status.rule_backend_refs).handler(),))
    where = f"unix:{args.unix}" if args.unix else f"{args.host}:{args.port}"
    if server.add_insecure_port(where) == 0:
        print(f"kvgate gateway extension-server: cannot listen on {where}", file=sys.stderr)
        return 2
    server.start()
    logging.getLogger("kvgate.gateway.extension").info("serving on %s", where)
    try:
        asyncio.run(status.run())
    except KeyboardInterrupt:
        pass
    finally:
        server.stop(2)
    return 0
