"""kvgate's engine vs Hugging Face transformers' static batch, on CPU, same requests, same run.

Workload: N chat requests (default 64) on the default model (SmolLM2-135M-Instruct, fp32), each
with its own output length (cycling through --lengths), greedy, ignore_eos so every request
produces exactly its max_tokens on both sides.

- kvgate: the offline `LLM` API (continuous batching, chunked prefill, paged KV cache).
- baseline: `model.generate` on left-padded static batches (--hf-batch requests each, default
  all at once) with max_new_tokens = the longest request of the batch. Only each request's own
  max_tokens count as useful tokens (what a user would get).

Both sides use the same torch thread count. Prints tokens/s of each and the ratio, by wall time
and by process CPU time (steadier on a shared machine when run with --threads 1).

Usage: python bench/engine_cpu.py [--requests 64] [--lengths 16,32,64,128,256] [--threads 0]
                                  [--hf-batch 0] [--skip-hf] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

TOPICS = [
    "the water cycle",
    "black holes",
    "the French revolution",
    "photosynthesis",
    "how vaccines work",
    "the stock market",
    "volcanoes",
    "machine learning",
    "the Roman empire",
    "climate change",
    "the human heart",
    "electric cars",
    "coffee",
    "the moon landing",
    "honey bees",
    "the internet",
]
FORMS = [
    "Explain {t} to a ten-year-old.",
    "Give me three surprising facts about {t}.",
    "Write a short paragraph about {t}, then list two open questions researchers still have about it.",
    "What is the most common misconception about {t}? Answer briefly.",
]


def conversations(n: int) -> list[list[dict[str, str]]]:
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        form = FORMS[(i // len(TOPICS)) % len(FORMS)]
        out.append([{"role": "user", "content": form.format(t=topic)}])
    return out


def run_kvgate(
    convs: list[list[dict[str, str]]], lengths: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    from kvgate.engine.llm import LLM
    from kvgate.engine.sampling_params import SamplingParams

    start = time.perf_counter()
    llm = LLM(device="cpu", max_num_seqs=max(len(convs), 1), max_num_batched_tokens=args.max_batched_tokens)
    load_s = time.perf_counter() - start
    llm.chat(convs[:1], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    start, cpu_start = time.perf_counter(), time.process_time()
    outs = llm.chat(convs, params)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return _result(load_s, wall, cpu, tokens)


def _result(load_s: float, wall: float, cpu: float, tokens: list[list[int]]) -> dict[str, Any]:
    useful = sum(len(t) for t in tokens)
    return {
        "load_s": load_s,
        "wall_s": wall,
        "cpu_s": cpu,
        "tokens": useful,
        "tok_per_s": useful / wall,
        "tok_per_cpu_s": useful / cpu,
        "ids": tokens,
    }


def run_hf(
    prompts: list[list[int]], lengths: list[int], pad_id: int, args: argparse.Namespace
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from kvgate.api.tokenizer import resolve_model

    path = resolve_model("default")
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    model.generation_config.eos_token_id = None  # produce exactly max_new_tokens, like ignore_eos
    load_s = time.perf_counter() - start
    batch_size = args.hf_batch or len(prompts)

    def generate(batch: list[list[int]], new_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
        return out[:, width:].tolist()  # type: ignore[no-any-return]

    generate(prompts[:2], 2)  # warm-up
    start, cpu_start = time.perf_counter(), time.process_time()
    results: list[list[int]] = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        chunk_lengths = lengths[i : i + batch_size]
        outs = generate(chunk, max(chunk_lengths))
        results.extend(o[:n] for o, n in zip(outs, chunk_lengths, strict=True))
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return _result(load_s, wall, cpu, results)


def _line(name: str, r: dict[str, Any]) -> str:
    return (
        f"{name}: {r['tokens']} tokens in {r['wall_s']:.1f} s wall = {r['tok_per_s']:.1f} tok/s; "
        f"{r['cpu_s']:.1f} s CPU = {r['tok_per_cpu_s']:.1f} tok/CPU-s (load {r['load_s']:.1f} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=64, help="number of chat requests")
    parser.add_argument(
        "--lengths", default="16,32,64,128,256", help="output lengths (tokens), cycled over the requests"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch CPU threads for both sides (0: torch default)"
    )
    parser.add_argument(
        "--hf-batch", type=int, default=0, help="static batch size for HF (0: all requests at once)"
    )
    parser.add_argument("--max-batched-tokens", type=int, default=2048, help="kvgate token budget per step")
    parser.add_argument("--skip-hf", action="store_true", help="measure kvgate only")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    length_cycle = [int(x) for x in args.lengths.split(",")]
    lengths = [length_cycle[i % len(length_cycle)] for i in range(args.requests)]
    convs = conversations(args.requests)

    from kvgate.api.tokenizer import load_tokenizer

    tok = load_tokenizer("default")
    prompts = [tok.encode(tok.apply_chat_template(c)) for c in convs]
    print(
        f"{args.requests} chat requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, "
        f"outputs {min(lengths)}-{max(lengths)} tokens ({sum(lengths)} total), {torch.get_num_threads()} threads"
    )
    ours = run_kvgate(convs, lengths, args)
    print(_line("kvgate", ours))
    report: dict[str, Any] = {
        "requests": args.requests,
        "lengths": length_cycle,
        "threads": torch.get_num_threads(),
        "kvgate": {k: v for k, v in ours.items() if k != "ids"},
    }
    if not args.skip_hf:
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        hf = run_hf(prompts, lengths, pad, args)
        print(_line(f"HF static batch of {args.hf_batch or args.requests}", hf))
        ratio = ours["tok_per_s"] / hf["tok_per_s"]
        cpu_ratio = ours["tok_per_cpu_s"] / hf["tok_per_cpu_s"]
        # Padded batches shift fp32 sums slightly, so greedy paths may part after many tokens.
        same_16 = sum(a[:16] == b[:16] for a, b in zip(ours["ids"], hf["ids"], strict=True))
        print(f"ratio: {ratio:.2f}x HF by wall time, {cpu_ratio:.2f}x by CPU time (target >= 2x)")
        print(f"greedy agreement: first 16 tokens identical for {same_16}/{args.requests} requests")
        report["hf"] = {k: v for k, v in hf.items() if k != "ids"}
        report["ratio"] = ratio
        report["cpu_time_ratio"] = cpu_ratio
        report["first16_identical"] = same_16
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
