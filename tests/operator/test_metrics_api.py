"""The operator's External Metrics API, its pure parts: reading GIE's pool gauges from an EPP's
exposition, the pool an HPA's selector names, quantities. tests/cluster/test_workloads.py runs
it behind the real aggregation layer with the real HPA controller."""

from __future__ import annotations

import pytest

from kvgate.operator.metrics_api import pool_gauges, pool_of, quantity

EXPOSITION = """# HELP inference_pool_average_queue_size Mean waiting queue over the pool
# TYPE inference_pool_average_queue_size gauge
inference_pool_average_queue_size{name="tiny"} 7.5
inference_pool_average_queue_size{name="other"} 99.0
inference_pool_average_kv_cache_utilization{name="tiny"} 0.25
inference_pool_per_pod_queue_size{name="tiny",model_server_pod="tiny-0"} 3.0
inference_pool_average_queue_size{name="tiny\\"x"} 42
not a sample line
inference_pool_average_queue_size{name="broken"} NaNish
"""


def test_only_the_named_pools_gauges_are_read() -> None:
    assert pool_gauges(EXPOSITION, "tiny") == {
        "inference_pool_average_queue_size": 7.5,
        "inference_pool_average_kv_cache_utilization": 0.25,
    }
    assert pool_gauges(EXPOSITION, "missing") == {}
    assert pool_gauges(EXPOSITION, "broken") == {}


@pytest.mark.parametrize(
    ("selector", "pool"),
    [("name=tiny", "tiny"), ("name==tiny", "tiny"), ("a=b, name=tiny", "tiny"), ("name!=tiny", None),
     ("", None), ("other=tiny", None), ("name=", None)],
)  # fmt: skip
def test_the_pool_comes_from_the_hpas_selector(selector: str, pool: str | None) -> None:
    assert pool_of(selector) == pool


@pytest.mark.parametrize(
    ("value", "text"), [(0.0, "0"), (3.0, "3"), (7.5, "7500m"), (0.0004, "0"), (0.25, "250m")]
)
def test_values_are_kubernetes_quantities(value: float, text: str) -> None:
    assert quantity(value) == text
