"""A minimal stand-in for the scheduler, to drive a ModelRunner directly in tests.

It hands out blocks from a free list, feeds prompts in chunks (mixed with other requests'
decodes in the same step, as continuous batching does) and collects greedy tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.engine.core.runner_api import ModelRunner, SampledToken, ScheduledBatch, ScheduledSeq
from kvgate.engine.sampling_params import SamplingParams


@dataclass
class _Req:
    rid: str
    tokens: list[int]  # prompt + generated
    prompt_len: int
    params: SamplingParams
    max_new: int
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    samples: list[SampledToken] = field(default_factory=list)
    done: bool = False


def drive(
    runner: ModelRunner,
    prompts: list[list[int]],
    max_new_tokens: int,
    params: SamplingParams | None = None,
    chunk: int = 64,
    stop_ids: set[int] | None = None,
    first_block: int = 0,
) -> list[list[SampledToken]]:
    """Run every prompt to max_new_tokens (or a stop id); returns each request's sampled tokens."""
    params = params or SamplingParams(temperature=0.0)
    free = list(range(first_block, runner.num_kv_blocks))
    reqs = [_Req(f"r{i}", list(p), len(p), params, max_new_tokens) for i, p in enumerate(prompts)]
    while not all(r.done for r in reqs):
        seqs: list[ScheduledSeq] = []
        for r in reqs:
            if r.done:
                continue
            if r.computed < r.prompt_len:
                new = r.tokens[r.computed : min(r.prompt_len, r.computed + chunk)]
            else:
                new = r.tokens[-1:]
            end = r.computed + len(new)
            while len(r.blocks) * runner.block_size < end:
                r.blocks.append(free.pop(0))
            sample = end >= r.prompt_len
            seqs.append(
                ScheduledSeq(
                    r.rid, new, r.computed, list(r.blocks), sample, r.params, num_generated=len(r.samples)
                )
            )
            r.computed = end
        out = runner.execute(ScheduledBatch(seqs))
        assert [t.request_id for t in out] == [s.request_id for s in seqs if s.sample]
        by_id = {r.rid: r for r in reqs}
        for t in out:
            r = by_id[t.request_id]
            r.samples.append(t)
            r.tokens.append(t.token_id)
            if len(r.samples) >= r.max_new or (stop_ids and t.token_id in stop_ids):
                r.done = True
                free.extend(r.blocks)
    return [r.samples for r in reqs]
