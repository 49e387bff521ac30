"""Triton kernels against their torch references, on CPU under TRITON_INTERPRET=1 (small shapes).

With KVGATE_TRITON_DEVICE=cuda on a GPU machine the same tests run compiled on CUDA tensors
(kvgate/testing/triton_mode.py says how; scripts/gpu_check.sh runs them so). Triton decides
interpret-or-compile when a kernel is decorated, i.e. when its module is imported, so the mode is
set before the kernel modules are imported (and they are reloaded if something imported them
earlier in the other mode).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

# The layers import their kernels only when called, so importing them here decides no mode.
from kvgate.engine.layers.activation import silu_and_mul_torch
from kvgate.engine.layers.attention import paged_attention_reference, store_kv_torch
from kvgate.engine.layers.norm import rms_norm_torch
from kvgate.engine.layers.rotary import RotaryEmbedding, apply_rotary_torch
from kvgate.engine.models.config import RopeScaling
from kvgate.testing import triton_mode

COMPILED = triton_mode.configure_test_module()

pytestmark = pytest.mark.triton


activation = triton_mode.kernel_module("kvgate.engine.kernels.activation")
kv_store = triton_mode.kernel_module("kvgate.engine.kernels.kv_store")
norm = triton_mode.kernel_module("kvgate.engine.kernels.norm")
rotary = triton_mode.kernel_module("kvgate.engine.kernels.rotary")
paged = triton_mode.kernel_module("kvgate.engine.kernels.paged_attention")
assert "triton" in sys.modules


@pytest.fixture(autouse=True)
def _seed_and_device() -> Iterator[None]:
    """Compiled mode: every tensor the tests make lands on the GPU (the default device)."""
    torch.manual_seed(0)
    with torch.device("cuda") if COMPILED else contextlib.nullcontext():
        yield


def test_kernels_run_in_the_chosen_mode() -> None:
    assert triton_mode.is_interpreted(paged._paged_attention_kernel) != COMPILED


@pytest.mark.parametrize("n", [48, 64])
def test_rms_norm_matches_reference(n: int) -> None:
    x = torch.randn(5, n)
    w = torch.randn(n)
    torch.testing.assert_close(norm.rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6), rtol=1e-5, atol=1e-5)


def test_rms_norm_fused_residual_updates_residual_in_place() -> None:
    x, res, w = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32)
    expected_sum = x + res
    out = norm.rms_norm(x, w, 1e-5, residual=res)
    torch.testing.assert_close(res, expected_sum)
    torch.testing.assert_close(out, rms_norm_torch(expected_sum, w, 1e-5), rtol=1e-5, atol=1e-5)


def test_rms_norm_per_head_on_a_strided_view() -> None:
    qkv = torch.randn(3, 4 * 16 + 2 * 16)
    q = qkv[:, : 4 * 16].view(3, 4, 16)  # non-contiguous across tokens, like the fused projection
    w = torch.randn(16)
    torch.testing.assert_close(norm.rms_norm(q, w, 1e-6), rms_norm_torch(q, w, 1e-6), rtol=1e-5, atol=1e-5)


def test_silu_and_mul_matches_reference() -> None:
    x = torch.randn(6, 2 * 40)
    torch.testing.assert_close(activation.silu_and_mul(x), silu_and_mul_torch(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "scaling", [RopeScaling(), RopeScaling(kind="llama3", factor=8.0, original_max_position_embeddings=32)]
)
def test_rotary_matches_reference_in_place_on_strided_views(scaling: RopeScaling) -> None:
    heads, kv_heads, dim = 4, 2, 32
    rope = RotaryEmbedding(dim, 64, 10000.0, scaling)
    qkv = torch.randn(5, (heads + 2 * kv_heads) * dim)
    q = qkv[:, : heads * dim].view(5, heads, dim)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(5, kv_heads, dim)
    positions = torch.tensor([0, 3, 17, 40, 63])
    q_ref, k_ref = apply_rotary_torch(positions, q.clone(), k.clone(), rope.cos_sin)
    rotary.apply_rotary(positions, q, k, rope.cos_sin)
    torch.testing.assert_close(q, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, k_ref, rtol=1e-5, atol=1e-5)


def _cache(num_blocks: int, block_size: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(num_blocks, block_size, kv_heads, dim), torch.randn(
        num_blocks, block_size, kv_heads, dim
    )


def test_store_kv_writes_slots_and_skips_padding() -> None:
    k_cache, v_cache = _cache(6, 4, 2, 16)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    kv = torch.randn(5, 2 * 2 * 16)  # [k | v] per token, a strided view like the real one
    k = kv[:, :32].view(5, 2, 16)
    v = kv[:, 32:].view(5, 2, 16)
    slots = torch.tensor([0, 5, 23, -1, 9])
    kv_store.store_kv(k, v, k_cache, v_cache, slots)
    store_kv_torch(k, v, ref_k, ref_v, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def _random_batch(
    query_lens: list[int], ctx_lens: list[int], block_size: int, num_blocks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block tables drawn from a shuffled pool (non-contiguous, like a real allocator)."""
    pool = torch.randperm(num_blocks).tolist()
    lens = [q + c for q, c in zip(query_lens, ctx_lens, strict=True)]
    max_blocks = max(-(-n // block_size) for n in lens)
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    for i, n in enumerate(lens):
        need = -(-n // block_size)
        tables[i, :need] = torch.tensor([pool.pop() for _ in range(need)], dtype=torch.int32)
    query_start = torch.zeros(len(lens) + 1, dtype=torch.int32)
    query_start[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    return tables, torch.tensor(lens, dtype=torch.int32), query_start


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size"),
    [(4, 2, 16, 4), (6, 2, 24, 8), (3, 3, 16, 16)],  # GQA group 2, odd group 3 with a non-power-of-2 dim, MHA
)
def test_paged_attention_mixed_prefill_and_decode(
    heads: int, kv_heads: int, dim: int, block_size: int
) -> None:
    # decodes first, then a fresh prefill, then a chunk over a cached prefix
    query_lens, ctx_lens = [1, 1, 7, 5], [9, 0, 0, 13]
    tables, seq_lens, query_start = _random_batch(query_lens, ctx_lens, block_size, num_blocks=24)
    k_cache, v_cache = _cache(24, block_size, kv_heads, dim)
    q = torch.randn(sum(query_lens), heads, dim)
    scale = dim**-0.5
    expected = paged_attention_reference(q, k_cache, v_cache, tables, seq_lens, query_start, scale)
    got = paged.paged_attention(
        q, k_cache, v_cache, tables, seq_lens, query_start, max(query_lens), scale, block_m=16, block_n=16
    )
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_paged_attention_query_tiles_span_several_programs() -> None:
    # 20 query tokens with group 2 and BLOCK_M 16 -> 3 query tiles of 8 tokens
    query_lens, ctx_lens = [20], [6]
    tables, seq_lens, query_start = _random_batch(query_lens, ctx_lens, 4, num_blocks=12)
    k_cache, v_cache = _cache(12, 4, 2, 16)
    q = torch.randn(20, 4, 16)
    expected = paged_attention_reference(q, k_cache, v_cache, tables, seq_lens, query_start, 0.25)
    got = paged.paged_attention(
        q, k_cache, v_cache, tables, seq_lens, query_start, 20, 0.25, block_m=16, block_n=16
    )
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_split_kv_decode_matches_reference(num_splits: int) -> None:
    ctx_lens = [0, 21, 40]
    query_lens = [1, 1, 1]
    tables, seq_lens, query_start = _random_batch(query_lens, ctx_lens, 8, num_blocks=16)
    k_cache, v_cache = _cache(16, 8, 2, 16)
    q = torch.randn(3, 4, 16)
    expected = paged_attention_reference(q, k_cache, v_cache, tables, seq_lens, query_start, 0.25)
    got = paged.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25, num_splits, block_n=16)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_split_kv_decode_padding_rows_are_zero() -> None:
    tables, _, _ = _random_batch([1, 1], [4, 4], 4, num_blocks=4)
    k_cache, v_cache = _cache(4, 4, 1, 16)
    q = torch.randn(2, 2, 16)
    seq_lens = torch.tensor([5, 0], dtype=torch.int32)  # row 1 is CUDA-graph padding
    got = paged.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.25, 2, block_n=16)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    assert got[0].abs().sum() > 0


@pytest.mark.skipif(COMPILED, reason="a CPU runner; tests/engine/test_runner_gpu.py covers it on CUDA")
def test_model_with_triton_attention_matches_torch_backend(tmp_path: Path) -> None:
    """The runner's Triton path end to end (metadata without the torch plan, KV store, the mixed
    kernel for prefill+decode steps, the split-KV kernel for all-decode steps), interpreted on CPU."""
    transformers = pytest.importorskip("transformers")
    from kvgate.engine.config import EngineConfig
    from kvgate.engine.layers.attention import Attention, TritonAttentionBackend
    from kvgate.engine.model_runner import TorchModelRunner
    from kvgate.engine.sampling_params import SamplingParams
    from kvgate.testing.runner_driver import drive

    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.3,
    )
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    runner = TorchModelRunner(
        EngineConfig(model=str(tmp_path), block_size=4, num_kv_blocks=40, cpu_threads=1), progress=False
    )
    prompts = [[5, 9, 2, 77, 31, 8, 100], [3], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]
    params = SamplingParams(temperature=0.0, logprobs=3)
    expected = drive(runner, prompts, 5, params=params, chunk=4)
    triton_backend = TritonAttentionBackend()
    for module in runner.model.modules():
        if isinstance(module, Attention):
            module.backend = triton_backend
    runner._torch_backend = False
    got = drive(runner, prompts, 5, params=params, chunk=4)
    for want_seq, got_seq in zip(expected, got, strict=True):
        assert [t.token_id for t in got_seq] == [t.token_id for t in want_seq]
        for w, g in zip(want_seq, got_seq, strict=True):
            assert g.logprob == pytest.approx(w.logprob, abs=1e-4)
