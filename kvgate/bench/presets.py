"""Named bench shapes: flag values that stand for a published benchmark, so a comparison can be
reproduced by name. A preset only fills the flags the command line does not give.

Kept import-free so `kvgate --help` stays instant.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Preset:
    summary: str
    values: dict[str, object]


_LLM_D_SHARED_PREFIX: dict[str, object] = {
    "workload": "shared-prefix",
    "groups": 64,
    "prefix_tokens": 6000,
    "suffix_tokens": 1200,
    "output_tokens": 100,
    "engines": 16,
    "sim_kv_blocks": 1800,
    "request_rate": "4,8,16,24",
    "num_requests": 200,
    "warmup_requests": 64,
}

NOISY_NEIGHBOR = "noisy-neighbor"
BATCH_AND_ONLINE = "batch-and-online"

PRESETS: dict[str, Preset] = {
    # llm-d's precise-prefix routing benchmark shape: many long system prompts shared by users
    # who each add a long unique question, on engines whose KV cache cannot hold every prefix
    # everywhere, swept from below round-robin's saturation to well above it.
    "llm-d-shared-prefix": Preset(
        "64 system prompts of 6,000 tokens, 1,200-token questions, 100-token answers; 16 simulated "
        "engines of 1,800 KV blocks (4 prefixes each); 4, 8, 16 and 24 req/s",
        _LLM_D_SHARED_PREFIX,
    ),
    # The same shape on engines with a host KV tier four times their device pool (vLLM's CPU
    # offloading as llm-d's tiered prefix cache runs it): 7,200 blocks at a PCIe-class link.
    "llm-d-tiered": Preset(
        "llm-d-shared-prefix on engines that also keep a host KV tier of 7,200 blocks (4x the "
        "device pool) at 50 GB/s; 4, 8, 16 and 24 req/s",
        {**_LLM_D_SHARED_PREFIX, "sim_cpu_kv_blocks": 7200},
    ),
    # Chat sessions that resend their growing history every turn (a coding assistant, an agent):
    # a turn is only sent once the previous one of its conversation has answered. Conversations
    # open with one of four apps' system prompts, as inference-perf's multi-turn shared-prefix
    # shape groups users under shared prompts (each conversation with a prompt of its own made
    # every eighth request a 2,000-token prefill no router can avoid, and that set TTFT p90).
    "multi-turn-chat": Preset(
        "32 conversations of 8 turns opening with one of 4 shared 2,000-token system prompts, "
        "200-token user turns, 200-token answers (a 64-token synthetic reply is folded back into "
        "the history); 8 simulated engines of 2,048 KV blocks; 4 and 8 req/s",
        {
            "workload": "multi-turn",
            "conversations": 32,
            "turns": 8,
            "system_prompts": 4,
            "first_turn_tokens": 2000,
            "user_turn_tokens": 200,
            "output_tokens": 200,
            "engines": 8,
            "sim_kv_blocks": 2048,
            "request_rate": "4,8",
            "num_requests": 200,
            "warmup_requests": 32,
        },
    ),
    # Prefill/decode disaggregation's home ground: unique long prompts (nothing to reuse) whose
    # prefill stalls every decode running beside it, mixed with short chats that feel it.
    "pd-long-prompt": Preset(
        "30% unique 4,000-8,000-token prompts, 70% short chats of 32-256 tokens, 128-token answers; "
        "2 prefill + 2 decode simulated engines vs 4 aggregated; 4,096 KV blocks each; 1 req/s, 60 requests",
        {
            "workload": "long-prompt",
            "long_fraction": 0.3,
            "min_long_tokens": 4000,
            "max_long_tokens": 8000,
            "output_tokens": 128,
            # the prompts' prefill work (~1.1 engines' worth at 1 req/s) needs two prefill engines:
            # with one (--pd 1:3) it queues, and TTFT grows through the run (docs/benchmarks.md)
            "pd": (2, 2),
            "sim_kv_blocks": 4096,
            "request_rate": "1",
            "num_requests": 60,
            "warmup_requests": 0,
        },
    ),
    # Many fine-tuned variants of one base model on few adapter slots (GIE's LoRA-affinity home
    # ground): a router that keeps each adapter where it is loaded saves the loads and the
    # adapter's system prompt stays cached there too. One slot per engine is vLLM's default
    # --max-loras; the pool then has fewer slots (8) than adapters (12), so where each adapter
    # runs matters. With 2 slots each (16 >= 12) every adapter finds a home under any
    # affinity-aware router and GIE's default ties kvgate's (`--max-loras 2`).
    "lora": Preset(
        "12 LoRA adapters with Zipf(1.1) popularity (10% of requests for the base model), each with "
        "its own 512-token system prompt, 128-token questions, 64-token answers; 8 simulated "
        "engines with 1 adapter slot each (vLLM's default --max-loras), 50 ms per adapter load; "
        "4 and 8 req/s",
        {
            "workload": "lora",
            "adapters": 12,
            "adapter_zipf": 1.1,
            "base_fraction": 0.1,
            "max_loras": 1,
            "prefix_tokens": 512,
            "suffix_tokens": 128,
            "output_tokens": 64,
            "engines": 8,
            "sim_lora_load_time": 0.05,
            "request_rate": "4,8",
            "num_requests": 200,
            "warmup_requests": 32,
        },
    ),
    # Tenants sharing one pool (bench/noisy_neighbor.py's experiment, through the real stack): one
    # floods long prompts, two send short ones; with flow control, without, and each alone. Its
    # own runner (kvgate.bench.noisy_neighbor) starts the stacks and writes the tenants file.
    NOISY_NEIGHBOR: Preset(
        "tenant A sends unique 4,000-token prompts at 3x the pool's capacity for them, B and C "
        "256-token prompts at 0.15x each, each tenant with its own API key; 128-token answers; 4 "
        "simulated engines of 1,800 KV blocks, GIE's default profile; with flow control, without, "
        "and B and C alone; then a sheddable flood against critical traffic; 20 s of arrivals per "
        "run (--duration)",
        {
            "simulate": True,
            "engines": 4,
            "sim_kv_blocks": 1800,
            "profile": "default",
            "min_long_tokens": 4000,
            "max_long_tokens": 4000,
            "min_prompt_tokens": 256,
            "max_prompt_tokens": 256,
            "output_tokens": 128,
            "duration": 20.0,
        },
    ),
    # A batch job beside online chat (issue 45's experiment): the pool's capacity measured with a
    # closed-loop flood, online Poisson traffic at 60% of it alone, then beside a batch submitted
    # through the gateway's Batch API. Its own runner (kvgate.bench.batch_and_online).
    BATCH_AND_ONLINE: Preset(
        "online chat (256-token prompts, 128-token answers) at 60% of the pool's measured capacity, "
        "alone and beside a 5,000-line batch of the same requests submitted at once; 2 simulated "
        "engines of 8 batch slots, the stack at kvgate up's defaults; 30 s of arrivals per run",
        {
            "simulate": True,
            "engines": 2,
            "max_num_seqs": 8,
            "min_prompt_tokens": 256,
            "max_prompt_tokens": 256,
            "output_tokens": 128,
            "duration": 30.0,
            "batch_lines": 5000,
        },
    ),
}


def apply_preset(
    args: object, name: str, defaults: dict[str, object], explicit: frozenset[str] | None = None
) -> list[str]:
    """Set the preset's values on `args` for the flags the user did not give; returns the flags
    it set (for the report). `explicit`: the flags given on the command line (by dest), so a
    flag given at its default value (`--max-loras 2`) still wins; without it, a flag counts as
    given when its value differs from the parser's default."""
    preset = PRESETS[name]
    applied = []
    for key, value in preset.values.items():
        given = key in explicit if explicit is not None else getattr(args, key) != defaults.get(key)
        if not given:
            setattr(args, key, value)
            flag = f"--{key.replace('_', '-')}"
            applied.append(flag if value is True else f"{flag} {value}")
    return applied


class _Recording:
    """Mixed into an argparse action: notes its dest as given on the command line."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, *rest: Any) -> None:
        given: set[str] = getattr(namespace, EXPLICIT_DEST, None) or set()
        given.add(self.dest)  # type: ignore[attr-defined]
        setattr(namespace, EXPLICIT_DEST, given)
        super().__call__(parser, namespace, *rest)  # type: ignore[misc]


EXPLICIT_DEST = "_explicit_flags"


def record_explicit_flags(parser: argparse.ArgumentParser) -> None:
    """After this, `getattr(args, EXPLICIT_DEST)` holds the dests of the options the command line
    named (a preset must not override them, even when given at their default value)."""
    classes: dict[type, type] = {}
    for action in parser._actions:
        if action.option_strings and action.dest != "help":
            base = type(action)
            action.__class__ = classes.setdefault(
                base, type(f"Recording{base.__name__}", (_Recording, base), {})
            )
