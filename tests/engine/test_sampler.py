"""The sampler: greedy, seeds, top-k / top-p / min-p supports, sampling frequencies, logprobs."""

from __future__ import annotations

import pytest
import torch

from kvgate.engine.layers.sampler import Sampler, SampleRequest
from kvgate.engine.sampling_params import SamplingParams

PROBS = torch.tensor([0.05, 0.5, 0.0, 0.3, 0.15])  # token 2 impossible
LOGITS = torch.log(PROBS.clamp_min(1e-30))


def _sampler(**kw: object) -> Sampler:
    return Sampler(torch.device("cpu"), seed=0, **kw)  # type: ignore[arg-type]


def _draw(
    params: SamplingParams, n: int = 4000, logits: torch.Tensor = LOGITS, sampler: Sampler | None = None
) -> list[int]:
    s = sampler or _sampler()
    rows = [SampleRequest(f"r{i}", params) for i in range(n)]
    return [t.token_id for t in s(logits.expand(n, -1).clone(), rows)]


def test_greedy_takes_the_argmax_and_ignores_seed_noise() -> None:
    logits = torch.randn(6, 50)
    rows = [SampleRequest(f"r{i}", SamplingParams(temperature=0.0, seed=i)) for i in range(6)]
    out = _sampler()(logits, rows)
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()
    assert [t.request_id for t in out] == [f"r{i}" for i in range(6)]
    assert all(t.logprob is None and t.top_logprobs is None for t in out)


def test_top_k_1_is_greedy_even_at_high_temperature() -> None:
    assert set(_draw(SamplingParams(temperature=5.0, top_k=1), n=200)) == {1}


def test_unrestricted_sampling_follows_the_distribution() -> None:
    n = 8000
    counts = torch.bincount(torch.tensor(_draw(SamplingParams(temperature=1.0), n=n)), minlength=5).float()
    freq = counts / n
    assert counts[2] == 0
    # 5 sigma of a binomial proportion at n=8000 is < 0.028
    assert torch.allclose(freq, PROBS, atol=0.03), freq


def test_temperature_sharpens_and_flattens() -> None:
    cold = torch.tensor(_draw(SamplingParams(temperature=0.3)))
    hot = torch.tensor(_draw(SamplingParams(temperature=3.0)))
    assert (cold == 1).float().mean() > 0.8
    assert (hot == 1).float().mean() < 0.45


@pytest.mark.parametrize(
    ("params", "support"),
    [
        (SamplingParams(top_k=2), {1, 3}),
        (SamplingParams(top_k=3), {1, 3, 4}),
        (SamplingParams(top_p=0.8), {1, 3}),  # 0.5 + 0.3 reaches 0.8: the smallest such set
        (SamplingParams(top_p=0.81), {1, 3, 4}),
        (SamplingParams(top_p=0.3), {1}),
        (SamplingParams(min_p=0.2), {1, 3, 4}),  # threshold 0.2 * 0.5 = 0.1
        (SamplingParams(min_p=0.7), {1}),
        (SamplingParams(top_k=3, top_p=0.6), {1, 3}),  # top-p over the renormalised top-3
    ],
)
def test_masks_leave_exactly_the_expected_support(params: SamplingParams, support: set[int]) -> None:
    assert set(_draw(params, n=3000)) == support


def test_mixed_batch_applies_each_rows_own_parameters() -> None:
    params = [
        SamplingParams(top_k=2),
        SamplingParams(temperature=0.0),
        SamplingParams(top_p=0.3),
        SamplingParams(),
    ]
    n = 600
    rows = [SampleRequest(f"r{i}", params[i % 4]) for i in range(4 * n)]
    tokens = [t.token_id for t in _sampler()(LOGITS.expand(4 * n, -1).clone(), rows)]
    assert set(tokens[0::4]) == {1, 3}
    assert set(tokens[1::4]) == {1}
    assert set(tokens[2::4]) == {1}
    assert set(tokens[3::4]) == {0, 1, 3, 4}


def test_seeded_requests_are_reproducible_whatever_the_batch() -> None:
    logits = torch.randn(1, 1000)
    params = SamplingParams(temperature=1.0, seed=42)

    def alone(step: int) -> int:
        return _sampler()(logits.clone(), [SampleRequest("a", params, step)])[0].token_id

    def in_crowd(step: int) -> int:
        crowd = torch.cat([torch.randn(5, 1000), logits, torch.randn(3, 1000)])
        rows = [SampleRequest(f"x{i}", SamplingParams(temperature=1.0)) for i in range(5)]
        rows.append(SampleRequest("a", params, step))
        rows += [SampleRequest(f"y{i}", SamplingParams(seed=i)) for i in range(3)]
        return Sampler(torch.device("cpu"), seed=99)(crowd, rows)[5].token_id

    sequence = [alone(step) for step in range(20)]
    assert sequence == [in_crowd(step) for step in range(20)]
    assert len(set(sequence)) > 5  # successive positions draw fresh noise
    other_seed = [
        _sampler()(logits.clone(), [SampleRequest("a", SamplingParams(seed=43), s)])[0].token_id
        for s in range(20)
    ]
    assert other_seed != sequence


def test_seeded_sampling_still_follows_the_distribution() -> None:
    tokens = [
        _sampler()(LOGITS[None].clone(), [SampleRequest("a", SamplingParams(seed=seed))])[0].token_id
        for seed in range(1500)
    ]
    freq = torch.bincount(torch.tensor(tokens), minlength=5).float() / len(tokens)
    assert torch.allclose(freq, PROBS, atol=0.06), freq


def test_unseeded_sampling_depends_on_the_engine_seed_only() -> None:
    params = SamplingParams(temperature=1.0)
    logits = torch.randn(8, 300)
    rows = [SampleRequest(f"r{i}", params) for i in range(8)]

    def run(seed: int) -> list[int]:
        return [t.token_id for t in Sampler(torch.device("cpu"), seed=seed)(logits.clone(), rows)]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_logprobs_are_log_softmax_of_raw_logits() -> None:
    logits = torch.randn(3, 40) * 3
    rows = [
        SampleRequest("greedy", SamplingParams(temperature=0.0, logprobs=4)),
        SampleRequest("hot", SamplingParams(temperature=2.0, top_k=5, logprobs=2, seed=3)),
        SampleRequest("none", SamplingParams(temperature=0.0)),
    ]
    out = _sampler()(logits.clone(), rows)
    ref = logits.log_softmax(-1)
    for i, t in enumerate(out[:2]):
        n = rows[i].params.logprobs
        assert t.logprob == pytest.approx(ref[i, t.token_id].item(), abs=1e-5)
        top = ref[i].topk(n)
        assert t.top_logprobs is not None
        assert [tid for tid, _ in t.top_logprobs] == top.indices.tolist()
        assert [lp for _, lp in t.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert out[2].logprob is None and out[2].top_logprobs is None


def test_logprobs_zero_reports_only_the_sampled_token() -> None:
    out = _sampler()(torch.randn(1, 10), [SampleRequest("a", SamplingParams(temperature=0.0, logprobs=0))])
    assert out[0].logprob is not None and out[0].top_logprobs == []


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.full((1, 10), -5.0)
    logits[0, 7] = 10.0  # EOS is by far the most likely
    logits[0, 3] = 9.0  # a request stop id comes next
    logits[0, 5] = 1.0
    sampler = _sampler(stop_token_ids_for_min_tokens={7})
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    assert sampler(logits.clone(), [SampleRequest("a", params, num_generated=1)])[0].token_id == 5
    assert sampler(logits.clone(), [SampleRequest("a", params, num_generated=2)])[0].token_id == 7
