"""Tracing off (no --otlp-endpoint, no OTEL_EXPORTER_OTLP_* variables) costs nothing: no
OpenTelemetry module is imported by the engine's or the EPP's server, and a traced call is a
shared no-op span."""

from __future__ import annotations

import os
import subprocess
import sys

CHECK = """
import sys
import kvgate.engine.server.app, kvgate.engine.server.launcher, kvgate.epp.server, kvgate.epp.extproc
from kvgate.api.tracing import NO_SPAN, Tracer, endpoint_from_env
assert endpoint_from_env(None) is None
t = Tracer(endpoint_from_env(None), "kvgate-test")
span = t.start("x", {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"})
assert span is NO_SPAN and span.traceparent() is None and not t.enabled
span.set_attribute("a", 1); span.add_event("e"); span.end(); t.shutdown()
loaded = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
assert not loaded, loaded
"""


def test_tracing_off_imports_no_opentelemetry() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-P", "-c", CHECK], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-3000:]


def test_endpoint_from_the_standard_variables(monkeypatch) -> None:
    from kvgate.api.tracing import endpoint_from_env

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/")
    assert endpoint_from_env(None) == "http://collector:4318/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4318/v1/traces")
    assert endpoint_from_env(None) == "http://traces:4318/v1/traces"
    assert endpoint_from_env("http://flag:4318") == "http://flag:4318"  # the flag wins


def test_spans_reach_an_otlp_grpc_collector(monkeypatch) -> None:
    """OTEL_EXPORTER_OTLP_PROTOCOL=grpc exports over OTLP/gRPC (a real gRPC collector)."""
    from kvgate.api.tracing import Tracer, protocol
    from kvgate.testing.otlp import otlp_grpc_collector

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    with otlp_grpc_collector() as collector:
        assert protocol(collector.url) == "grpc"
        tracer = Tracer(collector.url, "kvgate-test")
        parent = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
        with tracer.span("kvgate.test", {"traceparent": parent}, {"k": 1}) as span:
            span.add_event("e")
        tracer.shutdown()  # flushes
        (got,) = collector.trace("ab" * 16)
        assert got.service == "kvgate-test" and got.parent_span_id == "cd" * 8
        assert got.attributes == {"k": 1} and got.events == ("e",)


def test_protocol_by_variable_then_port(monkeypatch) -> None:
    from kvgate.api.tracing import protocol

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    assert protocol("http://c:4317") == "grpc"
    assert protocol("http://c:4318") == "http/protobuf"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    assert protocol("http://c:4317") == "http/protobuf"


def test_a_malformed_collector_url_is_a_usage_error_not_a_traceback() -> None:
    import argparse

    import pytest

    from kvgate.api.cli_args import otlp_url
    from kvgate.api.tracing import protocol
    from kvgate.testing.processes import run_kvgate

    assert otlp_url("http://127.0.0.1:4318") == "http://127.0.0.1:4318"
    for bad in ("http://x:abc", "http://x:99999", "127.0.0.1:4318", "ftp://x", "http://"):
        with pytest.raises(argparse.ArgumentTypeError):
            otlp_url(bad)
    assert protocol("http://x:abc") == "http/protobuf"  # a malformed variable never crashes start-up
    for command in (
        ["engine", "serve", "--simulate"],
        ["epp", "serve", "--endpoints", "127.0.0.1:1"],
        ["up"],
    ):
        out = run_kvgate(*command, "--otlp-endpoint", "http://x:abc")
        assert out.returncode == 2, out.stderr
        assert "--otlp-endpoint: expected http(s)://host[:port]" in out.stderr
        assert "Traceback" not in out.stderr
