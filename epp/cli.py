"""`kvgate epp serve`: the endpoint picker (Envoy ext_proc, GIE protocol). Flags follow GIE's names."""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvgate.api.cli_args import add_log_level, add_otlp_endpoint, add_request_template_flag, non_negative_int
from kvgate.api.cli_args import boolean as _bool
from kvgate.api.cli_args import non_negative_float as _non_negative_float
from kvgate.api.cli_args import port as _port
from kvgate.api.cli_args import positive_int as _positive_int

if TYPE_CHECKING:
    from kvgate.epp.flow_control import FlowControlConfig

HELP = "run the endpoint picker: an Envoy ext_proc server that routes each request to the best engine"


def _duration(text: str) -> float:
    from kvgate.epp.scheduling.config import parse_duration

    try:
        value = parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def _objective(text: str) -> tuple[str, int]:
    name, sep, prio = text.partition("=")
    try:
        if not sep or not name:
            raise ValueError
        return name.strip(), int(prio)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=PRIORITY (e.g. batch=-1), got {text!r}") from None


def configure_parser(p: argparse.ArgumentParser) -> None:
    _add_endpoint_args(p)
    _add_scheduling_args(p)
    _add_serving_args(p)
    _add_request_limit_args(p)
    _add_tenant_args(p)
    _add_metrics_args(p)


def _add_endpoint_args(p: argparse.ArgumentParser) -> None:
    """Where the pool's endpoints come from."""
    d = p.add_argument_group("endpoints")
    d.add_argument(
        "--endpoints",
        default="",
        help="static endpoint list ip:port,ip:port (local use; no Kubernetes); an optional role suffix "
        "ip:port@prefill, @decode or @both (default) for prefill/decode disaggregation",
    )
    d.add_argument(
        "--kv-events-endpoints",
        default="",
        help="ZMQ KV-event PUB address per --endpoints entry, same order (tcp://127.0.0.1:5557,...)",
    )
    d.add_argument(
        "--kv-replay-endpoints", default="", help="ZMQ KV-event replay (ROUTER) address per --endpoints entry"
    )
    d.add_argument("--pool-name", default="", help="InferencePool to serve (Kubernetes discovery)")
    d.add_argument("--pool-namespace", default="default", help="namespace of the InferencePool")
    d.add_argument(
        "--kube-api-server",
        default="",
        help="Kubernetes API URL without auth (kubectl proxy); default: the pod's service account",
    )
    d.add_argument(
        "--kv-events-port",
        type=_port,
        default=5557,
        help="in Kubernetes: pod port publishing KV events (0: none)",
    )
    d.add_argument(
        "--kv-replay-port",
        type=_port,
        default=0,
        help="in Kubernetes: pod port serving KV-event replay (0: none)",
    )


def _add_scheduling_args(p: argparse.ArgumentParser) -> None:
    """The scheduling profile or config file, P/D, objectives and the tokenizer."""
    s = p.add_argument_group("scheduling")
    s.add_argument("--config-file", default="", help="EndpointPickerConfig YAML (GIE format)")
    s.add_argument(
        "--profile",
        default="",
        help="built-in profile (precise-prefix, precise-prefix-weights, default, round-robin, random; conformance: GIE's "
        "conformance suite, where the client names the endpoint) or, with --config-file, "
        "which of its schedulingProfiles runs (default: precise-prefix / the file's first)",
    )
    s.add_argument(
        "--pd-threshold",
        type=non_negative_int,
        default=None,
        metavar="TOKENS",
        help="prefill/decode disaggregation: a request whose uncached prompt tokens at the picked decode "
        "engine exceed TOKENS gets a prefill engine (role prefill or both) named in x-prefiller-host-port; "
        "default: off (or the config's pdThreshold)",
    )
    s.add_argument(
        "--objective",
        action="append",
        type=_objective,
        default=[],
        metavar="NAME=PRIORITY",
        help="InferenceObjective priority for x-gateway-inference-objective (negative = sheddable); repeatable",
    )
    s.add_argument(
        "--tokenizer",
        default="default",
        help="tokenizer for precise prefix matching, the served model's: 'default', a model folder, a .gguf "
        "file, or a Hugging Face Hub id (org/name[@revision]; only its tokenizer files are fetched into "
        "$HF_HOME, with $HF_TOKEN for gated repos)",
    )
    s.add_argument(
        "--tokenizer-revision", default=None, help="Hub revision (branch, tag or commit) of --tokenizer"
    )


def _add_serving_args(p: argparse.ArgumentParser) -> None:
    """The ext_proc server: its ports (gRPC, health, metrics), TLS and gRPC implementation."""
    n = p.add_argument_group("serving")
    n.add_argument("--host", default="127.0.0.1", help="address to bind; use 0.0.0.0 in a pod")
    n.add_argument("--grpc-port", type=_port, default=9002, help="ext_proc gRPC port")
    n.add_argument("--grpc-health-port", type=_port, default=9003, help="gRPC health port")
    n.add_argument("--metrics-port", type=_port, default=9090, help="Prometheus metrics port")
    n.add_argument(
        "--secure-serving",
        type=_bool,
        nargs="?",
        const=True,
        default=True,
        help="serve ext_proc over TLS with a self-signed certificate; --secure-serving=false for plaintext",
    )
    n.add_argument(
        "--grpc-server",
        choices=["grpclib", "grpcio"],
        default="grpclib",
        help="the gRPC server that carries ext_proc: grpclib runs HTTP/2 in the EPP's event loop; "
        "grpcio: grpcio's asyncio server, whose poller thread hands each message to the loop "
        "(bench/epp_latency.py latency compares the two)",
    )
    n.add_argument(
        "--grpc-max-message-bytes",
        type=_positive_int,
        default=4 * 1024 * 1024,
        help="largest gRPC message the ext_proc port takes, refused from its length prefix with "
        "RESOURCE_EXHAUSTED before it is read (default 4 MiB, grpcio's; Envoy sends bodies in "
        "chunks far below it)",
    )


def _add_request_limit_args(p: argparse.ArgumentParser) -> None:
    """Limits on hostile input."""
    g = p.add_argument_group("request limits (hostile input)")
    add_request_template_flag(
        g, "render chat templates sent in requests (as the engines' flag of the same name)"
    )
    g.add_argument(
        "--max-model-len",
        type=lambda t: 0 if t == "0" else _positive_int(t),
        default=0,
        help="the pool's context in tokens: longer prompts get a 400 before they are fully tokenized "
        "(0: learnt from the engines' GET /v1/models)",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=_positive_int,
        default=8 * 1024 * 1024,
        help="largest request body the EPP buffers; larger: 413 (the gateway's own limit comes first)",
    )


def _flow_ttl(text: str) -> float:
    value = _duration(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite duration, got {text!r}")
    return value


@dataclass(frozen=True)
class _FlowDefaults:
    """FlowControlConfig's defaults, kept here so `kvgate --help` need not import flow control
    (tests/epp/test_tenants.py checks they agree)."""

    enabled: bool = True
    dispatch: str = "pool"
    max_queued: int = 50_000
    max_queued_per_flow: int = 10_000
    max_queued_bytes: int = 512 << 20
    ttl_s: float = 30.0
    dispatch_queue_depth: int = 1
    max_unconfirmed_picks: int = 4
    dispatch_prefill_tokens: int = 1024
    short_reserve: int = 0
    short_prompt_tokens: int = 1024
    fair_share_half_life_s: float = 10.0
    fair_share_max_queue: float = 20.0


FLOW_DEFAULTS = _FlowDefaults()


def _add_tenant_args(p: argparse.ArgumentParser) -> None:
    """Who may use the pool (API keys) and how waiting requests are shared among them."""
    d = FLOW_DEFAULTS
    t = p.add_argument_group("tenants and flow control")
    t.add_argument(
        "--tenants",
        default=None,
        metavar="FILE",
        help="YAML list of tenants {name, key, weight, priority}: every request must carry one's key "
        "(Authorization: Bearer KEY; else 401) and is scheduled as that tenant, whatever "
        "x-gateway-inference-fairness-id says; the key never reaches an engine (with $KVGATE_API_KEY, the "
        "engines' --api-key, set: that key goes in its place); unset: no key asked for",
    )
    t.add_argument(
        "--flow-control",
        action=argparse.BooleanOptionalAction,
        default=d.enabled,
        help="hold requests in the EPP while no engine has room and dispatch them by priority, then "
        "fairness between tenants",
    )
    t.add_argument(
        "--flow-dispatch",
        choices=["pool", "endpoint"],
        default=d.dispatch,
        help="when a held request goes: pool (GIE's): while the pool is not saturated, or while its flow "
        "sent less than its share of the recent work (--flow-fair-share-half-life), picked among all "
        "engines as without flow control; endpoint: while an engine has room for it (the --flow-dispatch-* "
        "limits below), picked among those: tighter isolation between tenants, looser prefix affinity",
    )
    t.add_argument(
        "--flow-fair-share-half-life",
        type=_non_negative_float,
        default=d.fair_share_half_life_s,
        metavar="SECONDS",
        help="pool dispatch in front of engines that order their queues by tenant (kvgate's, "
        "--scheduling-policy fair): a saturated pool holds only the flows that sent more than their "
        "weighted share of the recent work of their priority and below (tokens dispatched, halved every "
        "SECONDS); the others go, since their engines run them first. 0: saturation holds every flow "
        "(engines that serve in arrival order)",
    )
    t.add_argument(
        "--flow-fair-share-max-queue",
        type=_non_negative_float,
        default=d.fair_share_max_queue,
        metavar="N",
        help="... and only while the engines' queues hold fewer than N requests on average: past it "
        "every flow is held, under --flow-ttl and the queue bounds",
    )
    t.add_argument(
        "--flow-max-queued",
        type=_positive_int,
        default=d.max_queued,
        metavar="N",
        help="requests held at once, all flows together; beyond it 503 (429 if sheddable)",
    )
    t.add_argument(
        "--flow-max-queued-per-flow",
        type=_positive_int,
        default=d.max_queued_per_flow,
        metavar="N",
        help="requests held at once per flow (tenant and priority); beyond it 429",
    )
    t.add_argument(
        "--flow-max-queued-bytes",
        type=_positive_int,
        default=d.max_queued_bytes,
        metavar="N",
        help="memory held requests may take, all flows together (their bodies, raw and parsed, and prompt "
        "tokens); beyond it 503 (429 if sheddable)",
    )
    t.add_argument(
        "--flow-ttl",
        type=_flow_ttl,
        default=d.ttl_s,
        metavar="SECONDS",
        help="longest a request is held, in seconds (or e.g. 500ms); then 503 (429 if sheddable)",
    )
    t.add_argument(
        "--flow-dispatch-queue-depth",
        type=_positive_int,
        default=d.dispatch_queue_depth,
        metavar="N",
        help="an engine has room only while fewer than N requests wait in its own queue",
    )
    t.add_argument(
        "--flow-max-unconfirmed-picks",
        type=_positive_int,
        default=d.max_unconfirmed_picks,
        metavar="N",
        help="... and this EPP has sent it fewer than N requests its metrics do not show yet (1: one per "
        "scrape, the tightest isolation; more: bursts on an idle pool wait less)",
    )
    t.add_argument(
        "--flow-dispatch-prefill-tokens",
        type=non_negative_int,
        default=d.dispatch_prefill_tokens,
        metavar="N",
        help="... and, where the engine reports its pending prefill tokens, while the prompt tokens "
        "ahead of a new request, with its own, are at most N, or none are ahead (0: not checked)",
    )
    t.add_argument(
        "--flow-short-reserve",
        type=non_negative_int,
        default=d.short_reserve,
        metavar="N",
        help="while short prompts keep arriving, keep N engines free of long prompts for them (a short "
        "request behind a long prefill waits for its steps); 0: off",
    )
    t.add_argument(
        "--flow-short-prompt-tokens",
        type=_positive_int,
        default=d.short_prompt_tokens,
        metavar="N",
        help="prompts of at most N tokens are short: with --flow-dispatch endpoint they go where no "
        "prompt work is ahead when they can, and --flow-short-reserve keeps engines for them",
    )


def flow_control_config(args: argparse.Namespace) -> FlowControlConfig:
    """The flow-control flags as a FlowControlConfig (its other settings at their defaults)."""
    from kvgate.epp.flow_control import FlowControlConfig

    return FlowControlConfig(
        enabled=args.flow_control,
        dispatch=args.flow_dispatch,
        max_queued=args.flow_max_queued,
        max_queued_per_flow=args.flow_max_queued_per_flow,
        max_queued_bytes=args.flow_max_queued_bytes,
        ttl_s=args.flow_ttl,
        dispatch_queue_depth=args.flow_dispatch_queue_depth,
        max_unconfirmed_picks=args.flow_max_unconfirmed_picks,
        dispatch_prefill_tokens=args.flow_dispatch_prefill_tokens,
        short_reserve=args.flow_short_reserve,
        short_prompt_tokens=args.flow_short_prompt_tokens,
        fair_share_half_life_s=args.flow_fair_share_half_life,
        fair_share_max_queue=args.flow_fair_share_max_queue,
    )


def _add_metrics_args(p: argparse.ArgumentParser) -> None:
    """How often engine metrics are scraped and under which names (vLLM's or others)."""
    m = p.add_argument_group("engine metrics")
    m.add_argument(
        "--refresh-metrics-interval",
        type=_duration,
        default=0.05,
        help="scrape period per endpoint (e.g. 50ms)",
    )
    m.add_argument(
        "--engine-metrics",
        default="vllm",
        choices=["vllm", "sglang", "triton-tensorrt-llm"],
        help="which metric names the engines export",
    )
    m.add_argument(
        "--total-queued-requests-metric", default="", help="override: waiting-queue series (name{label=v})"
    )
    m.add_argument("--total-running-requests-metric", default="", help="override: running-requests series")
    m.add_argument(
        "--kv-cache-usage-percentage-metric", default="", help="override: KV-cache use (0-1) series"
    )
    add_log_level(p, default_format="json")
    # GIE's EPP spells the log format so: a Deployment written for its EPP runs this one unchanged
    m.add_argument(
        "--zap-encoder",
        dest="log_format",
        type=_zap_encoder,
        metavar="{json,console}",
        help="GIE's spelling of --log-format (console = text)",
    )
    add_otlp_endpoint(p)


def _zap_encoder(text: str) -> str:
    formats = {"json": "json", "console": "text"}
    if text not in formats:
        raise argparse.ArgumentTypeError(f"expected json or console, got {text!r}")
    return formats[text]


def _fail(message: str) -> int:
    print(f"kvgate epp serve: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    import asyncio

    from kvgate.api import logs
    from kvgate.api.tracing import endpoint_from_env
    from kvgate.epp.discovery import EndpointListError, static_endpoints
    from kvgate.epp.scheduling.config import ConfigError, load_config
    from kvgate.epp.scraper import MAPPINGS, MetricMapping, MetricSpec
    from kvgate.epp.server import ServerSettings, needs_tokenizer, serve_forever

    logs.configure(args.log_level, args.log_format, args.quiet)

    if bool(args.endpoints) == bool(args.pool_name):
        return _fail("give exactly one of --endpoints (static list) or --pool-name (Kubernetes)")
    if args.tenants:
        from kvgate.epp.tenants import TenantsFileError, load_tenants

        try:  # checked before anything starts: a bad file is a one-line error, not a crash later
            load_tenants(args.tenants)
        except TenantsFileError as exc:
            return _fail(f"--tenants: {exc}")
    try:
        flow_control = flow_control_config(args)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        endpoints = (
            static_endpoints(args.endpoints, args.kv_events_endpoints, args.kv_replay_endpoints)
            if args.endpoints
            else []
        )
        if args.config_file:
            config = load_config(args.config_file)
            profile = args.profile or None
        else:
            config = load_config(None, args.profile or None)
            profile = None
        base = MAPPINGS[args.engine_metrics]
        mapping = MetricMapping(
            MetricSpec.parse(args.total_queued_requests_metric)
            if args.total_queued_requests_metric
            else base.waiting,
            MetricSpec.parse(args.total_running_requests_metric)
            if args.total_running_requests_metric
            else base.running,
            MetricSpec.parse(args.kv_cache_usage_percentage_metric)
            if args.kv_cache_usage_percentage_metric
            else base.kv_usage,
            base.lora_info,
        )
    except (EndpointListError, ConfigError, ValueError) as exc:
        return _fail(str(exc))

    tokenizer = None
    exact = needs_tokenizer(config, args.pd_threshold)
    if exact or flow_control.enabled:  # flow control charges and places by prompt tokens
        from kvgate.epp.tokenization import load as load_tokenizer

        try:
            tokenizer = load_tokenizer(args.tokenizer, args.tokenizer_revision)
        except (OSError, ValueError) as exc:
            if exact:
                return _fail(f"cannot load tokenizer {args.tokenizer!r}: {exc}")
            print(
                f"kvgate epp serve: warning: cannot load tokenizer {args.tokenizer!r} ({exc}); flow control "
                "estimates prompt tokens from the prompt's length (4 characters a token)",
                file=sys.stderr,
            )

    settings = ServerSettings(
        config=config,
        profile_name=profile,
        endpoints=endpoints,
        pool_name=args.pool_name or None,
        pool_namespace=args.pool_namespace,
        kv_events_port=args.kv_events_port,
        kv_replay_port=args.kv_replay_port,
        kube_api_server=args.kube_api_server or None,
        bind_host=args.host,
        grpc_port=args.grpc_port,
        grpc_health_port=args.grpc_health_port,
        metrics_port=args.metrics_port,
        secure_serving=args.secure_serving,
        refresh_metrics_interval=args.refresh_metrics_interval,
        metric_mapping=mapping,
        tokenizer=tokenizer,
        objectives=dict(args.objective),
        trust_request_chat_template=args.trust_request_chat_template,
        max_model_len=args.max_model_len,
        max_request_body_bytes=args.max_request_body_bytes,
        otlp_endpoint=endpoint_from_env(args.otlp_endpoint),
        pd_threshold=args.pd_threshold,
        grpc_server=args.grpc_server,
        grpc_max_message_bytes=args.grpc_max_message_bytes,
        tenants_file=args.tenants or None,
        engine_api_key=os.environ.get("KVGATE_API_KEY") or None,
        flow_control=flow_control,
    )
    try:
        asyncio.run(serve_forever(settings))
    except ValueError as exc:
        return _fail(str(exc))
    except (OSError, RuntimeError) as exc:  # grpc reports a port in use as RuntimeError
        return _fail(f"cannot serve: {exc}")
    return 0
