"""The Starlette app: routes, API-key check, draining, failure injection, OpenAI-shaped errors.

Plain Starlette (no FastAPI) keeps start-up and per-request overhead small: eight simulated
engines share two cores in tests. The OpenAPI document is generated from the same pydantic
request models the handlers validate with (see `openapi.py`).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvgate.api.contracts.admissions import Pick, pick_from_headers
from kvgate.api.contracts.disaggregation import PREFILLER_HEADER
from kvgate.api.contracts.queue_order import order_from_headers
from kvgate.api.tracing import NO_SPAN, Span, Tracer
from kvgate.engine.server.async_engine import AsyncEngine
from kvgate.engine.server.errors import APIError, bad_request, error_response
from kvgate.engine.server.kv_transfer_http import KVTransfer, valid_peer
from kvgate.engine.server.lora_admin import LoadLoRAAdapterRequest, LoRAAdmin, UnloadLoRAAdapterRequest
from kvgate.engine.server.metrics import CONTENT_TYPE, EngineMetrics
from kvgate.engine.server.pd_handoff import Handoff
from kvgate.engine.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_body,
)
from kvgate.engine.server.serving import INLINE_PROMPT_CHARS, OpenAIServing, StreamResult
from kvgate.engine.server.serving_chat import OpenAIServingChat
from kvgate.engine.server.serving_completion import OpenAIServingCompletion

log = logging.getLogger(__name__)

FAILURE_HEADER = "x-kvgate-inject-failure"
MAX_BODY_BYTES = 32 * 1024 * 1024
# x-request-id is echoed for log correlation only when it looks like an id: never reflect a
# forged 8,000-character header (or one with odd bytes) back to a client.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


@dataclass
class ServerState:
    serving: OpenAIServing
    engine: AsyncEngine
    metrics: EngineMetrics
    version: str
    api_key: str | None = None
    failure_injection: bool = False
    draining: bool = False  # shutting down: /health answers 503 (pickers stop routing here)
    refusing: bool = False  # past the drain grace period: new generation requests get 503
    max_body_bytes: int = MAX_BODY_BYTES
    body_read_timeout: float | None = 30.0  # seconds between body chunks; None: no limit
    body_total_timeout: float | None = 120.0  # seconds for a whole body (a trickle); None: no limit
    metrics_auth: bool = False  # /metrics requires the API key too
    tracer: Tracer = field(default_factory=lambda: Tracer(None, "kvgate-engine"))
    lora_admin: LoRAAdmin | None = None  # --enable-lora: the runtime load/unload endpoints
    kv_transfer: KVTransfer | None = None  # --kv-role: prefill/decode hand-offs
    extra: dict[str, Any] = field(default_factory=dict)


def _pick(request: Request) -> Pick | None:
    """The kvgate EPP replica that routed this request, when it asked for an admission
    announcement, with the tenant and the service it charged when it said them
    (kvgate.api.contracts.admissions); a malformed replica id asks for nothing."""
    return pick_from_headers(request.headers)


def _trace_result(request: Request, result: dict[str, Any]) -> None:
    """What a finished (non-streamed) generation says about itself, on its span."""
    span = getattr(request.state, "span", None)
    if span is None:
        return
    usage = result.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    span.set_attributes(
        {
            "gen_ai.response.id": str(result.get("id", "")),
            "gen_ai.usage.input_tokens": int(usage.get("prompt_tokens") or 0),
            "gen_ai.usage.output_tokens": int(usage.get("completion_tokens") or 0),
            "kvgate.prompt_tokens_cached": int(details.get("cached_tokens") or 0),
            "gen_ai.response.finish_reasons": [
                str(c.get("finish_reason")) for c in result.get("choices", [])
            ],
        }
    )


def _json(obj: Any, status: int = 200) -> Response:
    return Response(
        json.dumps(obj, ensure_ascii=False, separators=(",", ":")),
        status_code=status,
        media_type="application/json",
    )


class SSEResponse:
    """text/event-stream from an async iterator; a vanished client just ends the loop."""

    def __init__(self, body: AsyncGenerator[bytes, None], on_close: Callable[[], None]) -> None:
        self.body = body
        self.on_close = on_close
        self.extra_headers: list[tuple[bytes, bytes]] = []
        self.span: Span = NO_SPAN

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [
                        (b"content-type", b"text/event-stream; charset=utf-8"),
                        (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no"),
                        *self.extra_headers,
                    ],
                }
            )
            first = True
            async for chunk in self.body:
                if first:
                    self.span.add_event("first_chunk")  # the first token, for a stream
                    first = False
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # uvicorn raises ClientDisconnected (an OSError) on a send to a closed socket
            pass
        except Exception:  # a bug mid-stream: the status line is gone, so end with an error event
            log.exception("unhandled error while streaming")
            error = b'data: {"error": {"message": "Internal server error.", "type": "server_error", "param": null, "code": "internal_error"}}\n\n'
            try:
                await send({"type": "http.response.body", "body": error, "more_body": False})
            except OSError:
                pass
        finally:
            await self.body.aclose()
            self.on_close()
            self.span.end()


class BrokenResponse:
    """Failure injection: start a response and drop the connection mid-body."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", b"4096")],
            }
        )
        await send({"type": "http.response.body", "body": b'{"id": "inj', "more_body": True})
        # Returning without finishing makes uvicorn close the connection.


async def _inject_failure(value: str) -> Any:
    """Apply `x-kvgate-inject-failure`: comma-separated 500|503|429|delay=<s>|disconnect, in order."""
    for item in (v.strip() for v in value.split(",")):
        if not item:
            continue
        if item.startswith("delay="):
            try:
                seconds = float(item[6:])
            except ValueError:
                raise bad_request(f"bad {FAILURE_HEADER} delay: {item!r}") from None
            await asyncio.sleep(max(0.0, min(seconds, 600.0)))
        elif item in ("500", "503", "429"):
            status = int(item)
            headers = {"Retry-After": "1"} if status == 429 else None
            raise APIError(
                status, f"Injected failure ({status}) by {FAILURE_HEADER}.", code="injected", headers=headers
            )
        elif item == "disconnect":
            return BrokenResponse()
        else:
            raise bad_request(
                f"unknown {FAILURE_HEADER} value {item!r}; use 500|503|429|delay=<s>|disconnect"
            )
    return None


Handler = Callable[[Request], Awaitable[Any]]


def build_app(state: ServerState) -> Starlette:
    app = Starlette(
        routes=Handlers(state).routes(),
        exception_handlers={HTTPException: _http_error, Exception: _server_error},
    )
    app.state.kvgate = state
    app.state.started = time.time()
    return app


class Handlers:
    """The routes' handlers over one server's state, and the wrapper every route goes through
    (API key, draining, failure injection, tracing, OpenAI-shaped errors, per-route metrics)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.serving = state.serving
        self.engine = state.engine
        self.model = state.serving.model
        self.serving_completion = OpenAIServingCompletion(state.serving)
        self.serving_chat = OpenAIServingChat(state.serving)

    def routes(self) -> list[Route]:
        state = self.state

        def route(path: str, fn: Handler, methods: list[str], **kw: bool) -> Route:
            return Route(path, self.endpoint(fn, handler=path, **kw), methods=methods)

        routes = [
            route("/v1/completions", self.completions, ["POST"], auth=True, generation=True),
            route("/v1/chat/completions", self.chat, ["POST"], auth=True, generation=True),
            route("/v1/models", self.models, ["GET"], auth=True),
            route("/v1/models/{model_id:path}", self.retrieve_model, ["GET"], auth=True),
            route("/health", self.health, ["GET"]),
            route("/ping", self.health, ["GET", "POST"]),
            route("/version", self.version, ["GET"]),
            route("/tokenize", self.tokenize, ["POST"], auth=True),
            route("/detokenize", self.detokenize, ["POST"], auth=True),
            route("/metrics", self.metrics, ["GET"]),
            route("/openapi.json", self.openapi, ["GET"]),
        ]
        if state.lora_admin is not None:
            routes += [
                route("/v1/load_lora_adapter", self.load_lora_adapter, ["POST"], auth=True),
                route("/v1/unload_lora_adapter", self.unload_lora_adapter, ["POST"], auth=True),
            ]
        if state.kv_transfer is not None and state.kv_transfer.settings.produces:
            routes.append(
                Route(
                    "/v1/kv_transfer/{transfer_id}",
                    self.endpoint(self.kv_transfer_pull, auth=True, handler="/v1/kv_transfer"),
                    methods=["GET"],
                )
            )
        return routes

    # ---- what every route goes through ------------------------------------------------------
    def endpoint(
        self, fn: Handler, *, auth: bool = False, generation: bool = False, handler: str = ""
    ) -> Handler:
        """`fn` as a Starlette endpoint, through `dispatch`."""

        async def handle(request: Request) -> Any:
            return await self.dispatch(request, fn, auth, generation, handler)

        return handle

    async def dispatch(
        self, request: Request, fn: Handler, auth: bool, generation: bool, handler: str
    ) -> Any:
        state = self.state
        span: Span = NO_SPAN
        if generation and state.tracer.enabled:
            # a child of the caller's traceparent (the EPP's pick, through the gateway)
            span = state.tracer.start(
                "kvgate.engine.request",
                request.headers,
                {"http.route": handler, "kvgate.model": self.model.served_names[0]},
            )
            request.state.span = span
        try:
            if auth and state.api_key is not None:
                self.check_api_key(request)
            if generation:
                if state.refusing:
                    raise APIError(
                        503,
                        "The server is shutting down; send the request to another replica.",
                        code="draining",
                    )
                if state.failure_injection and FAILURE_HEADER in request.headers:
                    injected = await _inject_failure(request.headers[FAILURE_HEADER])
                    if injected is not None:
                        return injected  # a broken response carries no extra headers
            response = await fn(request)
        except APIError as exc:
            response = exc.response()
        except Exception:  # never a stack trace to the client; the log has it
            log.exception("unhandled error in %s %s", request.method, request.url.path)
            response = error_response(500, "Internal server error.", code="internal_error")
        if handler:
            state.metrics.note_http(handler, request.method, getattr(response, "status_code", 200))
        if span is not NO_SPAN:
            span.set_attribute("http.response.status_code", getattr(response, "status_code", 200))
            if isinstance(response, SSEResponse):
                response.span = span  # ends with the stream
            else:
                span.end()
        # Echo the gateway's request id so Envoy/EPP logs and ours line up.
        request_id = request.headers.get("x-request-id")
        if request_id and _REQUEST_ID.fullmatch(request_id):
            if isinstance(response, SSEResponse):
                response.extra_headers.append((b"x-request-id", request_id.encode("latin-1")))
            elif isinstance(response, Response):
                response.headers["x-request-id"] = request_id
        return response

    def check_api_key(self, request: Request) -> None:
        assert self.state.api_key is not None
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.state.api_key.encode()
        ):
            raise APIError(
                401, "Missing or invalid API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key"
            )

    async def read_body(self, request: Request) -> bytes:
        """The body, counted as it streams in (Content-Length can be absent or lie) and bounded
        in time between chunks, so neither a huge chunked upload nor a trickle holds memory."""
        state = self.state
        limit = state.max_body_bytes
        too_large = APIError(413, f"Request body larger than {limit} bytes.", code="body_too_large")
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > limit:
            raise too_large
        chunks: list[bytes] = []
        size = 0
        receive = request.receive
        loop = asyncio.get_running_loop()
        # a byte every few seconds passes the per-chunk limit: the whole body has a deadline too
        total = state.body_total_timeout
        deadline = loop.time() + total if total else None
        while True:
            wait = state.body_read_timeout
            if deadline is not None:
                left = max(0.0, deadline - loop.time())
                wait = left if wait is None else min(wait, left)
            try:
                message = await asyncio.wait_for(receive(), wait)
            except TimeoutError:
                raise APIError(
                    408,
                    "The request body was not received in time "
                    f"({state.body_read_timeout or 'no'} s between chunks, {total or 'no'} s in all).",
                    code="request_timeout",
                ) from None
            if message["type"] == "http.disconnect":
                raise APIError(
                    400, "The client disconnected while sending the body.", code="client_disconnected"
                )
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    # ---- the routes -------------------------------------------------------------------------
    async def completions(self, request: Request) -> Any:
        raw = await self.read_body(request)
        req = parse_body(CompletionRequest, raw)
        result = await self.serving_completion.completions(
            req,
            request.receive,
            _pick(request),
            _handoff(request, raw),
            order_from_headers(request.headers, req.priority),
            getattr(request.state, "span", NO_SPAN),
        )
        return _generation_response(request, result)

    async def chat(self, request: Request) -> Any:
        raw = await self.read_body(request)
        req = parse_body(ChatCompletionRequest, raw)
        result = await self.serving_chat.chat(
            req,
            request.receive,
            _pick(request),
            _handoff(request, raw),
            order_from_headers(request.headers, req.priority),
            getattr(request.state, "span", NO_SPAN),
        )
        return _generation_response(request, result)

    def model_card(self, name: str) -> dict[str, Any]:
        adapter = name in self.model.adapters  # vLLM: an adapter's root is its path, parent the base model
        return {
            "id": name,
            "object": "model",
            "created": self.model.created,
            "owned_by": "kvgate",
            "root": self.model.adapters[name] if adapter else self.model.root,
            "parent": self.model.name if adapter else None,
            "max_model_len": self.model.max_model_len,
            "permission": [],
        }

    async def models(self, request: Request) -> Response:
        return _json(
            {
                "object": "list",
                "data": [self.model_card(name) for name in [*self.model.served_names, *self.model.adapters]],
            }
        )

    async def retrieve_model(self, request: Request) -> Response:
        """OpenAI's GET /v1/models/{model}: one Model object, or 404 for a name not served here.
        Ids may hold slashes (`org/name`); clients send them raw or percent-encoded."""
        name = request.path_params["model_id"]
        if name not in self.model.served_names and name not in self.model.adapters:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")
        return _json(self.model_card(name))

    async def health(self, request: Request) -> Response:
        if not self.engine.alive:
            raise APIError(503, self.engine.dead_reason or "The engine is not running.", code="engine_dead")
        if self.state.draining:
            raise APIError(503, "The server is shutting down.", code="draining")
        return Response(b"", status_code=200)

    async def version(self, request: Request) -> Response:
        return _json({"version": self.state.version})

    async def metrics(self, request: Request) -> Response:
        if self.state.metrics_auth and self.state.api_key is not None:
            self.check_api_key(request)
        return Response(self.state.metrics.render(), media_type=CONTENT_TYPE)

    async def tokenize(self, request: Request) -> Response:
        req = parse_body(TokenizeRequest, await self.read_body(request))
        self.serving.check_model(req.model)
        if req.messages is not None:
            if not req.messages:
                raise bad_request("messages must not be empty.", "messages")
            ids = await self.serving.chat_prompt_ids(
                req.messages,
                req.add_generation_prompt,
                req.continue_final_message,
                req.chat_template_kwargs,
                req.chat_template,
                req.tools,
            )
        elif req.prompt is not None:
            # up to the body limit (32 MiB) of text: tokenize it off the event loop
            encode = self.serving.tokenizer.encode
            if len(req.prompt) > INLINE_PROMPT_CHARS:
                ids = await asyncio.to_thread(encode, req.prompt, add_special_tokens=req.add_special_tokens)
            else:
                ids = encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise bad_request("Send either 'prompt' or 'messages'.", "prompt")
        strs = self.serving.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return _json(
            {"count": len(ids), "max_model_len": self.model.max_model_len, "tokens": ids, "token_strs": strs}
        )

    async def detokenize(self, request: Request) -> Response:
        req = parse_body(DetokenizeRequest, await self.read_body(request))
        self.serving.check_model(req.model)
        self.serving.check_token_ids(req.tokens, "tokens")
        return _json({"prompt": self.serving.tokenizer.decode(req.tokens)})

    async def openapi(self, request: Request) -> Response:
        from kvgate.engine.server.openapi import openapi_document

        if "openapi" not in self.state.extra:
            self.state.extra["openapi"] = json.dumps(openapi_document(self.state.version))
        return Response(self.state.extra["openapi"], media_type="application/json")

    async def kv_transfer_pull(self, request: Request) -> Response:
        """A producer's pinned blocks, once (prefill/decode disaggregation; never public)."""
        assert self.state.kv_transfer is not None
        body = self.state.kv_transfer.take_pull(request.path_params["transfer_id"])
        if body is None:
            raise APIError(404, "No such KV transfer (pulled already, or expired).", code="not_found")
        return StreamingResponse(body(), media_type="application/octet-stream")

    async def load_lora_adapter(self, request: Request) -> Response:
        assert self.state.lora_admin is not None
        req = parse_body(LoadLoRAAdapterRequest, await self.read_body(request))
        return Response(await self.state.lora_admin.load(req), media_type="text/plain")

    async def unload_lora_adapter(self, request: Request) -> Response:
        assert self.state.lora_admin is not None
        req = parse_body(UnloadLoRAAdapterRequest, await self.read_body(request))
        return Response(await self.state.lora_admin.unload(req), media_type="text/plain")


def _handoff(request: Request, raw: bytes) -> Handoff:
    return Handoff(
        path=request.url.path,
        raw_body=raw,
        prefiller=valid_peer(request.headers.get(PREFILLER_HEADER)),
        authorization=request.headers.get("authorization"),
    )


def _generation_response(request: Request, result: dict[str, Any] | StreamResult) -> Any:
    """A completions or chat answer: a JSON body (traced), or the SSE stream."""
    if isinstance(result, dict):
        _trace_result(request, result)
        return _json(result)
    return SSEResponse(result.body, on_close=result.close)


async def _http_error(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    if status == 404:
        return error_response(404, f"No route {request.url.path}.", code="not_found")
    if status == 405:
        return error_response(405, f"Method {request.method} is not allowed on {request.url.path}.")
    return error_response(status, str(getattr(exc, "detail", "error")))


async def _server_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error in %s %s: %r", request.method, request.url.path, exc)
    return error_response(500, "Internal server error.", code="internal_error")
