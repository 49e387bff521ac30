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
