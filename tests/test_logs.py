"""One logging set-up for every server (kvgate.api.logs): `--log-format text|json`, `--quiet`,
libraries kept at warnings — checked on the helper and on real engine and EPP processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.testing import eventually
from kvgate.testing.processes import start_engine, start_epp, stop_all

EMIT = """
import logging, sys
from kvgate.api import logs
logs.configure(sys.argv[1], sys.argv[2], sys.argv[3] == "quiet")
logging.getLogger("kvgate.engine").info("engine says hello")
logging.getLogger("kvgate.epp").warning("picker warns")
logging.getLogger("grpc").info("library chatter")
logging.getLogger("grpc").warning("library warning")
"""


def _emit(level: str, fmt: str, quiet: bool = False) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-P", "-c", EMIT, level, fmt, "quiet" if quiet else "loud"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stderr.splitlines()


def test_text_lines() -> None:
    lines = _emit("info", "text")
    assert len(lines) == 3, lines
    assert lines[0].endswith("INFO kvgate.engine: engine says hello")
    assert lines[1].endswith("WARNING kvgate.epp: picker warns")
    assert lines[2].endswith("WARNING grpc: library warning")  # libraries: warnings only


def test_json_lines() -> None:
    records = [json.loads(line) for line in _emit("info", "json")]
    assert [(r["level"], r["logger"], r["msg"]) for r in records] == [
        ("info", "kvgate.engine", "engine says hello"),
        ("warning", "kvgate.epp", "picker warns"),
        ("warning", "grpc", "library warning"),
    ]


def test_quiet_keeps_warnings_and_errors_only() -> None:
    lines = _emit("debug", "text", quiet=True)
    assert [line.split(" ", 2)[2] for line in lines] == [
        "WARNING kvgate.epp: picker warns",
        "WARNING grpc: library warning",
    ]


def test_debug_lets_library_logs_through() -> None:
    assert any("library chatter" in line for line in _emit("debug", "text"))


@pytest.mark.timeout(60)
def test_engine_and_epp_processes_honour_the_flags(tmp_path: Path) -> None:
    engine = start_engine(tmp_path, "--log-format", "json")
    procs = [engine.proc]
    try:
        engine.wait_ready()
        epp = start_epp(tmp_path, [engine], "--log-format", "text")
        procs.append(epp.proc)
        epp.wait_ready()
        engine_lines = [line for line in engine.proc.log_path.read_text().splitlines() if line.strip()]
        serving = [json.loads(line) for line in engine_lines if line.startswith("{")]
        assert any(r["logger"] == "kvgate.engine" and "serving" in r["msg"] for r in serving), engine_lines
        assert all(line.startswith("{") for line in engine_lines), "every engine line is JSON"
        eventually(lambda: "EPP serving" in epp.proc.log_path.read_text(), 10, "the EPP's start-up line")
        epp_lines = [line for line in epp.proc.log_path.read_text().splitlines() if line.strip()]
        assert any(" INFO kvgate.epp: EPP serving" in line for line in epp_lines), epp_lines
        assert not any(line.startswith("{") for line in epp_lines)
    finally:
        stop_all(*procs)
