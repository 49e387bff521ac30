"""Multi-LoRA on the REAL default model against Hugging Face transformers + PEFT.

Two random-init PEFT adapters (rank 4 on the attention projections, rank 8 with rsLoRA on the
MLP and v_proj), saved with PEFT's own save_pretrained. Our engine runs them and base-model
requests together in one batch (fp32, CPU, greedy); every request must equal transformers
with the adapter applied by PEFT, token for token. Adapter outputs must differ from the base
model's, or the comparison would prove nothing. (What LoRA costs a decode step is a benchmark:
bench/lora_step_cpu.py.)
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvgate.engine.config import EngineConfig
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.model_runner import TorchModelRunner
from kvgate.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

MAX_NEW = 16
PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:\n",
    "def fibonacci(n):",
]
ADAPTERS = {
    "attn4": {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "mlp8": {
        "r": 8,
        "lora_alpha": 8,
        "use_rslora": True,
        "target_modules": ["gate_proj", "up_proj", "down_proj", "v_proj"],
    },
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def base(hf_default_model: Any) -> Iterator[Any]:
    """The session's transformers model (shared with other oracle tests). PEFT wraps it in place
    below; each use unwraps it again, and this checks that nothing is left behind."""
    yield hf_default_model
    assert not any("lora_" in name for name, _ in hf_default_model.named_parameters())


@pytest.fixture(scope="module")
def adapters(base: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PEFT adapters with nonzero random A and B, written by PEFT's save_pretrained."""
    out: dict[str, Path] = {}
    torch.manual_seed(0)
    for name, spec in ADAPTERS.items():
        model = peft.get_peft_model(base, peft.LoraConfig(**spec))
        try:
            for pname, param in model.named_parameters():
                if "lora_A" in pname or "lora_B" in pname:
                    torch.nn.init.normal_(param, std=0.05)
            folder = tmp_path_factory.mktemp(name)
            model.save_pretrained(str(folder))
            out[name] = folder
        finally:
            assert model.unload() is base  # the plain base model again
    return out


def _reference_greedy(model: Any, prompt: list[int]) -> list[int]:
    """Greedy decoding, EOS or not, with transformers' own KV cache (as our engine decodes with
    its own): the prompt once, then one token per forward."""
    cache = transformers.DynamicCache()
    out: list[int] = []
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True).logits
        while True:
            out.append(int(logits[0, -1].argmax()))
            if len(out) == MAX_NEW:
                return out
            logits = model(input_ids=torch.tensor([out[-1:]]), cache=cache, use_cache=True).logits


@pytest.fixture(scope="module")
def reference(base: Any, adapters: dict[str, Path], tok: Any) -> dict[tuple[str | None, int], list[int]]:
    out: dict[tuple[str | None, int], list[int]] = {}
    prompts = [tok.encode(p) for p in PROMPTS]
    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))  # the oracle only: not timed
    try:
        for i, p in enumerate(prompts):
            out[(None, i)] = _reference_greedy(base, p)
        for name, path in adapters.items():
            model = peft.PeftModel.from_pretrained(base, str(path)).eval()
            try:
                for i, p in enumerate(prompts):
                    out[(name, i)] = _reference_greedy(model, p)
            finally:
                model.unload()
    finally:
        torch.set_num_threads(previous)
    return out


@pytest.fixture(scope="module")
def runner() -> TorchModelRunner:
    config = EngineConfig(device="cpu", num_kv_blocks=64, enable_lora=True, max_loras=2, max_lora_rank=8)
    return TorchModelRunner(config, progress=False)


@pytest.fixture(scope="module")
def tok(runner: TorchModelRunner) -> Any:
    return runner.tokenizer


def _engine(runner: TorchModelRunner, tok: Any, adapters: dict[str, Path], **kw: Any) -> LLMEngine:
    config = EngineConfig(device="cpu", num_kv_blocks=64, enable_lora=True, max_lora_rank=8, **kw)
    engine = LLMEngine(config, runner=runner, tokenizer=tok)
    for name, path in adapters.items():
        engine.add_lora(name, engine.load_lora(name, str(path)))
    return engine


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], int | None]]) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for rid, (prompt, lora_id) in requests.items():
        engine.add_request(rid, prompt, params, lora_id=lora_id)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.token_ids
    return out


def test_mixed_adapter_batch_matches_peft_token_for_token(
    runner: TorchModelRunner, tok: Any, adapters: dict[str, Path], reference: dict[Any, list[int]]
) -> None:
    from kvgate.api.lora import lora_int_id

    engine = _engine(runner, tok, adapters, max_loras=2)
    prompts = [tok.encode(p) for p in PROMPTS]
    requests: dict[str, tuple[list[int], int | None]] = {}
    for i, p in enumerate(prompts):
        requests[f"base-{i}"] = (p, None)
        for name in ADAPTERS:
            requests[f"{name}-{i}"] = (p, lora_int_id(name))
    batch = engine.scheduler.schedule
    sizes: list[int] = []

    def spy() -> Any:  # every request is in the first step: one batch mixes both adapters and base
        b = batch()
        sizes.append(len(b.seqs))
        return b

    engine.scheduler.schedule = spy  # type: ignore[method-assign]
    ours = _run(engine, requests)
    assert sizes[0] == len(requests)
    for i in range(len(prompts)):
        assert ours[f"base-{i}"] == reference[(None, i)]
        for name in ADAPTERS:
            assert ours[f"{name}-{i}"] == reference[(name, i)], (name, i)
            assert reference[(name, i)] != reference[(None, i)], "the adapter must change the output"


def test_one_slot_serves_two_adapters_in_turn(
    runner: TorchModelRunner, tok: Any, adapters: dict[str, Path], reference: dict[Any, list[int]]
) -> None:
    """The scheduler limit is max_loras adapters in a step: with one (of the runner's two
    slots) the second adapter's requests wait for the first's to end; outputs stay exact."""
    from kvgate.api.lora import lora_int_id

    engine = _engine(runner, tok, adapters, max_loras=1)
    prompts = [tok.encode(p) for p in PROMPTS]
    requests = {f"{name}-{i}": (p, lora_int_id(name)) for name in ADAPTERS for i, p in enumerate(prompts)}
    requests["base-0"] = (prompts[0], None)
    seen: list[set[int | None]] = []
    schedule = engine.scheduler.schedule

    def spy() -> Any:
        b = schedule()
        seen.append({s.lora_id for s in b.seqs} - {None})
        return b

    engine.scheduler.schedule = spy  # type: ignore[method-assign]
    ours = _run(engine, requests)
    assert max(len(s) for s in seen) == 1 and len(set().union(*seen)) == 2
    assert ours["base-0"] == reference[(None, 0)]
    for name in ADAPTERS:
        for i in range(len(prompts)):
            assert ours[f"{name}-{i}"] == reference[(name, i)]
