"""Envoy ext_proc (GIE endpoint-picker protocol) ↔ request control (kvgate.epp.requestcontrol:
tenancy, flow admission, the pick, usage accounting): the protocol handler, a thin translator.

Per HTTP request Envoy opens one gRPC stream and, with ``FULL_DUPLEX_STREAMED`` body modes,
forwards headers, body chunks, trailers, then the response's headers/chunks/trailers. The
request is held until its body is complete; then we answer, in order: the header response
(destination, content-length, ``clear_route_cache``) with ``envoy.lb`` dynamic metadata, and the
body re-streamed in ≤ 62,000-byte chunks. Response chunks pass straight back.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kvgate.api.contracts.admissions import PICKED_BY_HEADER, SERVICE_TOKENS_HEADER
from kvgate.api.contracts.disaggregation import PREFILLER_HEADER
from kvgate.api.contracts.queue_order import OVER_SHARE_HEADER, PRIORITY_HEADER
from kvgate.api.tracing import TRACEPARENT, Span, Tracer
from kvgate.epp.director import Decision, Director
from kvgate.epp.flow_control import FlowGate
from kvgate.epp.metrics import EppMetrics
from kvgate.epp.request import BadRequest, PromptPolicy, Tokenizer, parse_body
from kvgate.epp.requestcontrol import FAIRNESS_HEADER, MODEL_REWRITE_HEADER, Exchange, RequestControl
from kvgate.epp.tenants import DEFAULT_TENANT, TenantRegistry

log = logging.getLogger("kvgate.epp.extproc")

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_METADATA_NAMESPACE = "envoy.lb"
SUBSET_HINT_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_HINT_KEY = "x-gateway-destination-endpoint-subset"
# GIE: the gateway reports in the response phase's metadata which endpoint served the request;
# the conformance profile echoes it to the client in its test header
SERVED_ENDPOINT_KEY = "x-gateway-destination-endpoint-served"
SERVED_ENDPOINT_TEST_HEADER = "x-conformance-test-served-endpoint"
REQUEST_ID_HEADER = "x-request-id"
MAX_CHUNK = 62_000  # Envoy's ext_proc keeps streamed body messages under its 64 KiB gRPC frame
# A client's x-request-id is kept only when it looks like an id; anything else (8,000 forged
# characters, odd bytes) is replaced, so logs and echoes never carry it.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
# Bodies larger than this are parsed and tokenized in a worker thread: the event loop that
# serves every other request never waits for one large prompt.
INLINE_BODY_BYTES = 32_768
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024

_ERROR_TYPES = {
    400: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
    500: "internal_error",
}


def _header(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def unauthorized(authorization: str, request_id: str = "") -> ep.ProcessingResponse:
    """401 in OpenAI's shape for a request whose Authorization header names no tenant's key."""
    given = bool(authorization.strip().partition(" ")[2].strip())
    log.info("request %s answered 401: %s API key", request_id or "-", "wrong" if given else "no")
    resp = immediate(
        401,
        "Incorrect API key provided."
        if given
        else "You didn't provide an API key. Send it in an Authorization header (Authorization: Bearer YOUR_KEY).",
        "invalid_request_error",
        request_id,
        code="invalid_api_key",
    )
    resp.immediate_response.headers.set_headers.append(_header("www-authenticate", "Bearer"))
    return resp


def immediate(
    status: int,
    message: str,
    error_type: str | None = None,
    request_id: str = "",
    param: str | None = None,
    code: str | int | None = None,
    retry_after: int = 0,
) -> ep.ProcessingResponse:
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": error_type or _ERROR_TYPES.get(status, "error"),
                "param": param,
                "code": status if code is None else code,
            }
        }
    ).encode()
    headers = [_header("content-type", "application/json")]
    if request_id:
        headers.append(_header(REQUEST_ID_HEADER, request_id))
    if retry_after > 0:
        headers.append(_header("retry-after", str(retry_after)))
    return ep.ProcessingResponse(
        immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=ep.HeaderMutation(set_headers=headers),
            body=body,
            details=f"kvgate_epp_{status}",
        )
    )


def body_too_large(limit: int, request_id: str = "") -> ep.ProcessingResponse:
    """The 413 for a body that outgrew `limit` while it streamed in (chunked: no length said)."""
    return immediate(
        413, f"request body larger than {limit} bytes", request_id=request_id, code="body_too_large"
    )


def streamed_request_body(payload: bytes) -> list[ep.ProcessingResponse]:
    """A held request body handed back to Envoy (FULL_DUPLEX_STREAMED), in chunks that fit its
    gRPC frames; an empty body is one empty end-of-stream chunk."""
    n = len(payload)
    return [
        ep.ProcessingResponse(
            request_body=ep.BodyResponse(
                response=ep.CommonResponse(
                    body_mutation=ep.BodyMutation(
                        streamed_response=ep.StreamedBodyResponse(
                            body=payload[start : start + MAX_CHUNK], end_of_stream=start + MAX_CHUNK >= n
                        )
                    )
                )
            )
        )
        for start in range(0, max(n, 1), MAX_CHUNK)
    ]


class ModelRewriter:
    """Replaces ``"model":"<target>"`` with the client's name in a streamed body, even when the
    needle is split across chunks (the tail that could start a match is held back)."""

    def __init__(self, target: str, original: str) -> None:
        self.needles = [
            (json.dumps({"model": target})[1:-1].encode(), json.dumps({"model": original})[1:-1].encode()),
            (
                json.dumps({"model": target}, separators=(",", ":"))[1:-1].encode(),
                json.dumps({"model": original}, separators=(",", ":"))[1:-1].encode(),
            ),
        ]
        self._carry = b""

    def feed(self, chunk: bytes, end: bool) -> bytes:
        data = self._carry + chunk
        for needle, repl in self.needles:
            data = data.replace(needle, repl)
        if end:
            self._carry = b""
            return data
        keep = 0
        for needle, _ in self.needles:
            for n in range(min(len(needle) - 1, len(data)), 0, -1):
                if data.endswith(needle[:n]):
                    keep = max(keep, n)
                    break
        self._carry = data[len(data) - keep :] if keep else b""
        return data[: len(data) - keep] if keep else data


@dataclass
class _Exchange(Exchange):
    """One HTTP request/response pair: request control's state plus the protocol's own."""

    generated_id: bool = False
    body: bytearray = field(default_factory=bytearray)
    body_done: bool = False
    rewriter: ModelRewriter | None = None
    awaiting_route: bool = False  # complete, waiting for flow control to dispatch it


class EndpointPickerHandler:
    """The ext_proc protocol, callable without gRPC (tests drive it message by message); what
    it does with each request is request control's (kvgate.epp.requestcontrol)."""

    def __init__(
        self,
        director: Director,
        metrics: EppMetrics | None = None,
        tokenizer: Tokenizer | None = None,
        objectives: dict[str, int] | None = None,
        policy: PromptPolicy | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        tracer: Tracer | None = None,
        tenants: TenantRegistry | None = None,
        report_served_endpoint: bool = False,
        engine_api_key: str | None = None,
    ) -> None:
        self.control = RequestControl(director, metrics, tokenizer, objectives, policy, tracer, tenants)
        self.max_body_bytes = max_body_bytes
        # With tenants, what the engines get in the client's key's place (their --api-key)
        self.engine_api_key = engine_api_key
        # GIE's conformance EPP: the served endpoint (response metadata) as a response header
        self.report_served_endpoint = report_served_endpoint

    @property
    def director(self) -> Director:
        return self.control.director

    @property
    def metrics(self) -> EppMetrics | None:
        return self.control.metrics

    @property
    def tenants(self) -> TenantRegistry | None:
        return self.control.tenants

    @property
    def flow(self) -> FlowGate | None:
        """Flow control (kvgate.epp.flow_control); None: every request is picked as it completes."""
        return self.control.flow

    @flow.setter
    def flow(self, gate: FlowGate | None) -> None:
        self.control.flow = gate

    # -- request phase ----------------------------------------------------------------------
    def on_request_headers(
        self, x: _Exchange, msg: ep.HttpHeaders, metadata: base_pb2.Metadata
    ) -> list[ep.ProcessingResponse]:
        headers = x.headers
        for h in msg.headers.headers:
            headers[h.key] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        rid = headers.get(REQUEST_ID_HEADER)
        if not rid or not _REQUEST_ID.fullmatch(rid):
            rid = str(uuid.uuid4())
            x.generated_id = True
        x.request_id = rid
        if not self.control.authenticate(x):
            return [unauthorized(headers.get("authorization", ""), x.request_id)]
        if SUBSET_HINT_NAMESPACE in metadata.filter_metadata:
            hint = metadata.filter_metadata[SUBSET_HINT_NAMESPACE].fields.get(SUBSET_HINT_KEY)
            if hint is None:
                x.subset = []
            elif hint.HasField("list_value"):
                x.subset = [v.string_value for v in hint.list_value.values]
            else:
                x.subset = [s.strip() for s in hint.string_value.split(",") if s.strip()]
        if msg.end_of_stream:  # no body (e.g. GET /v1/models): pick right away
            x.body_done = True
            x.request = self.control.request(x, None)
            return self.route(x)
        return []

    def on_request_body(self, x: _Exchange, msg: ep.HttpBody) -> list[ep.ProcessingResponse]:
        if too_large := self.append_body(x, msg):
            return too_large
        if not msg.end_of_stream:
            return []
        x.body_done = True
        if refused := self.prepare(x):
            return refused
        return self.route(x)

    def append_body(self, x: _Exchange, msg: ep.HttpBody) -> list[ep.ProcessingResponse]:
        """Buffer a body chunk; refuse (413) as soon as the body outgrows the limit."""
        if len(x.body) + len(msg.body) > self.max_body_bytes:
            self.control.count_error(x, "", "", 413)
            return [body_too_large(self.max_body_bytes, x.request_id)]
        x.body += msg.body
        return []

    def prepare(self, x: _Exchange) -> list[ep.ProcessingResponse]:
        """Parse the body and tokenize its prompt (the costly part, safe in a worker thread);
        an immediate 400 for what no engine could serve, else [] and the route is next."""
        try:
            x.request = self.control.request(x, parse_body(bytes(x.body)))
            x.request.prepare()
        except BadRequest as exc:
            self.control.count_error(x, "", "", 400)
            log.info("request %s rejected: %s", x.request_id, exc)
            return [immediate(400, str(exc), request_id=x.request_id, param=exc.param, code=exc.code)]
        return []

    def on_request_trailers(self, x: _Exchange) -> list[ep.ProcessingResponse]:
        out: list[ep.ProcessingResponse] = []
        if not x.body_done:  # body ended with trailers instead of end_of_stream
            out = self.on_request_body(x, ep.HttpBody(body=b"", end_of_stream=True))
            if out and out[0].HasField("immediate_response"):
                return out
        out.append(ep.ProcessingResponse(request_trailers=ep.TrailersResponse()))
        return out

    def route(self, x: _Exchange) -> list[ep.ProcessingResponse]:
        """Pick an endpoint for the prepared request and answer Envoy. Under flow control the
        pick waits for a dispatch: this marks the exchange and `route_async` does it."""
        if self.control.held_back(x):
            x.awaiting_route = True
            return []
        span = self.control.begin(x, len(x.body))
        try:
            decision = self.control.pick(x)
        except Exception:
            return self._pick_failed(x, span)
        return self._answer(x, decision, span)

    async def route_async(self, x: _Exchange) -> list[ep.ProcessingResponse]:
        """`route`, waiting in flow control until the pool has room (or the request's 429/503)."""
        x.awaiting_route = False
        if self.flow is None:
            return self.route(x)
        span = self.control.begin(x, len(x.body))
        try:
            decision = await self.control.admit(x, span, len(x.body))
        except asyncio.CancelledError:
            span.end()
            raise
        except Exception:
            return self._pick_failed(x, span)
        return self._answer(x, decision, span)

    def _pick_failed(self, x: _Exchange, span: Span) -> list[ep.ProcessingResponse]:
        self.control.failed(x, span)
        return [
            immediate(500, "the endpoint picker failed to schedule this request", request_id=x.request_id)
        ]

    def _answer(self, x: _Exchange, decision: Decision, span: Span) -> list[ep.ProcessingResponse]:
        """Envoy's answer for a decision: the routed request, or the EPP's own error reply."""
        req = x.request
        assert req is not None
        body = req.body
        model = req.model
        rewrite = x.headers.get(MODEL_REWRITE_HEADER) or ""
        self.control.decided(x, decision, span)
        if not decision.routed:
            return [
                immediate(
                    decision.status,
                    decision.reason,
                    decision.error_type,
                    x.request_id,
                    retry_after=decision.retry_after,
                )
            ]
        payload = bytes(x.body)
        if body is not None and rewrite and rewrite != model:
            body["model"] = rewrite
            payload = json.dumps(body, separators=(",", ":")).encode()
            x.rewriter = ModelRewriter(rewrite, model)
        return self._forward(x, decision, payload, body is not None)

    def _forward(
        self, x: _Exchange, decision: Decision, payload: bytes, has_body: bool
    ) -> list[ep.ProcessingResponse]:
        set_headers = [
            _header(DESTINATION_HEADER, decision.targets[0]),
            # The engine announces the admission to every EPP replica (a client's own value is
            # overwritten): see kvgate.api.contracts.admissions.
            _header(PICKED_BY_HEADER, self.director.datastore.replica_id),
            # What the EPP decided the request's fairness id is (its tenant, with a tenants file),
            # never the client's own value: the engine sees what the EPP scheduled.
            _header(FAIRNESS_HEADER, (x.request.fairness_id if x.request else None) or DEFAULT_TENANT),
            # and its priority (GIE's: higher first), by which the engine orders its queue
            # (kvgate.api.contracts.queue_order); a client's own value is overwritten too
            _header(PRIORITY_HEADER, str(x.request.priority if x.request else 0)),
        ]
        remove_headers: list[str] = []
        if x.request is not None and x.request.over_share:
            set_headers.append(_header(OVER_SHARE_HEADER, "1"))
        elif OVER_SHARE_HEADER in x.headers:
            remove_headers.append(OVER_SHARE_HEADER)
        if has_body:
            set_headers.append(_header("content-length", str(len(payload))))
        if x.generated_id:
            set_headers.append(_header(REQUEST_ID_HEADER, x.request_id))
        if x.traceparent:
            set_headers.append(_header(TRACEPARENT, x.traceparent))
        if x.held is not None:  # the engine announces it: other replicas count the service too
            set_headers.append(_header(SERVICE_TOKENS_HEADER, f"{x.held.charged:.1f}"))
        # The prefill engine the decode engine pulls the prompt's KV from. A client's own value
        # never reaches the engine: it would make the engine call any address the client names.
        if decision.prefill:
            set_headers.append(_header(PREFILLER_HEADER, decision.prefill))
        elif PREFILLER_HEADER in x.headers:
            remove_headers.append(PREFILLER_HEADER)
        if self.tenants is not None:
            # The tenant's key was for the gateway: engines log and may forward headers, and a
            # key that reached one could be read back out of it. The engines' own key takes its
            # place: engines that require it serve nothing that skipped the picker.
            if self.engine_api_key:
                set_headers.append(_header("authorization", f"Bearer {self.engine_api_key}"))
            elif "authorization" in x.headers:
                remove_headers.append("authorization")
        lb = struct_pb2.Struct()
        lb.fields[DESTINATION_HEADER].string_value = ",".join(decision.targets)
        dyn = struct_pb2.Struct()
        dyn.fields[LB_METADATA_NAMESPACE].struct_value.CopyFrom(lb)
        out = [
            ep.ProcessingResponse(
                request_headers=ep.HeadersResponse(
                    response=ep.CommonResponse(
                        header_mutation=ep.HeaderMutation(
                            set_headers=set_headers, remove_headers=remove_headers
                        ),
                        clear_route_cache=True,
                    )
                ),
                dynamic_metadata=dyn,
            )
        ]
        if has_body:
            out += streamed_request_body(payload)
        return out

    # -- response phase ---------------------------------------------------------------------
    def on_response_headers(
        self, x: _Exchange, msg: ep.HttpHeaders, metadata: base_pb2.Metadata | None = None
    ) -> list[ep.ProcessingResponse]:
        # (in-flight counts become exact only with the response body: a gateway may send the
        # headers alone, as Envoy Gateway's does, and close the stream before the body ends)
        status = ""
        for h in msg.headers.headers:
            if h.key == ":status":
                status = h.raw_value.decode() if h.raw_value else h.value
                break
        self.control.response_status(x, status)
        mutation = ep.HeaderMutation()
        if x.rewriter is not None:
            mutation.remove_headers.append("content-length")  # the rewritten body may change length
        if self.report_served_endpoint:
            mutation.set_headers.append(_header(SERVED_ENDPOINT_TEST_HEADER, served_endpoint(metadata)))
        resp = ep.ProcessingResponse(
            response_headers=ep.HeadersResponse(response=ep.CommonResponse(header_mutation=mutation))
        )
        if msg.end_of_stream:
            self.finish(x)
        return [resp]

    def on_response_body(self, x: _Exchange, msg: ep.HttpBody) -> list[ep.ProcessingResponse]:
        chunk = msg.body
        self.control.response_chunk(x, chunk)
        if x.rewriter is not None:
            chunk = x.rewriter.feed(chunk, msg.end_of_stream)
        if msg.end_of_stream:
            self.finish(x)
        return [
            ep.ProcessingResponse(
                response_body=ep.BodyResponse(
                    response=ep.CommonResponse(
                        body_mutation=ep.BodyMutation(
                            streamed_response=ep.StreamedBodyResponse(
                                body=chunk, end_of_stream=msg.end_of_stream
                            )
                        )
                    )
                )
            )
        ]

    def on_response_trailers(self, x: _Exchange) -> list[ep.ProcessingResponse]:
        self.director.response_seen()  # the in-flight counts are exact from now on
        self.finish(x)
        return [ep.ProcessingResponse(response_trailers=ep.TrailersResponse())]

    def finish(self, x: _Exchange) -> None:
        """The exchange is over (normally or not): release the endpoint's in-flight slot once."""
        self.control.finish(x)

    async def finish_body_async(self, x: _Exchange, msg: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        """The last chunk of a large body: parse and tokenize it in a worker thread (the
        tokenizer releases the GIL there), then pick on the event loop as usual."""
        trailers = msg.WhichOneof("request") == "request_trailers"
        if not trailers:
            if too_large := self.append_body(x, msg.request_body):
                return too_large
        x.body_done = True
        if refused := await asyncio.to_thread(self.prepare, x):
            return refused
        out = await self.route_async(x)
        if trailers and not (out and out[0].HasField("immediate_response")):
            out.append(ep.ProcessingResponse(request_trailers=ep.TrailersResponse()))
        return out

    # -- one message ------------------------------------------------------------------------
    def handle(self, x: _Exchange, msg: ep.ProcessingRequest) -> list[ep.ProcessingResponse]:
        kind = msg.WhichOneof("request")
        if kind == "request_body":
            return self.on_request_body(x, msg.request_body)
        if kind == "response_body":
            return self.on_response_body(x, msg.response_body)
        if kind == "request_headers":
            return self.on_request_headers(x, msg.request_headers, msg.metadata_context)
        if kind == "response_headers":
            return self.on_response_headers(x, msg.response_headers, msg.metadata_context)
        if kind == "request_trailers":
            return self.on_request_trailers(x)
        if kind == "response_trailers":
            return self.on_response_trailers(x)
        return []


def _completes_large_body(handler: EndpointPickerHandler, x: _Exchange, msg: ep.ProcessingRequest) -> bool:
    kind = msg.WhichOneof("request")
    if kind == "request_body":
        return msg.request_body.end_of_stream and len(x.body) + len(msg.request_body.body) > INLINE_BODY_BYTES
    return kind == "request_trailers" and not x.body_done and len(x.body) > INLINE_BODY_BYTES


async def run_exchange(
    handler: EndpointPickerHandler,
    read: Callable[[], Awaitable[ep.ProcessingRequest | None]],
    write: Callable[[ep.ProcessingResponse], Awaitable[None]],
) -> None:
    """One ext_proc stream, whatever gRPC server carries it: ``read`` gives the next message
    (None at the end), ``write`` sends one answer."""
    x = _Exchange()
    try:
        while True:
            msg = await read()
            if msg is None:
                return
            try:
                if _completes_large_body(handler, x, msg):
                    responses = await handler.finish_body_async(x, msg)
                else:
                    responses = handler.handle(x, msg)
                    if x.awaiting_route:  # held by flow control until the pool has room
                        routed = await handler.route_async(x)
                        immediate_answer = routed and routed[0].HasField("immediate_response")
                        responses = routed if immediate_answer else routed + responses
            except Exception:
                log.exception("request %s: ext_proc handler failed", x.request_id)
                await write(immediate(500, "internal error in the endpoint picker", request_id=x.request_id))
                return
            for resp in responses:
                await write(resp)
            if responses and responses[0].HasField("immediate_response"):
                return
    finally:
        handler.finish(x)


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):
    """The ext_proc service on grpcio's asyncio server (``--grpc-server grpcio``)."""

    def __init__(self, handler: EndpointPickerHandler) -> None:
        self.handler = handler

    async def Process(
        self, request_iterator: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> None:
        # context.read()/write() rather than an async generator: no generator wrapper per message
        eof = grpc.aio.EOF

        async def read() -> ep.ProcessingRequest | None:
            msg = await context.read()
            return None if msg is eof else msg

        await run_exchange(self.handler, read, context.write)


def served_endpoint(metadata: base_pb2.Metadata | None) -> str:
    """What the gateway says served the request (GIE's envoy.lb metadata), or why it is unknown
    in the words GIE's conformance EPP uses."""
    lb = metadata.filter_metadata.get(LB_METADATA_NAMESPACE) if metadata is not None else None
    if lb is None:
        return "fail: missing envoy lb metadata"
    value = lb.fields.get(SERVED_ENDPOINT_KEY)
    if value is None or not value.HasField("string_value"):
        return "fail: missing destination endpoint served metadata"
    return value.string_value
