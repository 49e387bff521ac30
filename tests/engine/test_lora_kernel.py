"""The batched mixed-adapter LoRA kernels against a per-token torch reference, on CPU under
TRITON_INTERPRET=1 (small shapes; see test_kernels.py for why the mode is set before import),
or compiled on CUDA with KVGATE_TRITON_DEVICE=cuda (kvgate/testing/triton_mode.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from kvgate.testing import triton_mode

COMPILED = triton_mode.configure_test_module()

pytestmark = pytest.mark.triton


lora = triton_mode.kernel_module("kvgate.engine.kernels.lora")


def lora_delta_reference(
    x: torch.Tensor, slots: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor
) -> torch.Tensor:
    """The plainest correct delta, one token at a time in fp64: the kernels' oracle."""
    out = torch.zeros((x.shape[0], lora_b.shape[1]), dtype=torch.float64)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        a, b = lora_a[s].double(), lora_b[s].double()
        out[t] = float(scaling[s]) * ((x[t].double() @ a.T) @ b.T)
    return out


def _adapters(
    slots: int,
    r_max: int,
    in_f: int,
    out_f: int,
    ranks: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slot buffers holding adapters of the given ranks, zero-padded to r_max like the real store."""
    ranks = ranks or [r_max] * slots
    lora_a = torch.zeros(slots, r_max, in_f)
    lora_b = torch.zeros(slots, out_f, r_max)
    for s, r in enumerate(ranks):
        lora_a[s, :r] = torch.randn(r, in_f) / in_f**0.5
        lora_b[s, :, :r] = torch.randn(out_f, r)
    scaling = torch.tensor([16.0 / r for r in ranks])
    return lora_a.to(dtype), lora_b.to(dtype), scaling


@pytest.fixture(autouse=True)
def _seed_and_device() -> Iterator[None]:
    """Compiled mode: every tensor the tests make lands on the GPU (the default device)."""
    torch.manual_seed(0)
    with torch.device("cuda") if COMPILED else contextlib.nullcontext():
        yield


def test_kernels_run_in_the_chosen_mode() -> None:
    assert triton_mode.is_interpreted(lora._lora_shrink_kernel) != COMPILED


# 12: not a power of two; 192: a fused q|k|v of rank-64 shards (smaller tiles).
@pytest.mark.parametrize("r_max", [4, 8, 12, 16, 32, 64, 192])
def test_mixed_slots_match_reference(r_max: int) -> None:
    # in/out not multiples of any block; slot -1 (base model) interleaved with three adapters.
    lora_a, lora_b, scaling = _adapters(3, r_max, 40, 37)
    x = torch.randn(7, 40)
    slots = torch.tensor([2, -1, 0, 1, 2, -1, 0])
    delta = lora.lora_delta_triton(x, slots, lora_a, lora_b, scaling)
    assert delta.shape == (7, 37) and delta.dtype == torch.float32
    torch.testing.assert_close(
        delta.double(), lora_delta_reference(x, slots, lora_a, lora_b, scaling), rtol=1e-5, atol=1e-5
    )
    assert torch.all(delta[1] == 0) and torch.all(delta[5] == 0)


def test_multi_block_reduction_and_output_tiles() -> None:
    # in > BLOCK_K and out > BLOCK_N: several reduction steps and several output tiles per token.
    lora_a, lora_b, scaling = _adapters(2, 8, 300, 260)
    x = torch.randn(3, 300)
    slots = torch.tensor([1, 0, -1])
    torch.testing.assert_close(
        lora.lora_delta_triton(x, slots, lora_a, lora_b, scaling).double(),
        lora_delta_reference(x, slots, lora_a, lora_b, scaling),
        rtol=1e-5,
        atol=1e-5,
    )


@pytest.mark.parametrize(("in_f", "splits"), [(1100, 5), (9000, 24)])
def test_split_k_partials_sum_to_the_shrink(in_f: int, splits: int) -> None:
    # Long rows are cut into ~256-column chunks (at most 32 per token), one program each; the
    # expand sums their partials. 9000 columns: 24 chunks of 384 (the 32-chunk cap applies).
    lora_a, lora_b, scaling = _adapters(2, 4, in_f, 20)
    x = torch.randn(3, in_f)
    slots = torch.tensor([1, -1, 0])
    parts = lora.lora_shrink_partials(x, slots, lora_a, scaling)
    assert parts.shape == (3, splits, 4)
    expected_h = torch.stack(
        [scaling[1] * x[0] @ lora_a[1].T, torch.zeros(4), scaling[0] * x[2] @ lora_a[0].T]
    )
    torch.testing.assert_close(parts.sum(1), expected_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lora.lora_shrink(x, slots, lora_a, scaling), expected_h, rtol=1e-5, atol=1e-5)
    expected = lora_delta_reference(x, slots, lora_a, lora_b, scaling)
    torch.testing.assert_close(
        lora.lora_expand(parts, slots, lora_b).double(), expected, rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        lora.lora_delta_triton(x, slots, lora_a, lora_b, scaling).double(), expected, rtol=1e-5, atol=1e-5
    )


def test_rank_padding_matches_the_unpadded_adapter() -> None:
    # Adapters of rank 2, 5 and 8 in r_max = 8 slots give what each gives at its own rank.
    ranks = [2, 5, 8]
    lora_a, lora_b, scaling = _adapters(3, 8, 24, 20, ranks=ranks)
    x = torch.randn(6, 24)
    slots = torch.tensor([0, 1, 2, 2, 1, 0])
    delta = lora.lora_delta_triton(x, slots, lora_a, lora_b, scaling)
    for t, s in enumerate(slots.tolist()):
        r = ranks[s]
        unpadded = float(scaling[s]) * (x[t] @ lora_a[s, :r].T) @ lora_b[s, :, :r].T
        torch.testing.assert_close(delta[t], unpadded, rtol=1e-5, atol=1e-5)


def test_one_slot_for_every_token() -> None:
    lora_a, lora_b, scaling = _adapters(1, 16, 33, 19)
    x = torch.randn(5, 33)
    slots = torch.zeros(5, dtype=torch.int64)
    expected = scaling[0] * (x @ lora_a[0].T) @ lora_b[0].T
    torch.testing.assert_close(
        lora.lora_delta_triton(x, slots, lora_a, lora_b, scaling), expected, rtol=1e-5, atol=1e-5
    )


def test_all_base_model_tokens_give_zero_and_leave_out_untouched() -> None:
    lora_a, lora_b, scaling = _adapters(2, 8, 16, 12)
    x = torch.randn(4, 16)
    slots = torch.full((4,), -1)
    assert torch.equal(lora.lora_delta_triton(x, slots, lora_a, lora_b, scaling), torch.zeros(4, 12))
    y = torch.randn(4, 12)
    before = y.clone()
    assert lora.lora_delta_triton(x, slots, lora_a, lora_b, scaling, out=y) is y
    assert torch.equal(y, before)


def test_no_tokens() -> None:
    lora_a, lora_b, scaling = _adapters(2, 8, 16, 12)
    x = torch.empty(0, 16)
    slots = torch.empty(0, dtype=torch.int64)
    assert lora.lora_delta_triton(x, slots, lora_a, lora_b, scaling).shape == (0, 12)
    y = torch.empty(0, 12)
    assert lora.lora_delta_triton(x, slots, lora_a, lora_b, scaling, out=y) is y


def test_accumulate_into_a_column_slice_of_a_fused_output() -> None:
    # y += delta in place, into the k part of a [T, q | k | v] output (strided rows), rows of
    # base-model tokens and the q/v columns untouched.
    lora_a, lora_b, scaling = _adapters(2, 8, 24, 10)
    x = torch.randn(5, 24)
    slots = torch.tensor([1, -1, 0, 0, -1])
    qkv = torch.randn(5, 16 + 10 + 10)
    before = qkv.clone()
    k = qkv[:, 16:26]
    assert lora.lora_delta_triton(x, slots, lora_a, lora_b, scaling, out=k) is k
    expected = before[:, 16:26].double() + lora_delta_reference(x, slots, lora_a, lora_b, scaling)
    torch.testing.assert_close(qkv[:, 16:26].double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(qkv[[1, 4], 16:26], before[[1, 4], 16:26])
    assert torch.equal(qkv[:, :16], before[:, :16]) and torch.equal(qkv[:, 26:], before[:, 26:])


def test_shrink_and_expand_separately() -> None:
    lora_a, lora_b, scaling = _adapters(2, 4, 20, 9)
    x = torch.randn(3, 20)
    slots = torch.tensor([1, -1, 0], dtype=torch.int32)
    h = lora.lora_shrink(x, slots, lora_a, scaling)
    assert h.dtype == torch.float32 and h.shape == (3, 4)
    assert torch.equal(h[1], torch.zeros(4))
    torch.testing.assert_close(h[0], scaling[1] * x[0] @ lora_a[1].T)
    y = lora.lora_expand(h, slots, lora_b)
    torch.testing.assert_close(y[2], h[2] @ lora_b[0].T)
    assert torch.equal(y[1], torch.zeros(9))
    # add=False overwrites, base-model rows included.
    z = torch.full((3, 9), 7.0)
    lora.lora_expand(h, slots, lora_b, out=z, add=False)
    assert torch.equal(z, y)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_accumulate_in_fp32(dtype: torch.dtype) -> None:
    lora_a, lora_b, scaling = _adapters(3, 16, 48, 30, dtype=dtype)
    x = torch.randn(6, 48).to(dtype)
    slots = torch.tensor([0, 2, -1, 1, 1, 0])
    expected = lora_delta_reference(x, slots, lora_a, lora_b, scaling)
    delta = lora.lora_delta_triton(x, slots, lora_a, lora_b, scaling)
    assert delta.dtype == dtype
    # One rounding of an fp32 sum to the storage dtype: within its half-ulp, relatively.
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(delta.double(), expected, rtol=tol, atol=tol)
    y = torch.randn(6, 30).to(dtype)
    base = y.double()
    lora.lora_delta_triton(x, slots, lora_a, lora_b, scaling, out=y)
    torch.testing.assert_close(y.double(), base + expected, rtol=tol, atol=tol)


def test_a_wrong_gather_is_caught() -> None:
    # The comparison above can fail: the same tokens under permuted slots (what a kernel that
    # gathered the wrong adapter would produce) are far from the reference.
    lora_a, lora_b, scaling = _adapters(3, 8, 20, 15)
    x = torch.randn(6, 20)
    slots = torch.tensor([0, 1, 2, -1, 2, 1])
    expected = lora_delta_reference(x, slots, lora_a, lora_b, scaling)
    permuted = torch.tensor([1, 2, 0, -1, 0, 2])
    wrong = lora.lora_delta_triton(x, permuted, lora_a, lora_b, scaling)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(wrong.double(), expected, rtol=1e-5, atol=1e-5)
    for t in (0, 1, 2, 4, 5):
        assert not torch.allclose(wrong[t].double(), expected[t], rtol=1e-2, atol=1e-2)


def test_mixed_batch_equals_each_token_alone() -> None:
    # Batch invariance: a token's delta is bit-identical whatever else shares the batch.
    lora_a, lora_b, scaling = _adapters(3, 16, 40, 24)
    x = torch.randn(5, 40)
    slots = torch.tensor([2, 0, -1, 1, 2])
    batched = lora.lora_delta_triton(x, slots, lora_a, lora_b, scaling)
    for t in range(5):
        alone = lora.lora_delta_triton(x[t : t + 1], slots[t : t + 1], lora_a, lora_b, scaling)
        assert torch.equal(batched[t : t + 1], alone)


def test_bad_shapes_are_value_errors() -> None:
    lora_a, lora_b, scaling = _adapters(2, 8, 16, 12)
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match="slots must be"):
        lora.lora_delta_triton(x, torch.tensor([0, 1]), lora_a, lora_b, scaling)
    with pytest.raises(ValueError, match="slots must be int32 or int64"):
        lora.lora_delta_triton(x, torch.tensor([0.0, 1.0, 0.0]), lora_a, lora_b, scaling)
    with pytest.raises(ValueError, match="disagree"):
        lora.lora_delta_triton(torch.randn(3, 17), torch.tensor([0, 1, 0]), lora_a, lora_b, scaling)
    with pytest.raises(ValueError, match="out must be"):
        lora.lora_delta_triton(x, torch.tensor([0, 1, 0]), lora_a, lora_b, scaling, out=torch.empty(3, 11))


def test_fused_projection_layout_matches_the_torch_path_and_each_shard() -> None:
    # A fused q|k|v as engine/layers/lora.py stacks it: the shards' A rows side by side, each
    # shard's B in its own block of output rows and rank columns. The kernel agrees with the
    # CPU torch path (the same contract) and with each shard applied on its own.
    from kvgate.engine.layers.lora import lora_delta_torch

    in_f, sizes, r = 24, [16, 8, 8], 4
    shards = [_adapters(2, r, in_f, n) for n in sizes]
    lora_a = torch.cat([a for a, _, _ in shards], dim=1)  # [S, 3r, in]
    lora_b = torch.zeros(2, sum(sizes), 3 * r)
    row = 0
    for i, (_, b, _) in enumerate(shards):
        lora_b[:, row : row + sizes[i], i * r : (i + 1) * r] = b
        row += sizes[i]
    scaling = shards[0][2]
    x = torch.randn(5, in_f)
    slots = torch.tensor([0, 1, -1, 1, 0])
    delta = lora.lora_delta_triton(x, slots, lora_a, lora_b, scaling)
    torch.testing.assert_close(
        delta, lora_delta_torch(x, slots, lora_a, lora_b, scaling), rtol=1e-5, atol=1e-5
    )
    per_shard = torch.cat([lora_delta_reference(x, slots, a, b, scaling) for a, b, _ in shards], dim=1)
    torch.testing.assert_close(delta.double(), per_shard, rtol=1e-5, atol=1e-5)
