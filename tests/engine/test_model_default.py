"""The default model (SmolLM2-135M-Instruct GGUF) against transformers loading the same GGUF.

Both run fp32 on CPU over the same dequantized weights. Stated tolerance: logits agree within
1e-3 absolute at every prompt position (observed here: exactly 0; only matmul summation order
could differ), and greedy decoding agrees token for token up to EOS.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvgate.engine.config import EngineConfig
from kvgate.engine.layers.attention import build_attention_metadata
from kvgate.engine.model_runner import TorchModelRunner
from kvgate.engine.sampling_params import SamplingParams
from kvgate.testing.runner_driver import drive

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

LOGIT_ATOL = 1e-3
MAX_NEW = 24
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write one sentence about the sea."}],
    [
        {"role": "system", "content": "You are a concise assistant. Answer in one short paragraph."},
        {"role": "user", "content": "What are three benefits of regular exercise?"},
        {"role": "assistant", "content": "Better sleep, more energy and a healthier heart."},
        {"role": "user", "content": "Which of these matters most for older adults, and why?"},
    ],
    [
        {
            "role": "user",
            "content": "Summarise this text in one sentence: "
            + "The city council met on Tuesday to discuss the new park. Residents asked for more trees, "
            "benches and a playground. The council agreed to fund the trees this year and to review the "
            "playground next spring, after a survey of families in the neighbourhood. " * 3,
        }
    ],
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # shared cores: one thread per process is far steadier under load
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def runner() -> TorchModelRunner:
    return TorchModelRunner(EngineConfig(device="cpu", num_kv_blocks=160), progress=False)


@pytest.fixture(scope="module")
def reference(hf_default_model: Any) -> Any:
    return hf_default_model


@pytest.fixture(scope="module")
def prompts(runner: TorchModelRunner) -> list[list[int]]:
    tok = runner.tokenizer
    ids = [tok.encode(tok.apply_chat_template(c)) for c in CONVERSATIONS]
    assert sorted(len(p) for p in ids) == [len(p) for p in sorted(ids, key=len)]
    assert max(len(p) for p in ids) > 150  # spans many blocks and several prefill chunks
    return ids


def test_prompt_logits_match_transformers(
    runner: TorchModelRunner, reference: Any, prompts: list[list[int]]
) -> None:
    prompt = prompts[2]
    blocks = list(range(100, 100 + -(-len(prompt) // runner.block_size)))
    with torch.inference_mode():
        expected = reference(torch.tensor([prompt])).logits[0]
        meta, positions = build_attention_metadata(
            [len(prompt)], [0], [blocks], runner.block_size, runner.device, torch_plan=True
        )
        got = runner.model.compute_logits(
            runner.model(torch.tensor(prompt), positions, runner.kv_caches, meta)
        )
    assert (got - expected).abs().max().item() <= LOGIT_ATOL


def test_greedy_chat_matches_transformers_token_for_token(
    runner: TorchModelRunner, reference: Any, prompts: list[list[int]]
) -> None:
    eos = runner.tokenizer.eos_token_ids
    params = SamplingParams(temperature=0.0, logprobs=5)
    # All four together: chunked prefills of the long prompts run beside the short ones' decodes.
    ours = drive(runner, prompts, MAX_NEW, params=params, chunk=48, stop_ids=eos)
    for prompt, samples in zip(prompts, ours, strict=True):
        with torch.inference_mode():
            out = reference.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=2,
            )
        expected = out.sequences[0, len(prompt) :].tolist()
        assert [s.token_id for s in samples] == expected
        # Logprobs (vLLM semantics: log-softmax of the raw logits) agree at every generated step.
        for sample, logits in zip(samples, out.logits, strict=True):
            ref = logits[0].float().log_softmax(-1)
            assert sample.logprob == pytest.approx(ref[sample.token_id].item(), abs=LOGIT_ATOL)
            assert sample.top_logprobs is not None and len(sample.top_logprobs) == 5
            assert sample.top_logprobs[0][0] == sample.token_id
            for token_id, lp in sample.top_logprobs:
                assert lp == pytest.approx(ref[token_id].item(), abs=LOGIT_ATOL)


def test_france_answer(runner: TorchModelRunner, prompts: list[list[int]]) -> None:
    (samples,) = drive(runner, prompts[:1], 12, stop_ids=runner.tokenizer.eos_token_ids)
    text = runner.tokenizer.decode([s.token_id for s in samples])
    assert text == "The capital of France is Paris."
