"""The one Prometheus text parser (kvgate.api.contracts.prometheus_text)."""

from __future__ import annotations

from kvgate.api.contracts import prometheus_text

TEXT = """# HELP vllm:num_requests_waiting Requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2
vllm:cache_config_info{num_gpu_blocks="1800",tag="a}b"} 1.0
plain_counter_total 7 1712345678000
broken{x="1"} not-a-number
{nameless="1"} 4

   indented 1
vllm:gpu_cache_usage_perc{a="x \\"quoted\\" y"} NaN
"""


def test_samples_names_labels_and_values() -> None:
    got = list(prometheus_text.samples(TEXT))
    assert ("vllm:num_requests_waiting", 'engine="0",model_name="m"', 3.0) in got
    assert ("plain_counter_total", "", 7.0) in got  # a timestamp after the value is ignored
    assert ("vllm:cache_config_info", 'num_gpu_blocks="1800",tag="a}b"', 1.0) in got
    names = [n for n, _, _ in got]
    assert "broken" not in names and "indented" not in names and len(got) == 5
    (nan,) = [v for n, _, v in got if n == "vllm:gpu_cache_usage_perc"]
    assert nan != nan  # NaN is a number Prometheus writes


def test_filters_and_labels_and_sums() -> None:
    only = list(prometheus_text.samples(TEXT, names={"plain_counter_total"}))
    assert only == [("plain_counter_total", "", 7.0)]
    assert [n for n, _, _ in prometheus_text.samples(TEXT, prefixes=("vllm:num_",))] == [
        "vllm:num_requests_waiting"
    ] * 2
    assert prometheus_text.labels('engine="0",model_name="m"') == {"engine": "0", "model_name": "m"}
    assert prometheus_text.labels('a="x \\"q\\" y"') == {"a": 'x \\"q\\" y'}
    assert prometheus_text.summed(TEXT)["vllm:num_requests_waiting"] == 5.0
