"""The LoRA bench pieces (issue 12): the lora workload's shape, the adapter in each request's
payload, the engines' adapter-load counter in the run's deltas and table, and the preset."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from kvgate.bench import engine_metrics, report
from kvgate.bench.loadgen import Target, chat_payload
from kvgate.bench.presets import PRESETS
from kvgate.bench.stats import Slo, summarize
from kvgate.bench.workloads import LoRASpec, WorkloadSpec, generate


def test_lora_workload_is_skewed_over_adapters_with_a_prompt_each() -> None:
    spec = WorkloadSpec(kind="lora", seed=2, lora=LoRASpec(adapters=8, zipf=1.1, base_fraction=0.1))
    reqs = list(itertools.islice(generate(spec), 2000))
    models = Counter(r.model for r in reqs)
    assert 0.07 < models[None] / 2000 < 0.13  # the base model's share
    counts = [models[f"adapter-{i:02d}"] for i in range(8)]
    assert all(c > 0 for c in counts) and counts[0] > 2 * counts[3] > 0  # Zipf: a few hot ones
    # every request of an adapter opens with that adapter's system prompt, and only its own
    system = {r.model: r.messages[0].content for r in reqs}
    assert all(r.messages[0].content == system[r.model] for r in reqs)
    assert len(set(system.values())) == 9
    assert len({r.messages[1].content for r in reqs}) == 2000  # unique questions
    again = list(itertools.islice(generate(spec), 2000))
    assert [(r.model, r.messages) for r in again] == [(r.model, r.messages) for r in reqs]
    for bad, message in (
        (LoRASpec(adapters=0), "--adapters"),
        (LoRASpec(zipf=-1), "--adapter-zipf"),
        (LoRASpec(base_fraction=1.0), "--base-fraction"),
    ):
        with pytest.raises(ValueError, match=message):
            next(generate(WorkloadSpec(kind="lora", lora=bad)))


def test_a_request_names_its_adapter_else_the_stack_model() -> None:
    reqs = list(itertools.islice(generate(WorkloadSpec(kind="lora", seed=0)), 50))
    target = Target("http://gw", "base-model")
    for r in reqs:
        assert chat_payload(r, target)["model"] == (r.model or "base-model")


def test_adapter_loads_are_counted_and_shown() -> None:
    text = (
        "# TYPE kvgate:lora_adapter_loads_total counter\n"
        'kvgate:lora_adapter_loads_total{model_name="m",engine="0"} 7.0\n'
    )
    samples = engine_metrics.parse_samples(text)
    assert samples[engine_metrics.LORA_LOADS] == 7.0
    assert engine_metrics.LORA_LOADS in engine_metrics.COUNTERS
    summary = summarize("precise-prefix", [], 1.0, Slo(0.5, 0.05), request_rate=4.0)
    summary.lora_loads = 7
    headers, body = report.rows([summary])
    assert body[0][headers.index("LoRA loads")] == "7"


def test_lora_preset_uses_more_adapters_than_slots() -> None:
    preset = PRESETS["lora"].values
    assert preset["workload"] == "lora"
    assert int(preset["adapters"]) > int(preset["max_loras"])  # type: ignore[call-overload]
