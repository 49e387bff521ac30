"""GET /v1/models/{id} through real Envoy + the EPP to a simulated engine, with the `openai`
client: the gateway passes the body-less GET to a picked engine untouched, slashes in ids too."""

from __future__ import annotations

import httpx
import openai
import pytest
from openai import OpenAI

from kvgate.testing import processes as harness

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    logs = tmp_path_factory.mktemp("gateway-models")
    with harness.gateway_stack(
        logs, engines=1, engine_args=("--served-model-name", "default", "org/sim-model")
    ) as (_, _, envoy):
        yield envoy


def test_models_retrieve_through_the_gateway(gateway) -> None:
    client = OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0, timeout=30)
    model = client.models.retrieve("default")
    assert (model.id, model.object, model.owned_by) == ("default", "model", "kvgate")
    # openai percent-encodes the slash (org%2Fsim-model); it still reaches the engine
    assert client.models.retrieve("org/sim-model").id == "org/sim-model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    error = info.value.response.json()["error"]
    assert error["code"] == "model_not_found" and error["type"] == "invalid_request_error"
    # and raw, as curl sends it
    r = httpx.get(f"{gateway.url}/v1/models/org/sim-model", timeout=30)
    assert r.status_code == 200 and r.json()["id"] == "org/sim-model"
