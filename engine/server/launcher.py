"""Start-up and shutdown of `kvgate engine serve`.

Order: bind the listening socket (fail fast on a taken port), build the engine (load the model
or the simulator), open the KV-event sockets, start the engine thread, serve HTTP. SIGTERM (or
SIGINT) first announces draining — /health answers 503 and /metrics shows `kvgate:draining 1`,
both of which the EPP reads within one scrape — while new requests are still admitted for the
drain grace period: a request the picker routed here just before it noticed must not fail.
Then new generation requests get 503, requests in flight get up to the shutdown timeout, the
rest are ended with an error, and serve returns 0. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import uvicorn

from kvgate.api.tracing import Tracer
from kvgate.engine.config import EngineConfig

if TYPE_CHECKING:  # for annotations only; each is imported where it is built, when it runs
    from kvgate.engine.llm_engine import LLMEngine
    from kvgate.engine.server.app import ServerState
    from kvgate.engine.server.async_engine import AsyncEngine
    from kvgate.engine.server.kv_publisher import KVEventPublisher
    from kvgate.engine.server.kv_transfer_http import KVTransfer
    from kvgate.engine.server.metrics import EngineMetrics

log = logging.getLogger("kvgate.engine")


class ServeError(Exception):
    """A start-up failure with a message fit for the user (bad model path, port in use...)."""


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queued_requests: int | None = None
    shutdown_timeout: float = 30.0
    drain_grace_period: float = 5.0  # after SIGTERM: report draining, keep accepting this long
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic_endpoint: str | None = None
    kv_events_buffer: int = 10_000
    kv_events_connect: bool = False
    model_aliases: list[str] = field(default_factory=list)  # more names clients may send as `model`
    lora_modules: list[tuple[str, str]] = field(default_factory=list)  # (adapter name, path)
    enable_lora: bool = False  # mirrors EngineConfig.enable_lora (the flags' checks read it here)
    lora_unload_grace: float = 2.0  # an unloaded adapter is still served this long (unlisted)
    enable_failure_injection: bool = False
    trust_request_chat_template: bool = False
    enable_auto_tool_choice: bool = False  # vLLM's flag: serve tool_choice "auto"
    tool_call_parser: str | None = None  # a kvgate.engine.server.tools.parsers.PARSERS name
    max_request_body_bytes: int = 32 * 1024 * 1024
    header_read_timeout: float = 10.0  # 0: none
    body_read_timeout: float = 30.0  # 0: none
    body_total_timeout: float = 120.0  # 0: none
    metrics_require_api_key: bool = False
    http_parser: str = "auto"  # auto (httptools when installed) | httptools | h11
    event_loop: str = "auto"  # auto (uvloop when installed) | uvloop | asyncio
    otlp_endpoint: str | None = None  # OpenTelemetry traces (kvgate.api.tracing); None: off
    kv_role: str = "none"  # prefill/decode disaggregation: none | producer | consumer | both
    kv_transfer_timeout: float = 30.0  # a consumer's hand-off (prefill call + pull), then local prefill
    kv_pin_timeout: float = 30.0  # a producer frees blocks nobody pulled within this


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets that say so, and
    # without it Nagle + delayed ACK add ~40 ms to every response written in two parts.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def advertised_endpoint(host: str, port: int) -> str:
    """host:port others reach this server at; a wildcard bind advertises the pod's address."""
    if host in ("0.0.0.0", "::", ""):
        host = os.environ.get("POD_IP") or _own_ip()
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def _own_ip() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ServeError("--event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return None
    return uvloop.new_event_loop


def _http_protocol(choice: str) -> str:
    if choice == "auto":
        return "auto"  # uvicorn picks httptools when it is importable, else h11
    if choice == "httptools":
        try:
            import httptools  # noqa: F401
        except ImportError:
            raise ServeError(
                "--http-parser httptools: httptools is not installed (pip install httptools)"
            ) from None
    return choice


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvgate")
    except PackageNotFoundError:
        return "0.0.0+unknown"


def build_engine(config: EngineConfig) -> LLMEngine:
    from kvgate.api.tokenizer import ModelNotFoundError, TokenizerLoadError
    from kvgate.engine.llm_engine import LLMEngine

    try:
        return LLMEngine(config)
    except (ModelNotFoundError, TokenizerLoadError) as exc:
        raise ServeError(str(exc)) from None
    except (ValueError, FileNotFoundError) as exc:
        raise ServeError(f"cannot start the engine: {exc}") from None


def register_adapters(engine: LLMEngine, modules: list[tuple[str, str]]) -> None:
    """Read and register the --lora-modules adapters; a bad one stops start-up with its reason."""
    for name, path in modules:
        try:
            engine.add_lora(name, engine.load_lora(name, path))
        except ValueError as exc:
            raise ServeError(str(exc)) from None


def serve(config: EngineConfig, options: ServerOptions) -> int:
    if options.lora_modules and not options.enable_lora:
        raise ServeError("--lora-modules needs --enable-lora")
    if config.max_cpu_loras is not None and config.max_cpu_loras < config.max_loras:
        # as vLLM: every adapter in a slot is also held on the CPU
        raise ServeError(
            f"--max-cpu-loras ({config.max_cpu_loras}) must be at least --max-loras ({config.max_loras})"
        )
    names: set[str] = set()
    for name, _ in options.lora_modules:
        if name in names or name == config.model_name() or name in options.model_aliases:
            raise ServeError(
                f"LoRA module name {name!r} is used twice (adapters and served model names must differ)"
            )
        names.add(name)
    sock = bind_socket(options.host, options.port)
    try:
        engine = build_engine(config)
        register_adapters(engine, options.lora_modules)
        with asyncio.Runner(loop_factory=_loop_factory(options.event_loop)) as runner:
            return runner.run(_serve(config, options, engine, sock))
    finally:
        sock.close()


async def _serve(config: EngineConfig, options: ServerOptions, engine: LLMEngine, sock: socket.socket) -> int:
    """Build the server around the loaded engine, listen, serve until a signal drains it."""
    from kvgate.engine.server.app import build_app
    from kvgate.engine.server.async_engine import AsyncEngine
    from kvgate.engine.server.metrics import CacheConfigInfo, EngineMetrics
    from kvgate.engine.server.slow_clients import protocol_class

    port = sock.getsockname()[1]
    stats = engine.get_stats()
    model_name = config.model_name()
    cache = CacheConfigInfo(
        block_size=stats.block_size,
        num_gpu_blocks=stats.num_kv_blocks,
        enable_prefix_caching=config.enable_prefix_caching,
        gpu_memory_utilization=config.gpu_memory_utilization,
        num_cpu_blocks=stats.num_host_kv_blocks or None,
    )
    spec = config.speculative_config
    metrics = EngineMetrics(
        model_name,
        cache,
        max_model_len=engine.max_model_len,
        num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
        max_num_seqs=config.max_num_seqs,
    )
    if config.enable_lora:
        metrics.set_lora_state(max_lora=config.max_loras, running=(), waiting=())
    publisher = _kv_publisher(options, port, model_name)
    async_engine = AsyncEngine(engine, metrics, publisher, max_queued_requests=options.max_queued_requests)
    kv_transfer = _kv_transfer(options, port, model_name, async_engine, metrics)
    state = _server_state(config, options, engine, async_engine, metrics, kv_transfer)
    uv_config = uvicorn.Config(
        build_app(state),
        http=protocol_class(_http_protocol(options.http_parser), options.header_read_timeout),
        log_config=None,
        log_level=logging.WARNING,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=2,
        timeout_keep_alive=30,
    )
    server = _Server(uv_config)
    loop = asyncio.get_running_loop()
    async_engine.start(loop)
    _drain_on_signals(loop, server, state, options)

    # Listen only now that the engine is built (probes during a model load are refused, not
    # left hanging), and before the ready line: connections arriving between that line and
    # uvicorn's accept loop wait in the backlog.
    sock.listen(2048)
    mode = " (simulated)" if config.simulate else ""
    kv = ""
    if publisher is not None:
        replay = f" replay {publisher.replay_endpoint}" if publisher.replay_endpoint else ""
        kv = f", kv events {publisher.endpoint}{replay} topic {publisher.topic.decode()}"
    if kv_transfer is not None:
        kv += f", kv role {options.kv_role}"
    log.info(
        "kvgate engine serving %s%s: block_size=%d kv_blocks=%d max_model_len=%d on http://%s%s",
        model_name,
        mode,
        stats.block_size,
        stats.num_kv_blocks,
        state.serving.model.max_model_len,
        advertised_endpoint(options.host, port)
        if options.host in ("0.0.0.0", "::")
        else f"{options.host}:{port}",
        kv,
    )
    try:
        await server.serve(sockets=[sock])
    finally:
        if kv_transfer is not None:
            with contextlib.suppress(Exception):  # pins die with the engine anyway
                await asyncio.wait_for(kv_transfer.close(), 5.0)
        await asyncio.to_thread(async_engine.stop)
        await asyncio.to_thread(state.tracer.shutdown)
    return 0


def _kv_publisher(options: ServerOptions, port: int, model_name: str) -> KVEventPublisher | None:
    """The KV-event sockets (--kv-events-endpoint), or None when the engine publishes none."""
    if not options.kv_events_endpoint:
        return None
    from kvgate.api.contracts.kv_events import topic_for
    from kvgate.engine.server.kv_publisher import KVEventPublisher

    topic_endpoint = options.kv_events_topic_endpoint or advertised_endpoint(options.host, port)
    try:
        return KVEventPublisher(
            options.kv_events_endpoint,
            topic_for(topic_endpoint, model_name),
            replay_endpoint=options.kv_events_replay_endpoint,
            buffer_size=options.kv_events_buffer,
            connect=options.kv_events_connect,
        )
    except Exception as exc:  # zmq.ZMQError or OSError: a bad or taken endpoint
        hint = (
            "" if options.kv_events_connect else " (to push to a remote subscriber, add --kv-events-connect)"
        )
        raise ServeError(
            f"cannot open the KV-event sockets at {options.kv_events_endpoint}: {exc}{hint}"
        ) from None


def _kv_transfer(
    options: ServerOptions, port: int, model_name: str, async_engine: AsyncEngine, metrics: EngineMetrics
) -> KVTransfer | None:
    """The prefill/decode KV hand-off (--kv-role), or None when the engine takes no part."""
    if options.kv_role == "none":
        return None
    from kvgate.engine.server.kv_transfer_http import KVTransfer, KVTransferSettings

    host, _, adv_port = advertised_endpoint(options.host, port).rpartition(":")
    try:
        return KVTransfer(
            async_engine,
            KVTransferSettings(
                role=options.kv_role,
                advertise_host=host.strip("[]"),
                advertise_port=int(adv_port),
                engine_id=f"{model_name}@{host}:{adv_port}",
                pin_timeout=options.kv_pin_timeout,
                timeout=options.kv_transfer_timeout,
                secret=(os.environ.get("KVGATE_KV_TRANSFER_SECRET") or options.api_key or "").encode()
                or None,
            ),
            metrics,
            options.api_key,
        )
    except ValueError as exc:
        raise ServeError(str(exc)) from None


def _server_state(
    config: EngineConfig,
    options: ServerOptions,
    engine: LLMEngine,
    async_engine: AsyncEngine,
    metrics: EngineMetrics,
    kv_transfer: KVTransfer | None,
) -> ServerState:
    """What every route shares: the OpenAI serving layer over the engine, and the server's
    settings (auth, limits, tracing, LoRA admin)."""
    from kvgate.engine.server.app import ServerState
    from kvgate.engine.server.lora_admin import LoRAAdmin
    from kvgate.engine.server.serving import ModelInfo, OpenAIServing
    from kvgate.engine.server.tools.request import ToolOptions

    tools = ToolOptions(options.enable_auto_tool_choice, options.tool_call_parser)
    try:
        tools.check()
    except ValueError as exc:
        raise ServeError(str(exc)) from None
    model_name = config.model_name()
    info = ModelInfo(
        served_names=[model_name, *(a for a in options.model_aliases if a != model_name)],
        root=config.model,
        max_model_len=int(engine.max_model_len),
        vocab_size=int(engine.vocab_size),
        created=int(time.time()),
        adapters=dict(options.lora_modules),
    )
    return ServerState(
        serving=OpenAIServing(
            async_engine,
            engine.tokenizer,
            info,
            trust_request_chat_template=options.trust_request_chat_template,
            tool_options=tools,
            kv_transfer=kv_transfer,
        ),
        engine=async_engine,
        metrics=metrics,
        version=_version(),
        api_key=options.api_key,
        failure_injection=options.enable_failure_injection or config.simulate,
        max_body_bytes=options.max_request_body_bytes,
        body_read_timeout=options.body_read_timeout or None,
        body_total_timeout=options.body_total_timeout or None,
        metrics_auth=options.metrics_require_api_key,
        tracer=Tracer(options.otlp_endpoint, "kvgate-engine"),
        lora_admin=LoRAAdmin(async_engine, info, options.lora_unload_grace) if config.enable_lora else None,
        kv_transfer=kv_transfer,
    )


def _drain_on_signals(
    loop: asyncio.AbstractEventLoop, server: _Server, state: ServerState, options: ServerOptions
) -> None:
    """SIGTERM/SIGINT drain: announce it (/health 503, kvgate:draining 1) so pickers stop
    sending, keep admitting for --drain-grace-period, then refuse and wait up to
    --shutdown-timeout for requests in flight (ending the rest with a 503). A second signal
    stops at once."""
    async_engine, metrics = state.engine, state.metrics
    drain_task: asyncio.Task[None] | None = None

    async def drain() -> None:
        state.draining = True  # /health 503 + kvgate:draining 1: pickers stop sending here
        metrics.set_draining(True)
        if options.drain_grace_period > 0:
            log.info("shutdown: draining announced; admitting for %.1fs more", options.drain_grace_period)
            await asyncio.sleep(options.drain_grace_period)
        state.refusing = True
        n = async_engine.num_in_flight
        log.info("shutdown: draining %d request(s), up to %.0fs", n, options.shutdown_timeout)
        if not await async_engine.wait_idle(options.shutdown_timeout):
            log.warning(
                "shutdown: %d request(s) still running after %.0fs; ending them",
                async_engine.num_in_flight,
                options.shutdown_timeout,
            )
            async_engine.fail_all("The server shut down before this request finished.", status=503)
            await async_engine.wait_idle(2.0)
        server.should_exit = True

    def on_signal(sig: signal.Signals) -> None:
        nonlocal drain_task
        if drain_task is None:
            drain_task = loop.create_task(drain())
        else:  # second signal: stop now
            server.should_exit = True
            server.force_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal, sig)


class _Server(uvicorn.Server):
    """uvicorn's Server without its signal handlers (ours drain first)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield
