"""`kvgate operator run`: the Kubernetes operator for ModelDeployments and managed InferencePools."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from urllib.parse import urlparse

from kvgate.api.cli_args import add_log_format, port, positive_float
from kvgate.operator.config import (
    DEFAULT_ENGINE_IMAGE,
    DEFAULT_EPP_IMAGE,
    DEFAULT_PROMETHEUS_ADDRESS,
    OperatorConfig,
)

HELP = "run the operator: ModelDeployment -> engine Deployment, InferencePool, EPP, autoscaler, HTTPRoute"


def configure_parser(p: argparse.ArgumentParser) -> None:
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        metavar="NS",
        help="watch this namespace (repeatable; glob patterns allowed); default: all namespaces",
    )
    scope.add_argument(
        "--all-namespaces", "-A", action="store_true", help="watch every namespace (needs a ClusterRole)"
    )
    p.add_argument(
        "--prometheus-url",
        default=None,
        help="Prometheus the operator reads pool queue/saturation from into status (off when unset)",
    )
    p.add_argument(
        "--keda-prometheus-address",
        default=DEFAULT_PROMETHEUS_ADDRESS,
        help="Prometheus address written into KEDA ScaledObjects (in-cluster URL)",
    )
    p.add_argument("--engine-image", default=DEFAULT_ENGINE_IMAGE, help="engine image when a spec names none")
    p.add_argument(
        "--epp-image", default=DEFAULT_EPP_IMAGE, help="endpoint picker image when a spec names none"
    )
    p.add_argument(
        "--resync-seconds",
        type=positive_float,
        default=30.0,
        help="how often every object is re-checked: repairs hand-edited or deleted children, refreshes status",
    )
    p.add_argument(
        "--liveness-port",
        type=port,
        default=8080,
        help="port of the /healthz liveness endpoint (0 turns it off)",
    )
    p.add_argument(
        "--standalone",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run without kopf peering (one operator replica; the chart runs one with Recreate)",
    )
    p.add_argument(
        "--scanning",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="watch for namespaces and CRDs appearing at run time (needs list/watch on both)",
    )
    p.add_argument("--run-as-user", type=int, default=65532, help="uid the engine and EPP pods run as")
    p.add_argument(
        "--metrics-api-port",
        type=int,
        default=0,
        help="serve the External Metrics API (external.metrics.k8s.io/v1beta1) the operator's HPAs scale "
        "on, read from the pools' endpoint pickers, over TLS on this port for the API server's "
        "aggregation layer (an APIService; the chart's metricsApi.enabled); 0: off",
    )
    p.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    add_log_format(p)


def _config(args: argparse.Namespace) -> OperatorConfig:
    if args.prometheus_url is not None:
        url = urlparse(args.prometheus_url)
        if url.scheme not in ("http", "https") or not url.netloc:
            raise ValueError(f"--prometheus-url must be an http(s) URL, got {args.prometheus_url!r}")
    if not 0 <= args.metrics_api_port <= 65535:
        raise ValueError(f"--metrics-api-port must be 0-65535, got {args.metrics_api_port}")
    all_namespaces = args.all_namespaces or not args.namespace
    return OperatorConfig(
        engine_image=args.engine_image,
        epp_image=args.epp_image,
        keda_prometheus_address=args.keda_prometheus_address,
        prometheus_url=args.prometheus_url,
        resync_seconds=args.resync_seconds,
        namespaces=tuple(args.namespace),
        all_namespaces=all_namespaces,
        standalone=args.standalone,
        scanning=args.scanning,
        liveness_endpoint=f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None,
        run_as_user=args.run_as_user,
        metrics_api_port=args.metrics_api_port,
    )


SA_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


def _credentials_problem() -> str | None:
    """Why kopf could not log in, found before it starts retrying forever; None when it can."""
    if SA_TOKEN.exists() and os.environ.get("KUBERNETES_SERVICE_HOST"):
        return None
    paths = os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    existing = [p for p in paths.split(os.pathsep) if p and Path(p).is_file()]
    if existing:
        return None
    return f"no Kubernetes credentials: not in a pod, and no kubeconfig at {paths} (set KUBECONFIG)"


def run(args: argparse.Namespace) -> int:
    try:
        config = _config(args)
        problem = _credentials_problem()
        if problem:
            raise ValueError(problem)
    except ValueError as exc:
        print(f"kvgate operator run: {exc}", file=sys.stderr)
        return 2
    from kvgate.api import logs

    logs.configure("debug" if args.verbose else "info", args.log_format, args.quiet)
    import asyncio

    from kvgate.operator.handlers import Operator  # kopf is heavy: import only when running

    try:
        asyncio.run(Operator(config).run())
    except KeyboardInterrupt:
        return 130
    return 0
