"""`kvgate bench --preset batch-and-online`'s pure parts: the batch's input file, the online
requests, the figures (leftover capacity, the batch's share of it, the TTFT ratio) and the
report; the preset's flags and what it refuses."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import pytest

from kvgate.bench import batch_and_online as bo
from kvgate.bench.stats import RequestResult, Slo, summarize


def _result(index: int, sent_at: float, ttft: float, tokens: int) -> RequestResult:
    r = RequestResult(index=index, group=f"g{index}", sent_at=sent_at, status=200)
    r.ttft = ttft
    r.token_times = [ttft + 0.01 * i for i in range(tokens)]
    r.output_tokens = tokens
    r.e2e = r.token_times[-1]
    return r


def _row(run: str, ttft: float, tok_s: float, pool: float | None) -> bo.RunRow:
    results = [_result(i, i * 0.5, ttft, 10) for i in range(10)]
    return bo.RunRow(run, 2.0, summarize(run, results, 10.0, Slo()), tok_s, pool, results)


def test_the_batch_file_is_one_valid_line_per_custom_id_of_the_online_shape() -> None:
    data = bo.batch_input("default", 50, 32, 16, seed=3)
    lines = [json.loads(x) for x in data.decode().splitlines()]
    assert [x["custom_id"] for x in lines] == [f"line-{i}" for i in range(50)]
    assert {x["url"] for x in lines} == {"/v1/chat/completions"} and {x["method"] for x in lines} == {"POST"}
    bodies = [x["body"] for x in lines]
    assert all(b["max_tokens"] == 16 and b["ignore_eos"] is True for b in bodies)
    assert all(len(b["messages"][0]["content"].split()) == 32 for b in bodies)
    assert len({b["messages"][0]["content"].split()[0] for b in bodies}) == 50  # unique from word one
    assert data == bo.batch_input("default", 50, 32, 16, seed=3)


def test_online_requests_are_unique_and_the_same_for_the_same_run_and_seed() -> None:
    a = list(itertools.islice(bo.online_requests(bo.ONLINE, 20, 8, 1), 5))
    b = list(itertools.islice(bo.online_requests(bo.ONLINE, 20, 8, 1), 5))
    assert [r.messages for r in a] == [r.messages for r in b]
    assert len({r.nominal_words[0] for r in a}) == 5
    assert all(len(r.nominal_words) == 20 and r.max_tokens == 8 for r in a)


def test_the_batch_is_judged_against_what_the_online_load_left_over() -> None:
    result = bo.BatchAndOnlineResult(
        [
            _row(bo.CAPACITY, 2.0, 1000.0, 1010.0),
            _row(bo.ONLINE, 0.10, 600.0, 600.0),
            _row(bo.MIXED, 0.11, 590.0, 900.0),
        ],
        bo.BatchOutcome(100, "completed", 100, 0),
        {},
    )
    assert result.leftover_tok_s() == pytest.approx(400.0)  # capacity - online alone
    assert result.batch_tok_s() == pytest.approx(310.0)  # the pool's tokens - the online ones
    assert result.leftover_share() == pytest.approx(310 / 400)
    assert result.ttft_p90_ratio() == pytest.approx(1.1)
    assert result.targets_met()
    slower = bo.BatchAndOnlineResult(
        [result.rows[0], result.rows[1], _row(bo.MIXED, 0.2, 590.0, 900.0)], result.batch, {}
    )
    assert slower.ttft_p90_ratio() == pytest.approx(2.0) and not slower.targets_met()
    unmeasured = bo.BatchAndOnlineResult([result.rows[0]], result.batch, {})
    assert unmeasured.ttft_p90_ratio() is None and not unmeasured.targets_met()


def test_the_report_states_both_targets(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = bo.BatchAndOnlineResult(
        [
            _row(bo.CAPACITY, 2.0, 1000.0, 1000.0),
            _row(bo.ONLINE, 0.1, 600.0, 600.0),
            _row(bo.MIXED, 0.3, 600.0, 700.0),
        ],
        bo.BatchOutcome(100, "completed", 99, 1, lines_done_in_window=7, seconds_to_final=42.0),
        {
            "engines": 2,
            "max_num_seqs": 8,
            "epp_replicas": 2,
            "prompt_tokens": 256,
            "output_tokens": 128,
            "duration": 30.0,
            "seed": 0,
            "window_start_s": 6.0,
        },
    )
    args = argparse.Namespace(markdown=False, json=str(tmp_path / "r.json"))
    bo.print_report(args, result, started="now")
    out = capsys.readouterr().out
    assert "3.00x (target <= 1.15x)" in out
    assert "100 of 400 left over" in out and "25%; target >= 70%" in out
    assert "99 of 100 lines completed, 1 failed, 7 during the online window; 42 s" in out
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["targets_met"] is False and doc["batch_share_of_leftover"] == pytest.approx(0.25)


def _args(*argv: str) -> argparse.Namespace:
    from kvgate.bench.cli import resolve_preset
    from kvgate.cli import build_parser

    args = build_parser(["bench"], only_selected=True).parse_args(
        ["bench", "--preset", "batch-and-online", *argv]
    )
    resolve_preset(args)
    return args


def test_the_preset_fills_the_shape_and_refuses_what_it_cannot_do() -> None:
    args = _args("--batch-lines", "600")
    assert (args.simulate, args.engines, args.max_num_seqs, args.min_prompt_tokens, args.output_tokens) == (
        True,
        2,
        8,
        256,
        128,
    )
    assert (args.duration, args.batch_lines) == (30.0, 600)
    assert _args().batch_lines == 5000
    bo.check_args(args)
    for argv, message in (
        (["--url", "http://127.0.0.1:1"], "starts its own stack"),
        (["--compare"], "drop --compare"),
        (["--batch-lines", "0"], "--batch-lines"),
        (["--duration", "0"], "--duration"),
    ):
        with pytest.raises(ValueError, match=message):
            bo.check_args(_args(*argv))


def test_the_run_beside_the_batch_sends_prompts_the_alone_run_did_not() -> None:
    """The same prompts again would be prefix-cache hits: the second run would look faster."""
    args = argparse.Namespace(min_prompt_tokens=20, output_tokens=8, seed=0)
    alone = list(itertools.islice(bo.run_requests(bo.ONLINE, args), 50))
    mixed = list(itertools.islice(bo.run_requests(bo.MIXED, args), 50))
    assert not {r.messages[0].content for r in alone} & {r.messages[0].content for r in mixed}
