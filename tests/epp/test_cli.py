"""`kvgate epp serve`: flags, clear one-line errors (exit 2, no traceback)."""

from __future__ import annotations

import subprocess

import pytest

from kvgate.cli import build_parser
from kvgate.testing.processes import run_kvgate


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return run_kvgate("epp", "serve", *args)


def test_gie_flag_names_and_defaults() -> None:
    args = build_parser().parse_args(["epp", "serve", "--endpoints", "127.0.0.1:8000"])
    assert (args.grpc_port, args.grpc_health_port, args.metrics_port) == (9002, 9003, 9090)
    assert args.secure_serving is True and args.refresh_metrics_interval == 0.05
    args = build_parser().parse_args(
        [
            "epp",
            "serve",
            "--pool-name",
            "p",
            "--secure-serving=false",
            "--refresh-metrics-interval",
            "100ms",
            "--objective",
            "batch=-1",
        ]
    )
    assert (
        args.secure_serving is False
        and args.refresh_metrics_interval == 0.1
        and args.objective == [("batch", -1)]
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "exactly one of --endpoints"),
        (["--endpoints", "nohost"], "is not ip:port"),
        (["--endpoints", "1.2.3.4:1", "--kv-events-endpoints", "tcp://a:1,tcp://b:2"], "one per endpoint"),
        (["--endpoints", "1.2.3.4:1", "--profile", "fastest"], "built-in profiles"),
        (["--endpoints", "1.2.3.4:1", "--config-file", "/nonexistent.yaml"], "cannot read --config-file"),
    ],
)
def test_bad_input_is_a_clear_error(args, message) -> None:
    out = run_cli(*args)
    assert out.returncode == 2
    assert message in out.stderr and "Traceback" not in out.stderr


def test_bad_flag_value() -> None:
    out = run_cli("--endpoints", "1.2.3.4:1", "--secure-serving=maybe")
    assert out.returncode == 2 and "expected true or false" in out.stderr


def test_port_in_use_is_a_clear_error() -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = run_cli("--endpoints", "127.0.0.1:1", "--profile", "random", "--grpc-port", str(port))
    assert out.returncode == 2
    assert "cannot serve" in out.stderr and "Traceback" not in out.stderr


def test_a_tokenizer_only_flow_control_wants_is_a_warning_when_it_cannot_load() -> None:
    """Flow control counts prompt tokens, so the EPP loads a tokenizer for it even when no scorer
    needs one. One that cannot be loaded then leaves flow control estimating (a warning, the
    EPP goes on: here to a busy port); where a scorer needs it, it is still an error."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        common = ("--endpoints", "127.0.0.1:1", "--tokenizer", "/nonexistent/tokenizer", "--grpc-port", port)
        out = run_cli(*common, "--profile", "default")
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert "warning: cannot load tokenizer '/nonexistent/tokenizer'" in out.stderr
        assert "estimates prompt tokens" in out.stderr and "cannot serve" in out.stderr
        out = run_cli(*common, "--profile", "default", "--no-flow-control")
        assert out.returncode == 2 and "tokenizer" not in out.stderr and "cannot serve" in out.stderr
        out = run_cli(*common, "--profile", "precise-prefix")
        assert out.returncode == 2 and "cannot load tokenizer" in out.stderr and "warning" not in out.stderr
