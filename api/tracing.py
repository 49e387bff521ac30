"""OpenTelemetry tracing for the engine and the EPP: W3C trace context in, OTLP/HTTP out.

Off unless an endpoint is given (`--otlp-endpoint URL`, or the standard
`OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`); then every process exports
its spans to it in batches, over OTLP/HTTP or OTLP/gRPC (`OTEL_EXPORTER_OTLP_PROTOCOL`, else
gRPC for port 4317), named by `OTEL_SERVICE_NAME` (default: the component's name) and
sampled as `OTEL_TRACES_SAMPLER` / `_ARG` say (default: parent-based, always on). When off,
nothing of OpenTelemetry is imported and a traced call costs one `None` check: `Tracer.span`
returns a shared no-op span.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"


class _NoSpan:
    """What a span is when tracing is off."""

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        pass

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        pass

    def end(self) -> None:
        pass

    def traceparent(self) -> str | None:
        return None


NO_SPAN = _NoSpan()


class _Span:
    def __init__(self, span: Any) -> None:
        self._span = span

    def set_attribute(self, key: str, value: Any) -> None:
        self._span.set_attribute(key, value)

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self._span.set_attributes(dict(attributes))

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        self._span.add_event(name, dict(attributes or {}))

    def end(self) -> None:
        self._span.end()

    def traceparent(self) -> str | None:
        """This span as a W3C traceparent, for a request it sends on."""
        ctx = self._span.get_span_context()
        if not ctx.is_valid:
            return None
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


Span = _Span | _NoSpan


def endpoint_from_env(explicit: str | None = None) -> str | None:
    """Where spans go: the flag, else the standard variables; None: tracing off."""
    if explicit:
        return explicit
    traces = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if traces:
        return traces
    base = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if base:
        return base if protocol(base) == "grpc" else base.rstrip("/") + "/v1/traces"
    return None


def _traces_url(endpoint: str) -> str:
    # `--otlp-endpoint http://collector:4318` means the collector; its OTLP/HTTP path is /v1/traces
    return endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"


def protocol(endpoint: str) -> str:
    """`grpc` or `http/protobuf`: OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL, else by the port (4317 is
    OTLP/gRPC's, 4318 OTLP/HTTP's), else HTTP."""
    chosen = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL"
    )
    if chosen:
        return "grpc" if chosen.strip().lower() == "grpc" else "http/protobuf"
    try:
        port = urlsplit(endpoint).port
    except ValueError:  # a malformed variable: the exporter reports it when it sends
        port = None
    return "grpc" if port == 4317 else "http/protobuf"


def _exporter(endpoint: str) -> Any:
    if protocol(endpoint) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        parts = urlsplit(endpoint)
        # gRPC takes host:port; http:// means no TLS
        return GrpcExporter(endpoint=parts.netloc or endpoint, insecure=parts.scheme != "https")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=_traces_url(endpoint))


class Tracer:
    """One per process. `Tracer(None)` is off and imports nothing."""

    def __init__(self, endpoint: str | None, service_name: str) -> None:
        self.enabled = endpoint is not None
        self._tracer: Any = None
        self._provider: Any = None
        self._propagator: Any = None
        if endpoint is None:
            return
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        name = os.environ.get("OTEL_SERVICE_NAME") or service_name
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": name})  # sampler: OTEL_TRACES_SAMPLER(_ARG)
        )
        self._provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint), schedule_delay_millis=500))
        self._tracer = self._provider.get_tracer("kvgate")
        self._propagator = TraceContextTextMapPropagator()

    def start(
        self, name: str, headers: Mapping[str, str], attributes: Mapping[str, Any] | None = None
    ) -> Span:
        """A span, child of the request's `traceparent` (a new trace when it has none)."""
        if self._tracer is None:
            return NO_SPAN
        carrier = {k: v for k, v in headers.items() if k.lower() in (TRACEPARENT, TRACESTATE)}
        parent = self._propagator.extract(carrier={k.lower(): v for k, v in carrier.items()})
        span = self._tracer.start_span(name, context=parent, attributes=dict(attributes or {}))
        return _Span(span)

    @contextlib.contextmanager
    def span(
        self, name: str, headers: Mapping[str, str], attributes: Mapping[str, Any] | None = None
    ) -> Iterator[Span]:
        s = self.start(name, headers, attributes)
        try:
            yield s
        finally:
            s.end()

    def shutdown(self) -> None:
        """Flush what is buffered (at process exit)."""
        if self._provider is not None:
            self._provider.shutdown()
