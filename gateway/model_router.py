"""The model router: one gateway, many pools. An Envoy ext_proc stage in front of the pools'
endpoint pickers that reads the request body's ``model`` and names the pool serving it
(GIE's body-based router, llm-d's payload processor).

Per request it holds the body (FULL_DUPLEX_STREAMED, like the EPP), parses ``model`` and answers
Envoy with ``x-gateway-model-name: <model>`` (GIE's header, for HTTPRoutes that match on the
model) and ``x-kvgate-pool: <pool>`` (the local gateway's routes match on it) with
``clear_route_cache``, then hands the body back unchanged. The pool's own EPP runs next and
picks an engine. A model no pool serves is a 404 from here, OpenAI-shaped, and never reaches a
pool. ``GET /v1/models`` is answered here too: every model and adapter of every pool.

Which pool serves which model comes from the pools' engines: their ``GET /v1/models`` (served
names, aliases and LoRA adapters, including adapters loaded at run time), polled in the
background; a pool's own name always routes to it, so a pool is reachable before its engines
first answer. A model the table lacks is not refused from a stale table: the router asks the
pools again first (one refresh that started after the request came, shared by every request
waiting, at most every ``MISS_REFRESH_GAP_S``), so an adapter is routed from the moment its
``POST /v1/load_lora_adapter`` answered, and a flood of made-up names costs a few GETs per second.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2

from kvgate.api.contracts import model_routing
from kvgate.epp.extproc import (
    DEFAULT_MAX_BODY_BYTES,
    INLINE_BODY_BYTES,
    _header,
    body_too_large,
    immediate,
    streamed_request_body,
    unauthorized,
)
from kvgate.epp.http_get import KeepAliveGetter, ScrapeError, get_request
from kvgate.epp.request import BadRequest, parse_body
from kvgate.epp.tenants import TenantRegistry, TenantsReloader, load_tenants

log = logging.getLogger("kvgate.gateway.model_router")

# Envoy's header mutations take lower-case names
MODEL_NAME_HEADER = model_routing.MODEL_NAME_HEADER.lower()
POOL_HEADER = model_routing.POOL_HEADER
MODELS_PATH = "/v1/models"
# A request for a model the table lacks asks the pools again before its 404, but a refresh for
# a miss starts at most this long after the previous one: made-up names cost at most 5 GETs
# per engine per second, and each such 404 waits up to this long (plus the GETs).
MISS_REFRESH_GAP_S = 0.2
MAX_ENGINE_KEY = 4096  # characters: a longer file is not a key (a mount gone wrong)


@dataclass(frozen=True)
class PoolSource:
    """A pool and where its model list can be read (its engines' host:port)."""

    name: str
    engines: tuple[str, ...]


@dataclass
class _Known:
    card: dict[str, Any]  # the model's /v1/models entry, as an engine reported it
    pool: str


class ModelTable:
    """Model name → pool, and the aggregated model list, from the pools' engines."""

    def __init__(
        self,
        pools: Iterable[PoolSource],
        api_key: str | None = None,
        timeout: float = 2.0,
        miss_gap: float = MISS_REFRESH_GAP_S,
        engine_keys: Path | None = None,
    ) -> None:
        self.pools = list(pools)
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be unique, got {', '.join(names)}")
        self._getters: dict[tuple[str, str], KeepAliveGetter] = {}
        self._api_key = api_key
        # A folder of per-pool engine keys, one file named after each pool (a projected volume of
        # the operator's <pool>-engine-key Secrets): read at every poll, so a key made or rotated
        # after the router started is used from the next refresh on.
        self._engine_keys = engine_keys
        self._timeout = timeout
        # per (pool, engine): its last good answer; an engine that stops answering keeps its
        # models until it answers differently (a pool does not vanish on one missed poll)
        self._answers: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self._models: dict[str, _Known] = {}
        self._conflicts: set[str] = set()
        self._miss_gap = miss_gap
        # One refresh at a time (the kept-alive getters carry one request each), shared by
        # every caller. _polled_at: when the current or last one began asking (None while a
        # refresh for a miss waits out the gap: anyone who joins then is still answered by it).
        self._refreshing: asyncio.Task[None] | None = None
        self._polled_at: float | None = None
        self._last_polled = -float("inf")
        self.refreshes = 0  # refreshes begun (the tests count them)
        self._rebuild()

    # -- lookup ------------------------------------------------------------------------------
    def pool_for(self, model: str) -> str | None:
        known = self._models.get(model)
        return known.pool if known else None

    def cards(self) -> list[dict[str, Any]]:
        return [k.card for k in self._models.values()]

    def card(self, model: str) -> dict[str, Any] | None:
        known = self._models.get(model)
        return known.card if known else None

    # -- discovery ---------------------------------------------------------------------------
    def engine_key(self, pool: str) -> str | None:
        """The key this pool's engines require: its file in the engine-keys folder, else the one
        key given for every pool (KVGATE_API_KEY), else none."""
        if self._engine_keys is not None and pool and "/" not in pool and not pool.startswith("."):
            try:
                key = (self._engine_keys / pool).read_text(errors="replace").strip()
            except OSError:
                key = ""
            if key and len(key) <= MAX_ENGINE_KEY and key.isprintable():
                return key
        return self._api_key

    async def refresh(self, newer_than: float | None = None) -> None:
        """Ask every pool's engines for their models (joining a refresh already under way).
        With ``newer_than`` (a ``time.monotonic()`` instant, a request's arrival): only a
        refresh that began asking after it will do, begun no sooner than the miss gap after the
        last one. Each GET is bounded by the table's timeout."""
        while True:
            task = self._refreshing
            if task is None or task.done():
                if newer_than is not None and self._last_polled >= newer_than:
                    return  # one began after the request and has finished
                delay = 0.0
                if newer_than is not None:
                    delay = max(0.0, self._last_polled + self._miss_gap - time.monotonic())
                self._polled_at = None
                task = self._refreshing = asyncio.get_running_loop().create_task(
                    self._refresh_after(delay), name="model table refresh"
                )
                await asyncio.shield(task)  # a caller that goes away never cancels it for the rest
                return
            started = self._polled_at
            await asyncio.shield(task)
            if newer_than is None or started is None or started >= newer_than:
                return
            # that one began asking before the request came: wait for the next

    async def _refresh_after(self, delay: float) -> None:
        if delay > 0:
            await asyncio.sleep(delay)
        self._polled_at = self._last_polled = time.monotonic()
        self.refreshes += 1
        await asyncio.gather(
            *(self._poll(pool.name, engine) for pool in self.pools for engine in pool.engines)
        )
        self._rebuild()

    async def _poll(self, pool: str, engine: str) -> None:
        getter = self._getters.get((pool, engine))
        if getter is None:
            host, _, port = engine.rpartition(":")
            getter = KeepAliveGetter(host.strip("[]"), int(port), MODELS_PATH, timeout=self._timeout)
            self._getters[(pool, engine)] = getter
        try:
            # the engines may require their API key on /v1/models
            status, body = await getter.request(
                get_request(getter.host, getter.port, MODELS_PATH, self.engine_key(pool))
            )
            if status != 200:
                return
            data = json.loads(body)["data"]
            cards = [d for d in data if isinstance(d, dict) and isinstance(d.get("id"), str)]
        except (ScrapeError, ValueError, KeyError, TypeError):
            return
        self._answers[(pool, engine)] = cards

    def _rebuild(self) -> None:
        models: dict[str, _Known] = {}
        for pool in self.pools:  # declared order: on a name two pools serve, the first wins
            cards = [c for (p, _), answer in self._answers.items() if p == pool.name for c in answer]
            if not any(c["id"] == pool.name for c in cards):
                cards.insert(0, _placeholder(pool.name))
            for card in cards:
                name = card["id"]
                held = models.get(name)
                if held is None:
                    models[name] = _Known(card, pool.name)
                elif held.pool != pool.name and name not in self._conflicts:
                    self._conflicts.add(name)
                    log.warning("model %r is served by pools %s and %s; routing it to %s",
                                name, held.pool, pool.name, held.pool)  # fmt: skip
        self._models = models

    async def close(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
            await asyncio.gather(self._refreshing, return_exceptions=True)
        for getter in self._getters.values():
            getter.close()


def _placeholder(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "kvgate"}


def not_found(model: str) -> ep.ProcessingResponse:
    """vLLM's answer to an unknown model, from the gateway."""
    return immediate(
        404,
        f"The model `{model}` does not exist.",
        error_type="NotFoundError",
        param="model",
        code=404,
    )


def _json_reply(status: int, payload: dict[str, Any]) -> ep.ProcessingResponse:
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=ep.HeaderMutation(set_headers=[_header("content-type", "application/json")]),
            body=json.dumps(payload).encode(),
            details="kvgate_model_router",
        )
    )


@dataclass
class _Exchange:
    method: str = ""
    path: str = ""
    body: bytearray = field(default_factory=bytearray)
    done: bool = False
    arrived: float = field(default_factory=time.monotonic)  # a table refresh older than this is stale for it


class ModelRouterHandler:
    """The protocol logic, callable without gRPC."""

    def __init__(
        self,
        table: ModelTable,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        tenants: TenantRegistry | None = None,
    ) -> None:
        self.table = table
        self.max_body_bytes = max_body_bytes
        # With tenants (the pools' EPPs check the same keys), a request without a tenant's key
        # is refused here, before its body is read; the model list answered here needs one too.
        self.tenants = tenants

    def on_request_headers(self, x: _Exchange, msg: ep.HttpHeaders) -> list[ep.ProcessingResponse]:
        authorization = ""
        for h in msg.headers.headers:
            value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
            if h.key == ":method":
                x.method = value
            elif h.key == ":path":
                x.path = value.split("?", 1)[0]
            elif h.key == "authorization":
                authorization = value
        if self.tenants is not None and self.tenants.authenticate(authorization) is None:
            x.done = True
            return [unauthorized(authorization)]
        if x.method == "GET" and (x.path == MODELS_PATH or x.path.startswith(MODELS_PATH + "/")):
            return [self._models_reply(x.path)]
        if msg.end_of_stream:
            # Nothing to route on: no pool, so the gateway answers 404. A pool header the client
            # sent (a loopback or in-cluster client is "internal" to Envoy, which keeps it) goes.
            x.done = True
            unnamed = ep.HeaderMutation(remove_headers=[POOL_HEADER, MODEL_NAME_HEADER])
            return [
                ep.ProcessingResponse(
                    request_headers=ep.HeadersResponse(
                        response=ep.CommonResponse(header_mutation=unnamed, clear_route_cache=True)
                    )
                )
            ]
        return []

    def _models_reply(self, path: str) -> ep.ProcessingResponse:
        if path == MODELS_PATH:
            return _json_reply(200, {"object": "list", "data": self.table.cards()})
        model = unquote(path[len(MODELS_PATH) + 1 :])
        card = self.table.card(model)
        return _json_reply(200, card) if card is not None else not_found(model)

    def on_request_body(self, x: _Exchange, msg: ep.HttpBody) -> list[ep.ProcessingResponse]:
        if len(x.body) + len(msg.body) > self.max_body_bytes:
            return [body_too_large(self.max_body_bytes)]
        x.body += msg.body
        return []

    def parse(self, x: _Exchange) -> str | ep.ProcessingResponse:
        """The whole body is here: its model, or the 400 that refuses it."""
        x.done = True
        try:
            model: str = parse_body(bytes(x.body))["model"]
        except BadRequest as exc:
            return immediate(400, str(exc), param=exc.param, code=exc.code)
        return model

    def route(self, x: _Exchange, model: str) -> list[ep.ProcessingResponse]:
        """Name the pool serving the model, or refuse it."""
        pool = self.table.pool_for(model)
        if pool is None:
            log.info("model %r: no pool serves it (404)", model[:200])
            return [not_found(model)]
        headers = [
            _header(MODEL_NAME_HEADER, model),
            _header(POOL_HEADER, pool),
            _header("content-length", str(len(x.body))),
        ]
        return [
            ep.ProcessingResponse(
                request_headers=ep.HeadersResponse(
                    response=ep.CommonResponse(
                        header_mutation=ep.HeaderMutation(set_headers=headers), clear_route_cache=True
                    )
                )
            ),
            *streamed_request_body(bytes(x.body)),
        ]

    async def handle(self, x: _Exchange, msg: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            out = self.on_request_headers(x, msg.request_headers)
            if out and x.path.startswith(MODELS_PATH + "/") and out[0].immediate_response.status.code == 404:
                await self.table.refresh(newer_than=x.arrived)  # an adapter loaded just now?
                out = self.on_request_headers(x, msg.request_headers)
            return out
        if x.done:  # trailers or stray messages after the answer: acknowledge
            return (
                [ep.ProcessingResponse(request_trailers=ep.TrailersResponse())]
                if kind == "request_trailers"
                else []
            )
        if kind == "request_body":
            if refused := self.on_request_body(x, msg.request_body):
                return refused
            if not msg.request_body.end_of_stream:
                return []
        elif kind != "request_trailers":
            return []
        # end of the body (its last chunk, or trailers): large bodies are parsed off the loop
        model = await asyncio.to_thread(self.parse, x) if len(x.body) > INLINE_BODY_BYTES else self.parse(x)
        if isinstance(model, ep.ProcessingResponse):
            return [model]
        if self.table.pool_for(model) is None:
            # not a 404 from a table older than the request: an adapter whose load answered
            # just before it would be refused until the next poll
            await self.table.refresh(newer_than=x.arrived)
        out = self.route(x, model)
        if kind == "request_trailers" and not out[0].HasField("immediate_response"):
            out.append(ep.ProcessingResponse(request_trailers=ep.TrailersResponse()))
        return out


class ModelRouterServicer(ep_grpc.ExternalProcessorServicer):
    def __init__(self, handler: ModelRouterHandler) -> None:
        self.handler = handler

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> None:
        x = _Exchange()
        eof = grpc.aio.EOF
        while True:
            msg = await context.read()
            if msg is eof:
                return
            try:
                responses = await self.handler.handle(x, msg)
            except Exception:
                log.exception("model router failed on a request")
                await context.write(immediate(500, "internal error in the model router"))
                return
            for resp in responses:
                await context.write(resp)
            if responses and responses[0].HasField("immediate_response"):
                return


@dataclass
class RouterSettings:
    pools: list[PoolSource]
    bind_host: str = "127.0.0.1"
    grpc_port: int = 9004
    grpc_health_port: int = 9005
    refresh_interval: float = 2.0
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_key: str | None = None  # the engines' API key, if their /v1/models requires it
    engine_keys: Path | None = None  # per-pool engine keys, a file per pool (ModelTable)
    tenants_file: str | None = None  # the pools' tenants: every request needs one's API key


class ModelRouterServer:
    """The ext_proc server (with gRPC health on its port, for Envoy's health checks) and a health
    port of its own; SERVING once every pool's engines have been asked for their models once."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.table = ModelTable(settings.pools, api_key=settings.api_key, engine_keys=settings.engine_keys)
        tenants = load_tenants(settings.tenants_file) if settings.tenants_file else None
        self.handler = ModelRouterHandler(self.table, settings.max_request_body_bytes, tenants)
        # keys rotate without a restart, as in the EPP
        self.reloader = (
            TenantsReloader(settings.tenants_file, tenants) if tenants and settings.tenants_file else None
        )
        self.grpc_port = settings.grpc_port
        self.health_port = settings.grpc_health_port
        self._servers: list[grpc.aio.Server] = []
        self._task: asyncio.Task[None] | None = None
        self._reload_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        from grpc_health.v1._async import HealthServicer

        s = self.settings
        self.health = HealthServicer()
        ext = grpc.aio.server(options=[("grpc.max_concurrent_streams", 100_000), ("grpc.so_reuseport", 0)])
        ep_grpc.add_ExternalProcessorServicer_to_server(ModelRouterServicer(self.handler), ext)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, ext)
        self.grpc_port = ext.add_insecure_port(f"{s.bind_host}:{s.grpc_port}")
        side = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, side)
        self.health_port = side.add_insecure_port(f"{s.bind_host}:{s.grpc_health_port}")
        await ext.start()
        await side.start()
        self._servers = [ext, side]
        await self.table.refresh()
        for service in ("", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        self._task = asyncio.get_running_loop().create_task(self._refresh(), name="model table")
        if self.reloader is not None:
            self._reload_task = asyncio.get_running_loop().create_task(
                self.reloader.run(), name="tenants reload"
            )
        log.info(
            "model router serving %d pool(s): %s",
            len(s.pools),
            ", ".join(f"{p.name} ({len(p.engines)} engine(s))" for p in s.pools),
            extra={"grpc_port": self.grpc_port, "grpc_health_port": self.health_port},
        )

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(self.settings.refresh_interval)
            await self.table.refresh()

    async def stop(self) -> None:
        for task in (self._task, self._reload_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.health.enter_graceful_shutdown()
        for server in self._servers:
            await server.stop(grace=1.0)
        await self.table.close()


async def serve_forever(settings: RouterSettings) -> None:
    from kvgate.epp.server import until_signalled

    server = ModelRouterServer(settings)
    await server.start()
    await until_signalled()
    log.info("model router stopping")
    await server.stop()
