"""Moved: the process harness is `kvgate.testing.processes` (tests import it from there).

This module stays only for bench/epp_agreement.py, bench/epp_latency.py and bench/attacks.py,
which put e2e/ on sys.path and `import harness`; delete it once they import
`kvgate.testing.processes` themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvgate.testing.polling import eventually
from kvgate.testing.processes import (
    KVGATE,
    Engine,
    Envoy,
    Epp,
    Process,
    free_port,
    free_ports,
    gateway_stack,
    rss_kib,
    slowloris_close_time,
    start_engine,
    start_envoy,
    start_epp,
    stop_all,
)

__all__ = [
    "KVGATE",
    "Engine",
    "Envoy",
    "Epp",
    "Process",
    "free_port",
    "free_ports",
    "gateway_stack",
    "rss_kib",
    "slowloris_close_time",
    "start_engine",
    "start_envoy",
    "start_epp",
    "stop_all",
    "wait_until",
]


def wait_until(
    check: Callable[[], Any], timeout: float, what: str, proc: Process | None = None, interval: float = 0.05
) -> Any:
    """The old name of `kvgate.testing.eventually`."""
    return eventually(check, timeout, what, interval=interval, watch=[proc] if proc is not None else ())
