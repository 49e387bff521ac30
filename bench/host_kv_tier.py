"""Time to first token of a long prompt served three ways by the real default model on this
machine's CPU: computed, hit on the device pool, and loaded back from the host KV tier.

    .venv/bin/python -P bench/host_kv_tier.py [--prompt-tokens 4096] [--repeats 3]

One LLMEngine (SmolLM2-135M, fp32) with a device pool just large enough for the prompt or for
an unrelated filler prompt, not both, and a host tier. Per repeat: a fresh prompt is computed
(`compute`), asked again at once (`device hit`), then a filler takes the device pool, which
evicts the prompt into the host tier, and the prompt is asked again (`host-tier hit`: its
blocks are copied back, only the last token computed). TTFT is the wall time of the engine
steps until the first token, measured in process (no HTTP). Ratios are to `compute` in the
same repeat. The greedy tokens of all three must match, or the bench stops.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvgate.engine.config import EngineConfig
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.sampling_params import SamplingParams

BLOCK = 16


def first_token_seconds(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[float, list[int], int]:
    """Seconds of engine steps until the request's first token; its greedy tokens; tokens it
    got from the host tier."""
    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    started = time.perf_counter()
    ttft = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if ttft is None and out.token_ids:
                ttft = time.perf_counter() - started
            if out.finished:
                assert ttft is not None
                return ttft, out.token_ids, out.num_host_cached_tokens
    raise RuntimeError("the request did not finish")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    n = args.prompt_tokens
    device_blocks = -(-(n + 4) // BLOCK)  # one prompt (plus its answer), never two
    config = EngineConfig(
        block_size=BLOCK,
        max_model_len=device_blocks * BLOCK,
        num_kv_blocks=device_blocks,
        max_num_batched_tokens=2048,
        kv_offloading_size=0.25,
    )
    engine = LLMEngine(config)
    assert engine.kv.host is not None
    print(
        f"default model on CPU, {n}-token prompt, device pool {device_blocks} blocks of {BLOCK}, "
        f"host tier {engine.kv.host.num_blocks} blocks"
    )
    vocab = engine.vocab_size
    rows: dict[str, list[float]] = {"compute": [], "device hit": [], "host-tier hit": []}
    for r in range(args.repeats):
        prompt = [(1000 + 7919 * (i + 1) * (r + 3)) % (vocab - 1000) + 500 for i in range(n)]
        filler = [(2000 + 104729 * (i + 1) * (r + 5)) % (vocab - 1000) + 500 for i in range(n)]
        computed, tokens, _ = first_token_seconds(engine, f"c{r}", prompt)
        hit, tokens_hit, _ = first_token_seconds(engine, f"d{r}", prompt)
        first_token_seconds(engine, f"f{r}", filler)  # evicts the prompt into the host tier
        loaded, tokens_loaded, from_host = first_token_seconds(engine, f"h{r}", prompt)
        if not tokens == tokens_hit == tokens_loaded:
            raise SystemExit(f"repeat {r}: tokens differ: {tokens} / {tokens_hit} / {tokens_loaded}")
        if from_host < n - 2 * BLOCK:
            raise SystemExit(f"repeat {r}: only {from_host} of {n} tokens came from the host tier")
        rows["compute"].append(computed)
        rows["device hit"].append(hit)
        rows["host-tier hit"].append(loaded)
        print(f"  repeat {r}: compute {computed:.3f} s, device hit {hit:.3f} s, host-tier hit {loaded:.3f} s")
    base = statistics.median(rows["compute"])
    print(f"{'':14}  {'TTFT median':>11}  {'vs compute':>10}")
    for name, values in rows.items():
        med = statistics.median(values)
        print(f"{name:14}  {med:10.3f}s  {med / base:9.3f}x")


if __name__ == "__main__":
    main()
