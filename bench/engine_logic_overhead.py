"""CPU cost of the engine's logic layer (scheduler, KV cache manager, detokenizer, outputs).

Runs the real LLMEngine over the simulated runner with no sleeping, so everything measured is
Python overhead that a real step pays on top of the model. Reports, in the same run:

- CPU microseconds per generated token at several batch sizes, with the byte-level
  detokenizer fast path and with the generic window decoder (the baseline);
- prompt tokens computed for a burst of chats sharing a system prompt, prefix caching on vs off.

Usage: python bench/engine_logic_overhead.py [--batches 32,128,256] [--out-len 128]
"""

from __future__ import annotations

import argparse
import time

from kvgate.api.tokenizer import load_tokenizer
from kvgate.engine.config import EngineConfig, SimulationConfig
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.sampling_params import SamplingParams


def _engine(tok: object, **kw: object) -> LLMEngine:
    cfg = EngineConfig(simulate=True, simulation=SimulationConfig(time_scale=0), **kw)  # type: ignore[arg-type]
    return LLMEngine(cfg, tokenizer=tok)


def overhead_us_per_token(tok: object, batch: int, out_len: int, byte_table: bool) -> float:
    engine = _engine(tok, max_num_seqs=batch, max_num_batched_tokens=max(2048, batch))
    if not byte_table:
        engine._byte_table_built = True  # leave the table unset: the generic window path
    for i in range(batch):
        prompt = [1000 + (i * 31 + j) % 30000 for j in range(200)]
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=out_len, ignore_eos=True))
    start = time.process_time()
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += len(engine.step())
    return (time.process_time() - start) / tokens * 1e6


def shared_prefix_prefill(tok: object, caching: bool, n: int = 32) -> tuple[int, int]:
    """Prompt tokens computed (and total) for n chats sharing a long system prompt."""
    engine = _engine(tok, enable_prefix_caching=caching, max_num_seqs=8)
    system = "You are a meticulous assistant. " * 60
    computed = 0
    total = 0
    for i in range(n):
        text = tok.apply_chat_template(  # type: ignore[attr-defined]
            [{"role": "system", "content": system}, {"role": "user", "content": f"Question number {i}?"}]
        )
        ids = tok.encode(text)  # type: ignore[attr-defined]
        total += len(ids)
        engine.add_request(str(i), ids, SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        batch = engine.scheduler.schedule()
        computed += sum(len(s.token_ids) for s in batch.seqs if s.num_generated == 0)
        engine.scheduler.update(batch, engine.runner.execute(batch))
    return computed, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="32,128,256", help="comma-separated concurrent sequence counts")
    ap.add_argument("--out-len", type=int, default=128, help="generated tokens per request")
    args = ap.parse_args()
    tok = load_tokenizer("default")
    print("batch  table_us/tok  window_us/tok  speedup")
    for batch in (int(b) for b in args.batches.split(",")):
        fast = overhead_us_per_token(tok, batch, args.out_len, byte_table=True)
        slow = overhead_us_per_token(tok, batch, args.out_len, byte_table=False)
        print(f"{batch:5d}  {fast:12.1f}  {slow:13.1f}  {slow / fast:6.2f}x")
    on, total = shared_prefix_prefill(tok, caching=True)
    off, _ = shared_prefix_prefill(tok, caching=False)
    print(
        f"shared-prefix prefill: {on} tokens computed with caching, {off} without, of {total} ({off / on:.1f}x less work)"
    )


if __name__ == "__main__":
    main()
