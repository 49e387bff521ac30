"""n-gram speculative decoding on CPU: the real default model, with and without
--speculative-config, same run, same requests.

Workloads: "grounded" (repeat a given passage word for word: the answer copies the prompt, so
n-gram drafts are right often) and "free" (short open questions: drafts seldom match), at
batch 1, 4 and 16 (the 4 prompts each 4 times), greedy, each answer ending at EOS or
max_tokens (outputs are identical with and without speculation; checked). Modes: "off",
"adaptive" (the default: per request and step, only the drafts that pay, see
engine/spec_decode/adaptive.py) and "fixed" (`"adaptive": false`: every proposal in full).

Per row: decode tokens/s (tokens after each request's first, over the time from the first
token to the last, summed over requests in the batch / the batch's decode wall time), ITL p50
(gap between a request's streamed outputs: one step, which may carry several tokens), TPOT p50
(a request's decode time per token), the draft acceptance rate (accepted / drafted), the
share of decode steps (per request) that drafted, and the mean drafts of those that did.
"off" is run before and after the other modes, and the faster of its two runs is the baseline.

Usage: python bench/spec_decode.py [--max-tokens 96] [--k 4] [--batches 1,4] [--threads 0]
                                   [--modes off,adaptive,fixed] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from typing import Any

import torch

from kvgate.engine.config import EngineConfig
from kvgate.engine.llm import LLM
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.spec_decode import SpeculativeConfig

PASSAGES = [
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age "
    "of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season "
    "of Light, it was the season of Darkness.",
    "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my "
    "purse, and nothing particular to interest me on shore, I thought I would sail about a little "
    "and see the watery part of the world.",
    "In the beginning the Universe was created. This has made a lot of people very angry and been "
    "widely regarded as a bad move. Many were increasingly of the opinion that they had all made a "
    "big mistake in coming down from the trees.",
    "All happy families are alike; each unhappy family is unhappy in its own way. Everything was in "
    "confusion in the Oblonskys' house. The wife had discovered that the husband was carrying on an "
    "intrigue with a French girl.",
]
QUESTIONS = [
    "Write a short poem about the sea.",
    "Why is the sky blue? Explain briefly.",
    "Give three tips for learning to cook.",
    "Describe a walk in an autumn forest.",
]


def _prompts(tok: Any, kind: str) -> list[list[int]]:
    texts = (
        [f"Repeat this passage exactly, word for word:\n\n{p}" for p in PASSAGES]
        if kind == "grounded"
        else QUESTIONS
    )
    return [list(tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]))) for t in texts]


def _run(
    llm: LLM, spec: SpeculativeConfig | None, prompts: list[list[int]], max_tokens: int
) -> dict[str, Any]:
    engine = LLMEngine(
        EngineConfig(block_size=16, max_model_len=2048, speculative_config=spec),
        runner=llm.engine.runner,
        tokenizer=llm.get_tokenizer(),
    )
    params = SamplingParams(temperature=0, max_tokens=max_tokens)  # ends at EOS or max_tokens
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    stamps: dict[str, list[tuple[float, int]]] = {}  # request -> (time, tokens so far)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            stamps.setdefault(o.request_id, []).append((now, len(o.token_ids)))
            if o.finished:
                tokens[o.request_id] = o.token_ids
    first = min(s[0][0] for s in stamps.values())
    last = max(s[-1][0] for s in stamps.values())
    decode_tokens = sum(s[-1][1] - s[0][1] for s in stamps.values())
    decode_steps = sum(len(s) - 1 for s in stamps.values())
    itl = [b[0] - a[0] for s in stamps.values() for a, b in itertools.pairwise(s)]
    tpot = [(s[-1][0] - s[0][0]) / (s[-1][1] - s[0][1]) for s in stamps.values() if s[-1][1] > s[0][1]]
    st = engine.get_stats()
    return {
        "tokens": tokens,
        "decode_tok_s": decode_tokens / (last - first),
        "itl_p50_ms": 1000 * statistics.median(itl),
        "tpot_p50_ms": 1000 * statistics.median(tpot),
        "drafts": st.spec_num_drafts_total,
        "draft_tokens": st.spec_num_draft_tokens_total,
        "accepted": st.spec_num_accepted_tokens_total,
        "decode_steps": decode_steps,
    }


HEAD = (
    f"{'workload':9} {'batch':>5} {'mode':>8} {'tok/s off':>9} {'tok/s on':>9} {'speedup':>7} "
    f"{'ITL p50 off':>11} {'ITL p50 on':>10} {'TPOT p50 off':>12} {'TPOT p50 on':>11} "
    f"{'accept':>6} {'acc/draft':>9} {'drafted':>7} {'k mean':>6} {'same':>4}"
)


def _print_row(r: dict[str, Any]) -> None:
    print(
        f"{r['workload']:9} {r['batch']:>5} {r['mode']:>8} {r['off_tok_s']:>9.1f} {r['on_tok_s']:>9.1f} "
        f"{r['on_tok_s'] / r['off_tok_s']:>6.2f}x {r['off_itl_p50_ms']:>11.1f} {r['on_itl_p50_ms']:>10.1f} "
        f"{r['off_tpot_p50_ms']:>12.1f} {r['on_tpot_p50_ms']:>11.1f} {r['acceptance']:>6.2f} "
        f"{r['accepted_per_draft']:>9.2f} {r['drafted_steps']:>7.2f} {r['k_mean']:>6.2f} "
        f"{'yes' if r['identical_output'] else 'NO':>4}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--modes", default="off,adaptive,fixed", help="off first: the baseline")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    configs: dict[str, SpeculativeConfig | None] = {
        "off": None,
        "adaptive": SpeculativeConfig(
            num_speculative_tokens=args.k, prompt_lookup_max=4, prompt_lookup_min=1
        ),
        "fixed": SpeculativeConfig(
            num_speculative_tokens=args.k, prompt_lookup_max=4, prompt_lookup_min=1, adaptive=False
        ),
    }
    modes = args.modes.split(",")
    assert modes[0] == "off" and all(m in configs for m in modes), modes
    llm = LLM(block_size=16, max_model_len=2048)
    tok = llm.get_tokenizer()
    _run(llm, None, _prompts(tok, "free")[:1], 8)  # warm-up
    print(f"threads={torch.get_num_threads()} max_tokens={args.max_tokens} k={args.k} (ms for ITL/TPOT)")
    print(HEAD, flush=True)
    rows = []
    for kind in ("grounded", "free"):
        prompts = _prompts(tok, kind)
        for batch in (int(b) for b in args.batches.split(",")):
            # batch 1: each prompt alone, one after another; batch b: b prompts at once
            groups = (
                [[p] for p in prompts]
                if batch == 1
                else [list(itertools.islice(itertools.cycle(prompts), batch))]
            )
            res: dict[str, dict[str, Any]] = {}
            # "off" runs first and again last; the faster of the two is the baseline (this
            # machine is shared and drifts: a conservative baseline for the speedups)
            for name in [*modes, "off"]:
                cfg = configs[name]
                runs = [_run(llm, cfg, g, args.max_tokens) for g in groups]
                if name == "off" and "off" in res:
                    if statistics.mean(r["decode_tok_s"] for r in runs) <= res["off"]["decode_tok_s"]:
                        continue
                    assert [r["tokens"] for r in runs] == res["off"]["tokens"]
                res[name] = {
                    "tokens": [r["tokens"] for r in runs],
                    "decode_tok_s": statistics.mean(r["decode_tok_s"] for r in runs),
                    "itl_p50_ms": statistics.median(r["itl_p50_ms"] for r in runs),
                    "tpot_p50_ms": statistics.median(r["tpot_p50_ms"] for r in runs),
                    "draft_tokens": sum(r["draft_tokens"] for r in runs),
                    "accepted": sum(r["accepted"] for r in runs),
                    "drafts": sum(r["drafts"] for r in runs),
                    "decode_steps": sum(r["decode_steps"] for r in runs),
                }
            off = res["off"]
            for name in modes[1:]:
                on = res[name]
                rows.append(
                    {
                        "workload": kind,
                        "batch": batch,
                        "mode": name,
                        "identical_output": off["tokens"] == on["tokens"],
                        "off_tok_s": off["decode_tok_s"],
                        "on_tok_s": on["decode_tok_s"],
                        "off_itl_p50_ms": off["itl_p50_ms"],
                        "on_itl_p50_ms": on["itl_p50_ms"],
                        "off_tpot_p50_ms": off["tpot_p50_ms"],
                        "on_tpot_p50_ms": on["tpot_p50_ms"],
                        "acceptance": on["accepted"] / on["draft_tokens"] if on["draft_tokens"] else 0.0,
                        "accepted_per_draft": on["accepted"] / on["drafts"] if on["drafts"] else 0.0,
                        "drafted_steps": on["drafts"] / on["decode_steps"] if on["decode_steps"] else 0.0,
                        "k_mean": on["draft_tokens"] / on["drafts"] if on["drafts"] else 0.0,
                    }
                )
                _print_row(rows[-1])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
