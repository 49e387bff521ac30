"""Wires the EPP together: discovery → datastore ← signals; ext_proc + health + metrics servers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2_grpc
from prometheus_client import start_http_server

from kvgate.api.tracing import Tracer
from kvgate.epp.datastore import Datastore, Endpoint
from kvgate.epp.director import Director
from kvgate.epp.extproc import DEFAULT_MAX_BODY_BYTES, EndpointPickerHandler, ExternalProcessor
from kvgate.epp.flow_control import FlowControlConfig, FlowController, FlowGate
from kvgate.epp.flow_sharing import share_service
from kvgate.epp.grpclib_server import DEFAULT_MAX_MESSAGE_BYTES, GrpclibExtProcServer
from kvgate.epp.health import EppHealth, ThreadedHealthServer
from kvgate.epp.kv_subscriber import KVEventSubscribers
from kvgate.epp.metrics import EppMetrics
from kvgate.epp.request import PromptPolicy, Tokenizer
from kvgate.epp.scheduling.config import EndpointPickerConfig, build_profiles, saturation_detector
from kvgate.epp.scheduling.plugins.header_based_testing_filter import HeaderBasedTestingFilter
from kvgate.epp.scheduling.plugins.pd_profile_handler import PrefillDecodeHandler
from kvgate.epp.scheduling.registry import Consumes
from kvgate.epp.scraper import MetricMapping, MetricsScraper
from kvgate.epp.tenants import TenantsReloader, load_tenants

log = logging.getLogger("kvgate.epp")


@dataclass
class ServerSettings:
    config: EndpointPickerConfig
    profile_name: str | None = None  # which of the config's profiles runs (default: the first)
    endpoints: list[Endpoint] = field(default_factory=list)
    pool_name: str | None = None
    pool_namespace: str = "default"
    kv_events_port: int = 0  # in Kubernetes: pod ip + this port (0: no events)
    kv_replay_port: int = 0
    kube_api_server: str | None = None  # explicit API server URL (kubectl proxy, tests); else in-cluster
    bind_host: str = "127.0.0.1"
    grpc_port: int = 9002
    grpc_health_port: int = 9003
    metrics_port: int = 9090
    secure_serving: bool = True
    refresh_metrics_interval: float = 0.05
    metric_mapping: MetricMapping | None = None
    tokenizer: Tokenizer | None = None
    objectives: dict[str, int] = field(default_factory=dict)
    trust_request_chat_template: bool = False
    max_model_len: int = 0  # 0: learnt from the engines' GET /v1/models
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    otlp_endpoint: str | None = None  # traces (kvgate.api.tracing); None: off
    pd_threshold: int | None = None  # P/D above this many uncached tokens; None: the config's (off)
    # which gRPC server carries ext_proc: grpclib (in the event loop, lower latency) or grpcio
    grpc_server: str = "grpclib"
    # largest gRPC message the ext_proc port takes (grpcio's default); larger: RESOURCE_EXHAUSTED
    grpc_max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # A tenants file (kvgate.epp.tenants): every request needs one tenant's API key, and the
    # tenant becomes its fairness id. None: no key asked for.
    tenants_file: str | None = None
    # The engines' API key (their --api-key; $KVGATE_API_KEY): sent on the EPP's scrapes and, with
    # tenants, in place of the client's key on every request it forwards, so an engine that
    # requires it serves only what came through the picker. None: the engines ask for none.
    engine_api_key: str | None = None
    # Requests held and dispatched by priority and fairness when the pool has room.
    flow_control: FlowControlConfig = field(default_factory=FlowControlConfig)


# What the EPP itself reads whatever its plugins: the saturation detector an endpoint's queue
# (scraped, plus picks not yet scraped, other replicas' among them: admissions), the metrics
# exporter the prefix index's size, the prompt check each engine's context (GET /v1/models).
# So the scraper, the model lists and the KV-event subscriptions (events and admissions) are
# always built; a plugin's declaration adds the tokenizer (Consumes.TOKENS).
CORE_CONSUMES = frozenset({Consumes.METRICS, Consumes.ADMISSIONS, Consumes.KV_INDEX, Consumes.ADAPTERS})


def data_sources(config: EndpointPickerConfig, pd_threshold: int | None = None) -> frozenset[Consumes]:
    """What the configured plugins declare they consume (every profile of the config, and the
    P/D handler when P/D is on), with what the EPP itself reads: the data sources to build."""
    out = CORE_CONSUMES
    for profile in build_profiles(config):
        out |= profile.consumes()
    if pd_threshold is not None or config.pd_threshold is not None:
        out |= PrefillDecodeHandler.consumes
    return out


def needs_tokenizer(config: EndpointPickerConfig, pd_threshold: int | None = None) -> bool:
    """Whether a configured plugin keys on prompt tokens (declares Consumes.TOKENS), or P/D is
    on (it counts uncached prompt tokens)."""
    return Consumes.TOKENS in data_sources(config, pd_threshold)


class EppServer:
    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.datastore = Datastore()
        profiles = build_profiles(settings.config)
        if settings.profile_name:
            chosen = [p for p in profiles if p.name == settings.profile_name]
            if not chosen:
                raise ValueError(
                    f"profile {settings.profile_name!r} is not in the config (has: {', '.join(p.name for p in profiles)})"
                )
            profile = chosen[0]
        else:
            profile = profiles[0]
        self.profile = profile
        threshold = (
            settings.pd_threshold if settings.pd_threshold is not None else settings.config.pd_threshold
        )
        self.director = Director(
            self.datastore,
            profile,
            saturation_detector(settings.config),
            pd=PrefillDecodeHandler(threshold) if threshold is not None else None,
        )
        self.metrics = EppMetrics(self.datastore, settings.pool_name or "local")
        self.tracer = Tracer(settings.otlp_endpoint, "kvgate-epp")
        self.metrics.describe_plugins(
            {f.name: ("Filter", f.type_name) for f in profile.filters}
            | {sc.name: ("Scorer", sc.type_name) for sc, _ in profile.scorers}
            | {profile.picker.name: ("Picker", profile.picker.type_name)}
        )
        objectives = {**settings.config.objectives, **settings.objectives}
        # The CLI has checked the file already; a bad one here is a TenantsFileError.
        self.tenants = load_tenants(settings.tenants_file) if settings.tenants_file else None
        self.handler = EndpointPickerHandler(
            self.director,
            self.metrics,
            settings.tokenizer,
            objectives,
            policy=PromptPolicy(settings.trust_request_chat_template, settings.max_model_len),
            max_body_bytes=settings.max_request_body_bytes,
            tracer=self.tracer,
            tenants=self.tenants,
            engine_api_key=settings.engine_api_key,
            # with GIE's conformance filter the suite also wants the served endpoint echoed
            report_served_endpoint=any(
                f.type_name == HeaderBasedTestingFilter.type_name for f in profile.filters
            ),
        )
        self.flow: FlowGate | None = None
        if settings.flow_control.enabled:
            controller = FlowController(self.director, settings.flow_control, self.tenants)
            self.metrics.watch_flow_control(controller, tenants=self.tenants.tenants if self.tenants else ())
            share_service(controller, self.datastore)
            self.flow = self.handler.flow = FlowGate(controller)
        self.health = EppHealth(self.datastore)
        self.grpc_port = settings.grpc_port
        self.health_port = settings.grpc_health_port
        self.metrics_port = settings.metrics_port
        self._servers: list[grpc.aio.Server] = []
        self._extproc: GrpclibExtProcServer | None = None
        self._health_server: ThreadedHealthServer | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._http: Any = None
        self.scraper: MetricsScraper | None = None
        self.kv: KVEventSubscribers | None = None

    async def start(self) -> None:
        s = self.settings
        self._servers = []
        tls = None
        if s.secure_serving:
            from kvgate.api.tls import self_signed_cert

            tls = self_signed_cert()
        if s.grpc_server == "grpclib":
            # also serves gRPC health, so Envoy's cluster health check shares its transport (TLS)
            self._extproc = GrpclibExtProcServer(
                self.handler, self.health, s.bind_host, s.grpc_port, tls, s.grpc_max_message_bytes
            )
            self.grpc_port = self._extproc.port
        else:
            options = [
                ("grpc.max_concurrent_streams", 100_000),
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", s.grpc_max_message_bytes),
            ]
            ext = grpc.aio.server(options=options)
            ep_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(self.handler), ext)
            health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, ext)
            target = f"{s.bind_host}:{s.grpc_port}"
            if tls is not None:
                cert, key = tls
                self.grpc_port = ext.add_secure_port(target, grpc.ssl_server_credentials([(key, cert)]))
            else:
                self.grpc_port = ext.add_insecure_port(target)
            self._servers.append(ext)
        self._health_server = ThreadedHealthServer(self.health, s.bind_host, s.grpc_health_port)
        self.health_port = self._health_server.port
        await self.health.start()
        for server in self._servers:
            await server.start()
        if self._extproc is not None:
            await self._extproc.start()
        self._health_server.start()
        self._http, _ = start_http_server(s.metrics_port, s.bind_host, registry=self.metrics.registry)
        self.metrics_port = self._http.server_port
        from kvgate.epp.scraper import MAPPINGS

        self.scraper = MetricsScraper(
            self.datastore,
            s.metric_mapping or MAPPINGS["vllm"],
            s.refresh_metrics_interval,
            api_key=s.engine_api_key,  # engines may require it on /metrics
        )
        self.kv = KVEventSubscribers(self.datastore)
        loop = asyncio.get_running_loop()
        if s.pool_name:
            from kvgate.epp.k8s import PoolWatcher

            watcher = PoolWatcher(
                self.datastore,
                s.pool_name,
                s.pool_namespace,
                s.kv_events_port,
                s.kv_replay_port,
                api_server=s.kube_api_server,
            )
            self._tasks.append(loop.create_task(watcher.run(), name="pool watch"))
        else:
            self.datastore.set_endpoints(s.endpoints)
        self._tasks.append(loop.create_task(self.health.watch(), name="health"))
        if self.tenants is not None and s.tenants_file:
            reloader = TenantsReloader(
                s.tenants_file,
                self.tenants,
                on_reload=lambda reg: self.metrics.fairness_label.configure(reg.tenants),
            )
            self._tasks.append(loop.create_task(reloader.run(), name="tenants reload"))
        log.info(
            "EPP serving",
            extra={
                "grpc_port": self.grpc_port,
                "grpc_health_port": self.health_port,
                "metrics_port": self.metrics_port,
                "profile": self.profile.name,
                "pd_threshold": self.director.pd.threshold if self.director.pd else None,
                "secure_serving": s.secure_serving,
                "grpc_server": s.grpc_server,
                "endpoints": len(self.datastore),
            },
        )

    async def stop(self) -> None:
        if self.flow is not None:
            await self.flow.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.health.shutdown()
        if self._extproc is not None:
            await self._extproc.stop(grace=1.0)
        for server in self._servers:
            await server.stop(grace=1.0)
        if self._health_server is not None:
            self._health_server.stop()
        if self.scraper:
            await self.scraper.close()
        if self.kv:
            await self.kv.close()
        if self._http is not None:
            self._http.shutdown()


async def until_signalled() -> None:
    """Returns at the first SIGTERM or SIGINT (a pod's stop, Ctrl-C)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def serve_forever(settings: ServerSettings) -> None:
    server = EppServer(settings)
    await server.start()
    await until_signalled()
    log.info("EPP stopping")
    await server.stop()
    server.tracer.shutdown()
