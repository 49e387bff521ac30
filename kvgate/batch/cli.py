"""`kvgate batch serve`: the OpenAI Batch API (Files and Batches) in front of a kvgate gateway."""

from __future__ import annotations

import argparse
import logging
import os
import socket
from pathlib import Path

HELP = "the OpenAI Batch API (files, batches), sending each line through the gateway as sheddable work"
DATABASE_URL_ENV = "KVGATE_BATCH_DATABASE_URL"  # --database-url's default (keeps a password out of argv)


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8090, help="port to listen on")
    p.add_argument(
        "--gateway-url", required=True, help="the gateway each line is sent to, e.g. http://127.0.0.1:8080"
    )
    p.add_argument(
        "--batch-dir", required=True, type=Path, help="where files and the default SQLite database live"
    )
    p.add_argument(
        "--database-url",
        default=None,
        help="SQLAlchemy URL (sqlite:///... or postgresql://USER:PASSWORD@HOST:PORT/DB, the psycopg "
        f"driver); default: ${DATABASE_URL_ENV}, else SQLite in --batch-dir. Several replicas may share "
        "one PostgreSQL database (and one --batch-dir, where the files' bytes are): each claims its own "
        "lines (FOR UPDATE SKIP LOCKED)",
    )
    p.add_argument(
        "--replica-id",
        default=None,
        help="this replica's name in the database, the same across its restarts (a restarted replica "
        "takes back the lines it was sending at once; another's wait for their lease to run out); "
        "default: HOSTNAME:PORT",
    )
    p.add_argument(
        "--lease",
        type=float,
        default=30.0,
        help="seconds a claimed line stays this replica's without a renewal (renewed every third of it)",
    )
    p.add_argument(
        "--tenants",
        default=None,
        metavar="FILE",
        help="the EPPs' tenants file: every request needs one tenant's key (else 401), and a tenant "
        "sees only its own files and batches, whichever of its keys made them; default: any key, "
        "each key seeing its own",
    )
    p.add_argument("--quiet", action="store_true", help="log only warnings and errors")
    p.add_argument(
        "--objective",
        default="batch",
        help="x-gateway-inference-objective sent with each line (give the EPP --objective NAME=-1: sheddable)",
    )
    p.add_argument("--max-concurrency", type=int, default=16, help="cap of the adaptive (AIMD) concurrency")
    p.add_argument(
        "--max-attempts", type=int, default=3, help="attempts per line before it goes to the error file"
    )
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request to the gateway")
    p.add_argument(
        "--max-file-bytes", type=int, default=200 * 1024 * 1024, help="largest input file accepted"
    )
    p.add_argument("--max-lines", type=int, default=50_000, help="most requests in one input file")


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvgate.batch.app import Limits, build_app
    from kvgate.batch.blobs import Blobs
    from kvgate.batch.store import Store
    from kvgate.batch.worker import Worker

    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.lease <= 0:
        raise SystemExit("kvgate batch serve: --lease must be > 0")
    batch_dir: Path = args.batch_dir
    batch_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    url = (
        args.database_url
        or os.environ.get(DATABASE_URL_ENV)
        or f"sqlite:///{batch_dir.resolve() / 'batch.db'}"
    )
    tenant_of = None
    if args.tenants:
        from kvgate.epp.tenants import TenantsFileError, load_tenants

        try:
            registry = load_tenants(args.tenants)
        except TenantsFileError as exc:
            raise SystemExit(f"kvgate batch serve: --tenants: {exc}") from None

        def tenant_of(auth: str | None) -> str | None:
            tenant = registry.authenticate(auth)
            return tenant.name if tenant is not None else None

    replica = args.replica_id or f"{socket.gethostname()}:{args.port}"
    store = Store(url, replica=replica, lease_s=args.lease)
    blobs = Blobs(batch_dir / "files")
    worker = Worker(
        store,
        blobs,
        args.gateway_url,
        objective=args.objective,
        max_concurrency=args.max_concurrency,
        max_attempts=args.max_attempts,
        request_timeout_s=args.request_timeout,
    )
    app = build_app(
        store,
        blobs,
        worker,
        Limits(max_file_bytes=args.max_file_bytes, max_lines=args.max_lines),
        tenant_of=tenant_of,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
