"""Real `kvgate engine serve` processes on free ports, shared by the engine-server tests
(started by `kvgate.testing.engine_server`)."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from kvgate.testing.engine_server import EngineProcess, launch

API_KEY = "test-key"


@pytest.fixture
def engine_factory(tmp_path: Path) -> Iterator[Callable[..., EngineProcess]]:
    started: list[EngineProcess] = []

    def make(*args: str) -> EngineProcess:
        eng = launch(tmp_path, *args)
        started.append(eng)
        return eng

    yield make
    for eng in started:
        eng.stop(signal.SIGKILL)


# The shared simulated engine: fast timing, KV events with replay, an API key, tiny block pool
# so block accounting is easy to observe.
SIM_ARGS = (
    "--simulate",
    "--sim-itl", "0.002",
    "--sim-itl-per-seq", "0.0001",
    "--sim-prefill-time-per-token", "0.00001",
    "--sim-kv-blocks", "256",
    "--api-key", API_KEY,
    "--served-model-name", "sim-model", "sim-alias",
    "--max-model-len", "1024",
    "--kv-events-endpoint", "tcp://127.0.0.1:*",
    "--kv-events-replay-endpoint", "tcp://127.0.0.1:*",
)  # fmt: skip


@pytest.fixture(scope="session")
def sim_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    eng = launch(tmp_path_factory.mktemp("sim-engine"), *SIM_ARGS)
    yield eng
    eng.stop(signal.SIGKILL)


@pytest.fixture(scope="module")
def client(sim_engine: EngineProcess) -> OpenAI:
    """The real `openai` client on the module's simulated engine."""
    return OpenAI(base_url=f"{sim_engine.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
