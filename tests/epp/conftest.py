from __future__ import annotations

import time

import pytest

from kvgate.epp.datastore import Datastore, Endpoint, EndpointMetrics
from kvgate.testing.scheduling import CharTokenizer, make_request


@pytest.fixture
def store() -> Datastore:
    ds = Datastore()
    ds.set_endpoints([Endpoint(f"10.0.0.{i}:8000") for i in range(1, 4)])
    for st in ds.all():
        ds.update_metrics(st.address, EndpointMetrics(updated_at=time.monotonic()))
    return ds


@pytest.fixture
def req():
    return make_request


@pytest.fixture
def char_tokenizer() -> CharTokenizer:
    return CharTokenizer()
