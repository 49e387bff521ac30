"""The README's first command for real: `kvgate up` with one engine on the default model (SmolLM2),
and its printed curl returning the model's own answer through Envoy and the EPP."""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
from collections.abc import Iterator

import pytest

from kvgate.testing.local_up import UpProcess, start_up, stop_up

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("kvgate.engine.model_runner") is None,
        reason="the engine's real model runner (kvgate.engine.model_runner) is not built yet",
    ),
]


@pytest.fixture(scope="module")
def real_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    up = start_up(tmp_path_factory.mktemp("real"), "--engines", "1", "--quiet", "--ready-timeout", "240")
    try:
        up.wait_for_line(r"^curl ", timeout=260)
        yield up
    finally:
        stop_up(up)


def test_printed_curl_gets_the_default_models_answer(real_stack: UpProcess) -> None:
    curl = real_stack.wait_for_line(r"^curl ")
    out = subprocess.run(shlex.split(curl), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    answer = doc["choices"][0]["message"]["content"]
    # SmolLM2-135M-Instruct, greedy or not, names Paris for this question.
    assert "Paris" in answer, answer
