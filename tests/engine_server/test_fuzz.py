"""Hypothesis fuzzing of every JSON route: no body, however odd, gets a 5xx."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.engine.server.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from kvgate.testing.engine_server import EngineProcess, launch

FIELDS = sorted(
    set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields) | set(TokenizeRequest.model_fields)
    | {"tokens", "content", "role"}
)  # fmt: skip

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-3, max_value=70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.sampled_from(["sim", "user", "assistant", "system", "text", "none", "", "\u2603", "\x00"]),
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from([*FIELDS, "type", "text"]), inner, max_size=4)
    ),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]), "content": json_values}
    ),
    max_size=3,
)
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8).flatmap(
    lambda d: st.just(d) | messages.map(lambda m: {**d, "messages": m})
)
routes = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])


@pytest.fixture(scope="module")
def fuzz_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineProcess]:
    eng = launch(
        tmp_path_factory.mktemp("fuzz-engine"),
        "--simulate",
        "--sim-time-scale",
        "0",
        "--max-model-len",
        "128",
        "--served-model-name",
        "sim",
    )
    yield eng
    eng.stop()


@pytest.fixture(scope="module")
def http(fuzz_engine: EngineProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=fuzz_engine.base_url, timeout=30) as client:
        yield client


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(route=routes, body=bodies, raw=st.booleans())
def test_no_body_gets_a_server_error(http: httpx.Client, route: str, body: dict, raw: bool) -> None:
    content = json.dumps(body).encode()
    if raw:  # also feed truncated JSON
        content = content[: len(content) // 2]
    r = http.post(route, content=content, headers={"content-type": "application/json"})
    assert r.status_code < 500, (route, body, r.text)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert err["message"] and err["type"]
        assert "Traceback" not in r.text


def test_server_survived_fuzzing(http: httpx.Client, fuzz_engine: EngineProcess) -> None:
    assert http.get("/health").status_code == 200
    assert "Traceback" not in fuzz_engine.log, fuzz_engine.log[-3000:]
