"""LLMEngine over the simulated runner: prefix caching, preemption and abort, stats, outputs."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from kvgate.api.contracts.kv_events import BlockStored
from kvgate.engine.config import EngineConfig, SimulationConfig
from kvgate.engine.llm import LLM
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.sampling_params import SamplingParams

BS = 16


def _engine(tok: Any, **kw: Any) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 256)
    cfg = EngineConfig(simulate=True, block_size=BS, simulation=SimulationConfig(time_scale=0), **kw)
    return LLMEngine(cfg, tokenizer=tok)


def _run(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, RequestOutput]:
    """Step until done; checks that streamed deltas add up for requests that start here."""
    final: dict[str, RequestOutput] = {}
    streamed: dict[str, str] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if len(out.token_ids) == 1:
                streamed[out.request_id] = ""
            if out.request_id in streamed:
                streamed[out.request_id] += out.delta_text
                assert streamed[out.request_id] == out.text  # deltas add up to the cumulative text
            if out.finished:
                final[out.request_id] = out
    else:
        raise AssertionError("engine did not finish")
    return final


def _prompt(seed: int, n: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 104729) % 30000 for i in range(n)]


def _assert_no_leak(engine: LLMEngine) -> None:
    stats = engine.get_stats()
    assert stats.kv_cache_usage == 0.0 and stats.num_running == stats.num_waiting == 0
    assert all(b.ref_cnt == 0 for b in engine.kv.pool.blocks)


def test_a_shared_prefix_computes_only_the_new_blocks(tok: Any) -> None:
    engine = _engine(tok)
    shared = _prompt(1, 10 * BS)
    engine.add_request("a", [*shared, 5, 6, 7], SamplingParams(max_tokens=4))
    _run(engine)
    before = engine.get_stats()
    assert before.prefix_cache_hits_total == 0 and before.prefix_cache_queries_total == 163
    engine.add_request("b", [*shared, *_prompt(2, 2 * BS + 3)], SamplingParams(max_tokens=4))
    seen: list[int] = []
    batch_sizes = []
    while engine.has_unfinished_requests():
        batch = engine.scheduler.schedule()
        batch_sizes.append(batch.num_tokens)
        outs = engine.scheduler.update(batch, engine.runner.execute(batch))
        seen.extend(r.num_cached_tokens for r in outs)
    after = engine.get_stats()
    assert after.prefix_cache_hits_total == 10 * BS
    assert after.prefix_cache_queries_total - before.prefix_cache_queries_total == 10 * BS + 2 * BS + 3
    assert batch_sizes[0] == 2 * BS + 3  # only the new tokens were computed
    assert seen[0] == 10 * BS


def test_outputs_are_identical_with_prefix_caching_on_and_off(tok: Any) -> None:
    results = []
    for caching in (True, False):
        # Two at a time, so later requests arrive after the shared prefix has been computed.
        engine = _engine(tok, enable_prefix_caching=caching, max_num_seqs=2)
        shared = _prompt(3, 6 * BS)
        for i in range(6):
            engine.add_request(
                f"r{i}", [*shared, *_prompt(10 + i, 5 + i)], SamplingParams(max_tokens=12, seed=i)
            )
        results.append({k: (v.token_ids, v.text) for k, v in _run(engine).items()})
        stats = engine.get_stats()
        assert (stats.prefix_cache_hits_total > 0) == caching
        assert bool(engine.drain_kv_events()) == caching  # no cache, nothing to announce
        _assert_no_leak(engine)
    assert results[0] == results[1]


def test_tiny_pool_preemption_and_abort_give_the_same_outputs_without_leaks(tok: Any) -> None:
    def workload(engine: LLMEngine, abort: bool) -> dict[str, RequestOutput]:
        for i in range(8):
            engine.add_request(f"r{i}", _prompt(20 + i, 20 + 3 * i), SamplingParams(max_tokens=30 + i))
        if abort:
            engine.add_request("gone-waiting", _prompt(99, 40), SamplingParams(max_tokens=30))
            engine.add_request("gone-running", _prompt(98, 40), SamplingParams(max_tokens=30))
        final: dict[str, RequestOutput] = {}
        step = 0
        while engine.has_unfinished_requests():
            step += 1
            if abort and step == 3:
                assert engine.abort_request("gone-waiting") and engine.abort_request("gone-running")
                assert not engine.abort_request("never-added")
            final.update({o.request_id: o for o in engine.step() if o.finished})
            assert step < 5000
        return final

    roomy = _engine(tok, num_kv_blocks=512)
    baseline = workload(roomy, abort=False)
    assert roomy.get_stats().num_preemptions_total == 0
    tiny = _engine(tok, num_kv_blocks=12, max_num_batched_tokens=64)  # 192 tokens for ~600 wanted
    pressured = workload(tiny, abort=True)
    assert tiny.get_stats().num_preemptions_total > 0
    assert set(pressured) == set(baseline)  # aborted requests produce no final output
    for rid, out in baseline.items():
        assert pressured[rid].token_ids == out.token_ids and pressured[rid].text == out.text
        assert pressured[rid].finish_reason == "length"
    _assert_no_leak(tiny)
    _assert_no_leak(roomy)


def test_stats_count_tokens_and_requests(tok: Any) -> None:
    engine = _engine(tok, max_num_seqs=2)
    for i in range(3):
        engine.add_request(f"r{i}", _prompt(i, 10), SamplingParams(max_tokens=5))
    first = engine.step()
    assert all(o.num_cached_tokens == 0 and len(o.token_ids) == 1 for o in first)
    s = engine.get_stats()
    assert (s.num_running, s.num_waiting) == (2, 1)
    assert 0 < s.kv_cache_usage <= 2 / 256 and s.num_kv_blocks == 256 and s.block_size == BS
    _run(engine)
    s = engine.get_stats()
    assert s.prompt_tokens_total == 30 and s.generation_tokens_total == 15
    _assert_no_leak(engine)


def test_kv_events_describe_computed_blocks_and_reset(tok: Any) -> None:
    engine = _engine(tok)
    prompt = _prompt(5, 2 * BS + 1)
    engine.add_request("a", prompt, SamplingParams(max_tokens=BS))
    _run(engine)
    events = engine.drain_kv_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    tokens = [t for e in stored for t in e.token_ids]
    assert tokens[: 2 * BS] == prompt[: 2 * BS] and len(tokens) == 3 * BS  # + the decoded block
    assert stored[0].parent_block_hash is None
    for prev, cur in itertools.pairwise(stored):
        assert cur.parent_block_hash == prev.block_hashes[-1]
    assert engine.reset_prefix_cache()
    assert engine.drain_kv_events()[-1].__class__.__name__ == "AllBlocksCleared"


def test_stop_strings_logprobs_and_finish_reasons(tok: Any) -> None:
    engine = _engine(tok)
    engine.add_request("probe", _prompt(7, 8), SamplingParams(max_tokens=10, logprobs=3))
    probe = _run(engine)["probe"]
    assert probe.finish_reason == "length" and len(probe.token_ids) == 10
    assert probe.logprobs is not None and len(probe.logprobs) == 10
    for pos, tid in zip(probe.logprobs, probe.token_ids, strict=True):
        assert pos.sampled.token_id == tid and pos.sampled.logprob < 0
        assert len(pos.top) == 3 and [t.logprob for t in pos.top] == sorted(
            (t.logprob for t in pos.top), reverse=True
        )
        assert pos.sampled.decoded == tok.decode([tid])
    assert probe.cumulative_logprob == pytest.approx(sum(p.sampled.logprob for p in probe.logprobs))
    word = probe.text.split()[3]
    engine.add_request("probe", _prompt(7, 8), SamplingParams(max_tokens=10, stop=[word]))
    cut = _run(engine)["probe"]
    assert cut.finish_reason == "stop" and cut.stop_reason == word
    assert cut.text == probe.text[: probe.text.index(word)]
    engine.add_request(
        "probe", _prompt(7, 8), SamplingParams(max_tokens=10, stop_token_ids=[probe.token_ids[2]])
    )
    cut = _run(engine)["probe"]
    assert cut.token_ids == probe.token_ids[:3] and cut.stop_reason == probe.token_ids[2]
    assert cut.text == tok.decode(probe.token_ids[:2])


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "at least one token"),
        ([1] * 4096, SamplingParams(), "maximum context length is 4096"),
        ([1, 2], SamplingParams(n=2), "n > 1"),
        ([1, 2], SamplingParams(temperature=-1), "temperature"),
        ([1, 10**9], SamplingParams(), "out of vocabulary"),
    ],
)
def test_bad_requests_are_rejected_with_a_message(
    tok: Any, prompt: list[int], params: SamplingParams, message: str
) -> None:
    engine = _engine(tok, max_model_len=4096)
    with pytest.raises(ValueError, match=message):
        engine.add_request("x", prompt, params)
    assert not engine.has_unfinished_requests()


def test_duplicate_request_id_is_rejected(tok: Any) -> None:
    engine = _engine(tok)
    engine.add_request("x", [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [1, 2], SamplingParams())


def test_max_model_len_is_capped_by_the_pool(tok: Any) -> None:
    engine = _engine(tok, num_kv_blocks=4)
    assert engine.max_model_len == 4 * BS


def test_offline_llm_generate_and_chat(tok: Any) -> None:
    llm = LLM(simulate=True, tokenizer=tok, simulation=SimulationConfig(time_scale=0))
    outs = llm.generate(["Hello", "Bonjour à tous"], SamplingParams(max_tokens=7, seed=1))
    assert [o.prompt for o in outs] == ["Hello", "Bonjour à tous"]
    assert outs[1].prompt_token_ids == tok.encode("Bonjour à tous")
    assert all(len(o.outputs[0].token_ids) == 7 and o.outputs[0].finish_reason == "length" for o in outs)
    assert outs[0].outputs[0].text == tok.decode(outs[0].outputs[0].token_ids)
    by_ids = llm.generate([outs[0].prompt_token_ids], SamplingParams(max_tokens=7, seed=1))
    assert by_ids[0].prompt is None and by_ids[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    as_dicts = llm.generate(
        [{"prompt": "Hello"}, {"prompt_token_ids": outs[0].prompt_token_ids}],
        SamplingParams(max_tokens=7, seed=1),
    )
    assert [o.outputs[0].token_ids for o in as_dicts] == [outs[0].outputs[0].token_ids] * 2

    fan = llm.generate("Hi", SamplingParams(n=3, max_tokens=5, seed=42))[0]
    assert [c.index for c in fan.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in fan.outputs}) == 3
    again = llm.generate("Hi", SamplingParams(n=3, max_tokens=5, seed=42))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in fan.outputs]

    chat = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}], SamplingParams(max_tokens=3)
    )
    rendered = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert chat[0].prompt == rendered and rendered.endswith("<|im_start|>assistant\n")
    assert chat[0].prompt_token_ids == tok.encode(rendered)
    two = llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]])
    assert len(two) == 2
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["x"], [SamplingParams(), SamplingParams()])
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(simulate=True, tokenizer=tok, no_such_option=1)
    _assert_no_leak(llm.engine)


def test_without_chunked_prefill_every_sequence_fits_one_step(tok: Any) -> None:
    engine = _engine(tok, enable_chunked_prefill=False, max_num_batched_tokens=64, num_kv_blocks=64)
    assert engine.max_model_len == 64  # a preempted sequence must be recomputable in one step
    with pytest.raises(ValueError, match="maximum context length is 64"):
        engine.add_request("long", _prompt(1, 64), SamplingParams())
    for i in range(3):
        engine.add_request(f"r{i}", _prompt(i, 40), SamplingParams(max_tokens=30, ignore_eos=True))
    outs = _run(engine)
    assert {k: (len(v.token_ids), v.finish_reason) for k, v in outs.items()} == {
        "r0": (24, "length"),  # 40 + 24 = max_model_len
        "r1": (24, "length"),
        "r2": (24, "length"),
    }
    _assert_no_leak(engine)


def test_n_samples_of_one_prompt_compute_it_once(tok: Any) -> None:
    llm = LLM(simulate=True, tokenizer=tok, block_size=BS, simulation=SimulationConfig(time_scale=0))
    prompt = _prompt(9, 5 * BS + 3)
    out = llm.generate([prompt], SamplingParams(n=4, max_tokens=3, seed=7))[0]
    assert len(out.outputs) == 4 and out.num_cached_tokens == 5 * BS
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits_total == 3 * 5 * BS  # samples 2..4 reuse sample 1's blocks
    _assert_no_leak(llm.engine)


def test_timing_fields_and_progress_bar(tok: Any, capsys: pytest.CaptureFixture[str]) -> None:
    engine = _engine(tok)
    engine.add_request("t", _prompt(3, 20), SamplingParams(max_tokens=3), arrival_time=100.0)
    outs = []
    while engine.has_unfinished_requests():
        outs.extend(engine.step())
    first, last = outs[0], outs[-1]
    assert first.arrival_time == 100.0 and first.first_token_time is not None and first.finished_time is None
    assert last.finished and last.finished_time is not None and last.finished_time >= last.first_token_time
    llm = LLM(simulate=True, tokenizer=tok, simulation=SimulationConfig(time_scale=0))
    llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err


def test_a_rejected_prompt_leaves_no_request_behind(tok: Any) -> None:
    llm = LLM(simulate=True, tokenizer=tok, max_model_len=64, simulation=SimulationConfig(time_scale=0))
    with pytest.raises(ValueError, match="maximum context length is 64"):
        llm.generate([[1, 2, 3], list(range(100, 200))], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].outputs[0].finish_reason == "length"
    _assert_no_leak(llm.engine)


def test_a_steps_prompt_blocks_are_announced_before_its_forward_pass(tok: Any) -> None:
    """A router learns where a long prompt's blocks live when the step that computes them starts
    (the server publishes in `on_scheduled`), not after a prefill that may take most of a second."""
    engine = _engine(tok, max_num_batched_tokens=64)
    engine.add_request("r", list(range(100, 200)), SamplingParams(max_tokens=2))
    executed: list[bool] = []
    execute = engine.runner.execute

    def watched(batch: Any) -> Any:
        executed.append(True)
        return execute(batch)

    engine.runner.execute = watched  # type: ignore[method-assign]
    seen: list[BlockStored] = []

    def on_scheduled() -> None:
        assert not executed  # before the forward pass
        seen.extend(e for e in engine.drain_kv_events() if isinstance(e, BlockStored))

    engine.step(on_scheduled=on_scheduled)
    assert executed and sum(len(e.block_hashes) for e in seen) == 64 // BS  # the first chunk's blocks


@pytest.mark.parametrize("model", ["default", "org/not-on-this-machine"])
def test_simulate_without_any_tokenizer_says_to_mount_a_model_or_pass_tokenizer(
    model: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """As in the engine image: no model mounted, no default-model package, no Hub access."""
    from kvgate.api import tokenizer as tokenizer_module
    from kvgate.engine.server.launcher import ServeError, build_engine

    monkeypatch.setattr(tokenizer_module, "_DEFAULT_MODEL_PACKAGE", "kvgate_no_such_model_package")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path))
    with pytest.raises(ServeError) as err:
        build_engine(EngineConfig(model=model, simulate=True, simulation=SimulationConfig(time_scale=0)))
    message = str(err.value)
    assert "--simulate needs a tokenizer" in message
    assert "mount a model" in message and "--tokenizer" in message
    assert "pip install" not in message
