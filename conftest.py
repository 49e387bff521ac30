"""How `make test` splits one run between pytest-xdist workers (`-n 2 --dist loadgroup`).

Most of the run waits on processes (engines, Envoy, the control plane), so two workers finish
it in far less time than one on two cores. What that must not break:
- every test file runs whole on one worker, so a module's stack starts once;
- the files whose processes bind fixed addresses or share a fixed path (the operator's pods on
  127.0.0.1:8000 and /var/tmp/kvgate-pod-staging, the control plane's pods on 127.10.0.0/16)
  run on one worker, one after another;
- the files that load the transformers oracle (a session fixture) share a worker, so it is
  loaded once;
- each worker plans its ports in its own range (KVGATE_PORT_RANGE, inherited by every process
  a test starts), so two workers never plan the same port.
Without xdist (plain `pytest`) none of this applies.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent

# Test files (relative to the repo) that must share one worker, by group name.
SHARED_WORKER = {
    "fixed-addresses": (
        "tests/cluster/",
        "e2e/test_operator_pods.py",
        "e2e/test_operator_pd_pods.py",
        "e2e/test_operator_adapter_fetch.py",
    ),
    "transformers-oracle": (
        "tests/engine/test_model_default.py",
        "tests/engine/test_lora_parity.py",
        "tests/engine_server/test_prompt_logprobs.py",
    ),
}


def group_of(relative: str) -> str:
    """The unit of work a test file belongs to: its group, else the file itself."""
    for group, prefixes in SHARED_WORKER.items():
        if any(relative.startswith(p) for p in prefixes):
            return group
    return relative


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return
    from kvgate.local import ports

    index = int(worker.removeprefix("gw"))
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    low, high = ports.planned_range()
    width = (high - low) // max(1, count)
    os.environ[ports.PORT_RANGE_ENV] = f"{low + index * width}-{low + (index + 1) * width}"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadgroup`, grouped by SHARED_WORKER and file. xdist's own loadgroup reads groups
    from test ids it edits, which pytest 9.2 no longer lets it do (pytest-xdist#1386): the
    groups would be silently ignored, so the grouping is done here, from the ids as they are."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SharedWorkerScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid.split("::", 1)[0])

    return SharedWorkerScheduling(config, log)
