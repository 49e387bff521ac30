"""Speculative decoding without a model: the n-gram proposer, the config, the verifiers (greedy
and rejection sampling, statistically), and the scheduler's KV accounting on the simulated
runner (drafts accepted and rejected, no leaked block, only accepted tokens ever cached)."""

from __future__ import annotations

import dataclasses
import itertools
import re
import subprocess
import sys
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvgate.api.contracts.kv_events import BlockStored
from kvgate.engine.config import EngineConfig, SimulationConfig
from kvgate.engine.layers.sampler import Sampler, SampleRequest
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.server.metrics import CacheConfigInfo, EngineMetrics, StatsSnapshot
from kvgate.engine.sim_runner import SimulatedRunner
from kvgate.engine.spec_decode import SpeculativeConfig, SpeculativeConfigError, propose_ngram
from kvgate.engine.spec_decode.verify import accept_greedy, rejection_sample

BS = 4

# -- the proposer ------------------------------------------------------------------------------


def test_proposer_takes_the_longest_suffix_and_its_most_recent_occurrence() -> None:
    #        0  1  2  3  4  5  6  7  8  9
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 8, 2, 3]
    # suffix [2, 3] (n=2) last occurred at 5..6, followed by 7, 8, 2, 3
    assert propose_ngram(seq, 3, 1, 2) == [7, 8, 2]
    # n=3 ([9, 2, 3]... no: suffix [8, 2, 3]) never occurred: falls back to n=2
    assert propose_ngram(seq, 2, 1, 3) == [7, 8]
    # a longer match wins over a more recent shorter one
    seq2 = [5, 6, 7, 1, 0, 7, 2, 5, 6, 7]
    assert propose_ngram(seq2, 2, 1, 3) == [1, 0]  # [5, 6, 7] at 0; not [7] at 5 -> [2, 5]
    assert propose_ngram(seq2, 2, 1, 1) == [2, 5]  # n=1: [7] most recently at 5


def test_proposer_edge_cases() -> None:
    assert propose_ngram([], 4, 1, 4) == []
    assert propose_ngram([3], 4, 1, 4) == []
    assert propose_ngram([1, 2, 3, 4], 4, 1, 4) == []  # nothing repeats
    assert propose_ngram([1, 2, 3, 4], 0, 1, 4) == []
    assert propose_ngram([7, 7], 4, 1, 4) == [7]  # follow-up may run into the suffix itself
    assert propose_ngram([1, 2, 1, 2], 5, 2, 2) == [1, 2]  # fewer than k tokens follow
    assert propose_ngram([1, 2, 3, 1], 3, 2, 4) == []  # only a 1-gram repeats, min_n is 2


# -- the config --------------------------------------------------------------------------------


def test_config_parses_vllm_json_and_rejects_what_it_cannot_do() -> None:
    cfg = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}'
    )
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (4, 4, 1)
    one = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
    )
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)
    for bad, words in [
        ("{", "not valid JSON"),
        ("[1]", "JSON object"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "not supported"),
        ('{"num_speculative_tokens": 2}', "not supported"),
        ('{"method": "ngram"}', "required"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": "1"}', "prompt_lookup_min"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}',
            "exceeds",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "for the draft_model method"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "speculative_model": "x"}', "unknown key"),
        ('{"method": "draft_model", "num_speculative_tokens": 2, "prompt_lookup_max": 2}', "for the ngram"),
        ('{"method": "draft_model", "num_speculative_tokens": 2, "model": 3}', "model must be"),
        ('{"method": "draft_model", "num_speculative_tokens": 2, "draft_num_layers": 0}', "draft_num_layers"),
    ]:
        with pytest.raises(SpeculativeConfigError, match=words):
            SpeculativeConfig.from_json(bad)
    draft = SpeculativeConfig.from_json(
        '{"method": "draft_model", "model": "org/small", "num_speculative_tokens": 3, "draft_num_layers": 6}'
    )
    assert (draft.method, draft.model, draft.draft_num_layers, draft.num_speculative_tokens) == (
        "draft_model",
        "org/small",
        6,
        3,
    )
    assert SpeculativeConfig.from_json('{"method": "draft_model", "num_speculative_tokens": 2}').model is None
    assert EngineConfig().speculative_config is None  # off by default


def test_cli_prints_one_line_and_exits_2_on_a_bad_config() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvgate",
            "engine",
            "serve",
            "--simulate",
            "--speculative-config",
            '{"method": "eagle"}',
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "method 'eagle' is not supported" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


# -- the verifiers -----------------------------------------------------------------------------


def test_greedy_acceptance() -> None:
    assert accept_greedy([5, 6, 7], [5, 6]) == [5, 6, 7]  # all accepted, then the bonus token
    assert accept_greedy([5, 9, 7], [5, 6]) == [5, 9]  # mismatch: the target's token
    assert accept_greedy([4, 9, 7], [5, 6]) == [4]
    assert accept_greedy([3], []) == [3]


def test_rejection_sampling_reproduces_the_target_distribution() -> None:
    """Point-mass drafts, a fixed target: the first output token is distributed as p whatever
    the draft (likely, unlikely, impossible), and so is the token after an accepted draft."""
    p = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    q = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    probs = torch.stack([p, q])
    n = 20_000
    for draft in (0, 3, 4):
        first = torch.zeros(5)
        second = torch.zeros(5)
        accepted = 0
        for i in range(n):
            g = torch.Generator().manual_seed(i)
            out = rejection_sample(probs, [draft], [g, g])
            first[out[0]] += 1
            if len(out) == 2:
                assert out[0] == draft
                accepted += 1
                second[out[1]] += 1
        assert torch.allclose(first / n, p, atol=0.015), (draft, first / n)
        assert accepted / n == pytest.approx(float(p[draft]), abs=0.015)
        if accepted > 2000:
            assert torch.allclose(second / accepted, q, atol=0.025), (draft, second / accepted)


def test_sampler_verify_is_seeded_and_honours_min_tokens_per_position() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 16)
    eos = int(logits[1].argmax())
    sampler = Sampler(torch.device("cpu"), seed=1, stop_token_ids_for_min_tokens=[eos])
    greedy = SamplingParams(temperature=0, min_tokens=2)
    drafts = [int(logits[0].argmax()), eos]
    # row 1 is the 2nd generated token (num_generated 0 + 1 < min_tokens 2): EOS is masked
    out = sampler.verify(logits, [(SampleRequest("a", greedy, 0), drafts)])[0]
    assert out.token_ids[0] == drafts[0] and out.token_ids[1] != eos
    assert (
        sampler.verify(logits, [(SampleRequest("a", SamplingParams(temperature=0), 0), drafts)])[0].token_ids[
            :2
        ]
        == drafts
    )
    seeded = SamplingParams(temperature=1.0, seed=7)
    runs = {
        tuple(sampler.verify(logits, [(SampleRequest("b", seeded, 3), [1, 2])])[0].token_ids)
        for _ in range(5)
    }
    assert len(runs) == 1


# -- the scheduler on the simulated runner -----------------------------------------------------


class PatternRunner(SimulatedRunner):
    """A fake model whose answer repeats a short cycle with a deviation every `every` tokens:
    n-gram drafts are mostly right and sometimes wrong, so steps accept and reject."""

    def __init__(self, cfg: EngineConfig, every: int = 7) -> None:
        super().__init__(cfg)
        self.every = every

    def _token(self, params: SamplingParams, key: int, pos: int) -> tuple[int, int]:
        cycle = [300, 301, 302, 303, 304]
        token = 400 + pos % 3 if pos % self.every == self.every - 1 else cycle[pos % len(cycle)]
        return token, key


def _sim_engine(spec: SpeculativeConfig | None, **kw: Any) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 64)
    cfg = EngineConfig(
        simulate=True,
        block_size=BS,
        max_model_len=256,
        simulation=SimulationConfig(time_scale=0),
        speculative_config=spec,
        **kw,
    )
    return LLMEngine(cfg, runner=PatternRunner(cfg), tokenizer=_Tok())


class _Tok:
    eos_token_id = 2
    eos_token_ids = (2,)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)


def _run_checked(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, list[int]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    kv = engine.kv
    out: dict[str, list[int]] = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.token_ids
        for req in engine.scheduler.running:
            # only full blocks of computed (accepted) tokens are findable; no block is held
            # past what the next step's token needs
            assert kv._num_registered[req.request_id] * BS <= req.num_computed_tokens < req.num_tokens
            assert len(req.block_ids) <= kv.blocks_needed(req.num_tokens)
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().kv_cache_usage == 0.0
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    return out


def _stored_prefixes(engine: LLMEngine) -> list[list[int]]:
    """Every BlockStored block's whole token prefix, following its parents."""
    blocks: dict[int, tuple[int | None, list[int]]] = {}
    for event in engine.drain_kv_events():
        if isinstance(event, BlockStored):
            parent = event.parent_block_hash
            for i, h in enumerate(event.block_hashes):
                blocks[h] = (parent, event.token_ids[i * BS : (i + 1) * BS])
                parent = h
    prefixes = []
    for h in blocks:
        tokens: list[int] = []
        cur: int | None = h
        while cur is not None:
            parent, own = blocks[cur]
            tokens = own + tokens
            cur = parent
        prefixes.append(tokens)
    return prefixes


def test_speculation_changes_no_token_leaks_no_block_and_caches_only_accepted_tokens() -> None:
    prompt = [300, 301, 302, 303, 304, 300, 301, 11, 12]
    requests = {
        "long": (prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)),
        "short": (prompt[:7], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)),
        "stop": (prompt, SamplingParams(temperature=0, max_tokens=60, stop_token_ids=[402])),
        "seeded": ([5, 6, 7, 300], SamplingParams(temperature=0.8, seed=3, max_tokens=33, ignore_eos=True)),
    }
    plain = _run_checked(_sim_engine(None), requests)
    engine = _sim_engine(SPEC)
    spec = _run_checked(engine, requests)
    assert spec == plain
    assert len(spec["long"]) == 60 and len(spec["short"]) == 9
    assert spec["stop"][-1] == 402 and 402 not in spec["stop"][:-1]
    stats = engine.get_stats()
    assert stats.spec_num_drafts_total > 0
    assert 0 < stats.spec_num_accepted_tokens_total < stats.spec_num_draft_tokens_total  # some rejected
    assert sum(stats.spec_accepted_per_pos_total) == stats.spec_num_accepted_tokens_total
    per_pos = stats.spec_accepted_per_pos_total
    assert all(a >= b for a, b in itertools.pairwise(per_pos))
    assert stats.generation_tokens_total == sum(len(v) for v in spec.values())
    finals = [requests[r][0] + spec[r] for r in requests]
    for tokens in _stored_prefixes(engine):
        assert any(f[: len(tokens)] == tokens for f in finals), tokens


def test_a_stop_string_truncates_a_multi_token_step() -> None:
    prompt = [300, 301, 302, 303, 304, 300, 301, 11, 12]
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, stop=["<304><300>"])
    outs = {}
    for spec in (None, SPEC):
        engine = _sim_engine(spec)
        outs[spec is None] = _run_checked(engine, {"a": (prompt, params)})["a"]
    assert outs[True] == outs[False]
    assert outs[True][-2:] == [304, 300]


def test_a_short_pool_gets_fewer_drafts_not_preemptions() -> None:
    prompt = [300, 301, 302, 303, 304, 300, 301, 11, 12]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    requests = {f"r{i}": (prompt, params) for i in range(3)}
    plain = _run_checked(_sim_engine(None, num_kv_blocks=40), requests)
    engine = _sim_engine(SPEC, num_kv_blocks=40)
    assert _run_checked(engine, requests) == plain
    assert engine.get_stats().spec_num_drafts_total > 0


def _finals(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, RequestOutput]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    out: dict[str, RequestOutput] = {}
    streamed: dict[str, list[Any]] = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            streamed.setdefault(o.request_id, []).extend(o.new_logprobs or [])
            assert o.logprobs is None or len(o.logprobs) == len(o.token_ids)
            if o.finished:
                out[o.request_id] = o
    assert not engine.has_unfinished_requests()
    assert engine.get_stats().kv_cache_usage == 0.0
    for rid, o in out.items():
        assert o.logprobs is None or streamed[rid] == o.logprobs  # each position streamed once
    return out


def test_requests_with_logprobs_speculate_and_report_each_tokens_logprobs() -> None:
    prompt = [300, 301, 302, 303, 304, 300, 301]
    requests = {
        "lp": (prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)),
        "lp0": (prompt, SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, logprobs=0)),
        "stop": (prompt, SamplingParams(temperature=0, max_tokens=40, logprobs=1, stop=["<304><300>"])),
        "prompt_lp": (
            prompt,
            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=1),
        ),
    }
    plain = _finals(_sim_engine(None), requests)
    engine = _sim_engine(SPEC)
    spec = _finals(engine, requests)
    for rid in requests:
        a, b = plain[rid], spec[rid]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), rid
        assert b.logprobs == a.logprobs and b.cumulative_logprob == a.cumulative_logprob, rid
        assert b.prompt_logprobs == a.prompt_logprobs, rid
    assert [len(p.top) for p in spec["lp"].logprobs or []] == [2] * 30
    assert spec["stop"].token_ids[-2:] == [304, 300]
    stats = engine.get_stats()
    assert stats.spec_num_drafts_total > 0 and stats.spec_num_accepted_tokens_total > 0


def test_sampler_verify_masks_each_position_and_reports_logprobs_as_plain_sampling() -> None:
    """Row i of a constrained seq is masked with bitmask row `bitmask_row + i`, and the tokens
    returned carry the logprobs plain sampling of those rows reports."""
    torch.manual_seed(0)
    vocab = 64
    logits = torch.randn(3, vocab)
    fav = [int(r.argmax()) for r in logits]
    allowed = [(fav[0] + 1) % vocab, fav[1], (fav[2] + 5) % vocab]
    mask = torch.zeros(4, 2, dtype=torch.int32)  # row 0 unused: the seq's rows start at 1
    for i, t in enumerate(allowed):
        mask[1 + i, t >> 5] = 1 << (t & 31)
    sampler = Sampler(torch.device("cpu"))
    params = SamplingParams(temperature=0, logprobs=3)
    # draft 0 is the raw favourite, which the grammar forbids: rejected for the allowed token
    out = sampler.verify(logits, [(SampleRequest("a", params, 0, bitmask_row=1), [fav[0], fav[1]])], mask)[0]
    assert out.token_ids == [allowed[0]]
    # drafts the grammar allows are accepted position by position, each under its own row
    out = sampler.verify(logits, [(SampleRequest("a", params, 0, bitmask_row=1), allowed[:2])], mask)[0]
    assert out.token_ids == allowed
    plain = [
        sampler(logits[i : i + 1], [SampleRequest("a", params, i, bitmask_row=1 + i)], mask)[0]
        for i in range(3)
    ]
    assert [p.token_id for p in plain] == allowed
    assert out.logprob == plain[0].logprob and out.top_logprobs == plain[0].top_logprobs
    assert out.more_logprobs == [(p.logprob, p.top_logprobs) for p in plain[1:]]


class WordCycleRunner(SimulatedRunner):
    """A fake model that says " the cat sat on the mat" over and over, with " dog" (which the
    test's grammar forbids) every 7th token: n-gram drafts from a prompt that has " dog" in it
    propose it, and the grammar must cut them there."""

    def __init__(self, cfg: EngineConfig, tok: Any) -> None:
        super().__init__(cfg, tok, eos_token_id=tok.eos_token_id)
        self.cycle = [tok.encode(w)[0] for w in (" the", " cat", " sat", " on", " the", " mat")]
        self.dog = tok.encode(" dog")[0]

    def _token(self, params: SamplingParams, key: int, pos: int) -> tuple[int, int]:
        return (self.dog if pos % 7 == 6 else self.cycle[pos % len(self.cycle)]), key ^ pos


def test_structured_outputs_speculate_only_over_what_the_grammar_allows(tok: Any) -> None:
    from kvgate.engine.spec_decode.ngram import propose_ngram
    from kvgate.engine.structured import StructuredOutputSpec

    words = r"( the| cat| sat| on| mat){1,24}\."
    spec_cfg = SpeculativeConfig(
        num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1, adaptive=False
    )
    prompt = tok.encode("the cat sat on the dog the cat sat on the mat")

    def engine(spec: SpeculativeConfig | None) -> LLMEngine:
        cfg = EngineConfig(
            simulate=True,
            block_size=BS,
            max_model_len=256,
            num_kv_blocks=64,
            simulation=SimulationConfig(time_scale=0),
            speculative_config=spec,
        )
        return LLMEngine(cfg, runner=WordCycleRunner(cfg, tok), tokenizer=tok)

    requests = {
        "re": (
            prompt,
            SamplingParams(
                temperature=0, max_tokens=40, structured_outputs=StructuredOutputSpec.regex(words)
            ),
        ),
        "re_lp": (
            prompt,
            SamplingParams(
                temperature=0, max_tokens=40, logprobs=1, structured_outputs=StructuredOutputSpec.regex(words)
            ),
        ),
        "free": (prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
    }
    plain = _finals(engine(None), requests)
    eng = engine(spec_cfg)
    cut = 0
    accepted: dict[str, int] = {}
    schedule = eng.scheduler.schedule

    def spy() -> Any:
        pending = {r.request_id: list(r.all_token_ids) for r in eng.scheduler.running}
        batch = schedule()
        for seq in batch.seqs:
            request = eng.scheduler.requests[seq.request_id]
            accepted[seq.request_id] = request.spec_num_accepted_tokens
            if request.grammar is None or not seq.draft_token_ids:
                continue
            raw = propose_ngram(pending[seq.request_id], 4, 1, 3)
            valid = request.grammar.valid_drafts(raw)
            assert (
                seq.draft_token_ids == raw[: len(seq.draft_token_ids)] and len(seq.draft_token_ids) <= valid
            )
            nonlocal cut
            cut += valid < len(raw)
        return batch

    eng.scheduler.schedule = spy  # type: ignore[method-assign]
    spec = _finals(eng, requests)
    for rid in requests:
        a, b = plain[rid], spec[rid]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason), rid
        assert b.logprobs == a.logprobs, rid
    assert re.fullmatch(words, spec["re"].text) and spec["re"].finish_reason == "stop"
    assert tok.encode(" dog")[0] in spec["free"].token_ids  # the unconstrained one says it
    assert cut > 0, "no proposal was cut by the grammar"
    assert accepted["re"] > 0 and accepted["re_lp"] > 0, accepted  # constrained drafts accepted


def test_spec_metrics_have_vllms_names() -> None:
    metrics = EngineMetrics("m", CacheConfigInfo(BS, 64, True), num_speculative_tokens=2)
    with metrics.lock:
        metrics.update(
            StatsSnapshot(
                spec_num_drafts_total=3,
                spec_num_draft_tokens_total=6,
                spec_num_accepted_tokens_total=4,
                spec_accepted_per_pos_total=(3, 1),
            )
        )
    families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
    # prometheus_client's parser drops a counter's _total suffix from the family name
    values = {
        name: {s.labels.get("position"): s.value for s in families[name].samples}
        for name in (
            "vllm:spec_decode_num_drafts",
            "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens",
            "vllm:spec_decode_num_accepted_tokens_per_pos",
        )
    }
    assert all(families[n].type == "counter" for n in values)
    assert values["vllm:spec_decode_num_drafts"] == {None: 3}
    assert values["vllm:spec_decode_num_draft_tokens"] == {None: 6}
    assert values["vllm:spec_decode_num_accepted_tokens"] == {None: 4}
    assert values["vllm:spec_decode_num_accepted_tokens_per_pos"] == {"0": 3, "1": 1}
    off = EngineMetrics("m", CacheConfigInfo(BS, 64, True)).render().decode()
    assert "spec_decode" not in off


class _OracleProposer:
    """A draft_model stand-in: proposes PatternRunner's own next tokens (a perfect draft) for
    requests with even ids, none for odd; records what it was asked and released."""

    def __init__(self, runner: PatternRunner) -> None:
        self.runner = runner
        self.prompt_len: dict[str, int] = {}
        self.asked: list[tuple[str, int]] = []
        self.released: list[str] = []

    def propose(self, seqs: Any) -> dict[str, list[int]]:
        out = {}
        for rid, tokens, k in seqs:
            self.asked.append((rid, k))
            pos = len(tokens) - self.prompt_len[rid]
            if int(rid[1:]) % 2 == 0:
                out[rid] = [self.runner._token(SamplingParams(), 0, pos + i)[0] for i in range(k)]
        return out

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


def test_a_draft_proposers_drafts_are_used_and_it_is_told_when_requests_end() -> None:
    prompt = [5, 6, 7]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    requests = {f"r{i}": (prompt, params) for i in range(4)}
    plain = _run_checked(_sim_engine(None), requests)
    spec = SpeculativeConfig(num_speculative_tokens=3, method="draft_model", adaptive=False)
    cfg = EngineConfig(
        simulate=True,
        block_size=BS,
        max_model_len=256,
        num_kv_blocks=64,
        simulation=SimulationConfig(time_scale=0),
    )
    runner = PatternRunner(cfg)
    proposer = _OracleProposer(runner)
    proposer.prompt_len = {rid: len(prompt) for rid in requests}
    engine = LLMEngine(cfg, runner=runner, tokenizer=_Tok())
    # the real engine builds a DraftModelProposer only over the real runner; here the scheduler
    # gets the stand-in directly
    from kvgate.engine.core.scheduler import Scheduler

    engine.scheduler = Scheduler(
        dataclasses.replace(engine.scheduler.config, speculative=spec), engine.kv, proposer=proposer
    )
    engine.add_request("gone", prompt, params)
    engine.step()
    engine.abort_request("gone")
    assert _run_checked(engine, requests) == plain
    assert sorted(proposer.released) == sorted([*requests, "gone"])  # ended or aborted: told
    assert all(0 < k <= 3 for _, k in proposer.asked)
    stats = engine.scheduler.spec_stats
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens  # perfect drafts


def test_draft_model_needs_the_real_runner() -> None:
    spec = SpeculativeConfig(num_speculative_tokens=2, method="draft_model")
    with pytest.raises(ValueError, match="needs the real model runner"):
        _sim_engine(spec)
