"""The GPU path (Triton kernels, CUDA graphs) against the CPU torch path. Needs a CUDA GPU.

A tiny random Llama and Qwen3 run fp32 on both devices, logits agreeing to 2e-2 rather than
bit-for-bit. Greedy decoding, eager and with CUDA graphs, must produce the same tokens as the CPU
runner. Triton's fp32 dots run in IEEE fp32 here (TRITON_F32_DEFAULT=ieee), not TF32: the
margins are not always wide (the Llama's 70-token prompt has top-2 logprobs 0.049 apart at its
5th token), and with TF32 the GPU took the runner-up there (seen on an H200; the same tokens come
out on CPU when the attention dots' inputs are truncated to TF32 under Triton's interpreter).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvgate.engine.config import EngineConfig
from kvgate.engine.model_runner import TorchModelRunner
from kvgate.testing.runner_driver import drive

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module", autouse=True)
def _ieee_fp32_dots() -> Iterator[None]:
    # Read when a kernel compiles (on first call, inside the tests), so set for the whole module.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_F32_DEFAULT", "ieee")
        yield


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    common: dict[str, Any] = dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.3,
    )
    torch.manual_seed(5)
    if request.param == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=64, **common))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return path


def _runner(folder: Path, device: str, eager: bool = True) -> TorchModelRunner:
    cfg = EngineConfig(
        model=str(folder),
        device=device,
        dtype="float32",
        num_kv_blocks=256,
        max_num_seqs=8,
        enforce_eager=eager,
    )
    return TorchModelRunner(cfg, progress=False)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, 512, (n,), generator=g).tolist() for n in (1, 9, 70, 300)]


@pytest.mark.parametrize("eager", [True, False])
def test_gpu_greedy_matches_cpu(folder: Path, eager: bool) -> None:
    cpu = _runner(folder, "cpu")
    gpu = _runner(folder, "cuda", eager=eager)
    assert (gpu.graphs is None) == eager
    prompts = _prompts()
    want = drive(cpu, prompts, 16, chunk=32)
    got = drive(gpu, prompts, 16, chunk=32)
    assert [[t.token_id for t in s] for s in got] == [[t.token_id for t in s] for s in want]


def test_gpu_logprobs_close_to_cpu(folder: Path) -> None:
    from kvgate.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, logprobs=5)
    cpu = drive(_runner(folder, "cpu"), _prompts(), 4, params=params, chunk=64)
    gpu = drive(_runner(folder, "cuda", eager=False), _prompts(), 4, params=params, chunk=64)
    for a_seq, b_seq in zip(cpu, gpu, strict=True):
        for a, b in zip(a_seq, b_seq, strict=True):
            assert a.logprob is not None and b.logprob is not None
            assert abs(a.logprob - b.logprob) < 2e-2
