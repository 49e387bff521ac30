"""`kvgate router serve`: the model router, an Envoy ext_proc stage that picks the pool from the
request body's model (GIE's body-based routing), for one gateway in front of several pools."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from kvgate.api.cli_args import add_log_level, positive_float
from kvgate.api.cli_args import port as _port

HELP = "run the model router: picks the pool (and its endpoint picker) from each request's model"


def _pool(text: str) -> tuple[str, tuple[str, ...]]:
    name, sep, engines = text.partition("=")
    hosts = tuple(e.strip() for e in engines.split(",") if e.strip())
    if (
        not sep
        or not name.strip()
        or not hosts
        or any(":" not in h or not h.rsplit(":", 1)[1].isdigit() for h in hosts)
    ):
        raise argparse.ArgumentTypeError(
            f"expected NAME=HOST:PORT[,HOST:PORT...] (a pool and its engines), got {text!r}"
        )
    return name.strip(), hosts


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--pool",
        action="append",
        type=_pool,
        required=True,
        metavar="NAME=HOST:PORT[,...]",
        help="a pool and its engines (repeatable). Requests for the model NAME, or for any model or "
        "adapter its engines list in GET /v1/models, go to this pool; on a name several pools "
        "serve, the first given wins",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind; use 0.0.0.0 in a pod")
    p.add_argument("--grpc-port", type=_port, default=9004, help="ext_proc gRPC port (0: any free port)")
    p.add_argument("--grpc-health-port", type=_port, default=9005, help="gRPC health port")
    p.add_argument(
        "--refresh-interval",
        type=positive_float,
        default=2.0,
        help="seconds between polls of the engines' model lists (a request for a model not listed yet "
        "asks them again at once, at most every 0.2 s)",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=8 * 1024 * 1024,
        help="larger bodies are refused with 413",
    )
    p.add_argument(
        "--tenants",
        metavar="FILE",
        help="the pools' tenants file (their EPPs' --tenants): every request needs one tenant's API key "
        "(Authorization: Bearer KEY), GET /v1/models included; others get 401",
    )
    p.add_argument(
        "--engine-keys",
        default=None,
        metavar="DIR",
        help="a folder with one file per pool, named after it, holding the key that pool's engines "
        "require on GET /v1/models (a ModelDeployment with tenants: its Secret <name>-engine-key, "
        "key api-key); read at every refresh; a pool without a file uses $KVGATE_API_KEY",
    )
    add_log_level(p, default_format="json")


def run(args: argparse.Namespace) -> int:
    import asyncio

    from kvgate.api import logs
    from kvgate.gateway.model_router import PoolSource, RouterSettings, serve_forever

    logs.configure(args.log_level, args.log_format, args.quiet)
    names = [name for name, _ in args.pool]
    if len(set(names)) != len(names):
        print(f"kvgate router serve: pool names must be unique, got {', '.join(names)}", file=sys.stderr)
        return 2
    if args.tenants:
        from kvgate.epp.tenants import TenantsFileError, load_tenants

        try:
            load_tenants(args.tenants)
        except TenantsFileError as exc:
            print(f"kvgate router serve: --tenants: {exc}", file=sys.stderr)
            return 2
    settings = RouterSettings(
        pools=[PoolSource(name, engines) for name, engines in args.pool],
        bind_host=args.host,
        grpc_port=args.grpc_port,
        grpc_health_port=args.grpc_health_port,
        refresh_interval=args.refresh_interval,
        max_request_body_bytes=args.max_request_body_bytes,
        api_key=os.environ.get("KVGATE_API_KEY") or None,
        engine_keys=Path(args.engine_keys) if args.engine_keys else None,
        tenants_file=args.tenants,
    )
    try:
        asyncio.run(serve_forever(settings))
    except (OSError, RuntimeError) as exc:  # grpc reports a port in use as RuntimeError
        print(f"kvgate router serve: cannot serve: {exc}", file=sys.stderr)
        return 2
    return 0
