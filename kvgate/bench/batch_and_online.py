"""`kvgate bench --preset batch-and-online`: a batch job in the troughs of online traffic.

One stack as `kvgate up --simulate` starts it (its defaults: flow control on, two EPP replicas,
FailOpen, the batch service behind the gateway), three runs in turn:

1. capacity: a closed loop of streaming chat requests, `engines x max_num_seqs x 2` in flight, for
   --duration seconds: the pool's output tokens/s at this shape on this machine (the engines, the
   EPPs, Envoy and this client share its cores, so it is measured, not derived);
2. online alone: Poisson arrivals of the same requests at ONLINE_FRACTION of that capacity;
3. online with the batch: a --batch-lines batch submitted at once through the gateway's
   /v1/files and /v1/batches, then the same online arrival times (same seed) again, with prompts
   of their own (the alone run's, sent again, would hit the engines' prefix cache).

Reported: online TTFT/ITL p50/p90 alone and beside the batch, and their ratio (target: TTFT p90
<= 1.15x); the batch's output tokens/s during the online window (the engines' generation token
counters less the online requests' tokens) against what the pool had left (capacity less the
online load alone; target >= 70%); the batch's completion time and the pool's output tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvgate.bench import report
from kvgate.bench.preset_main import PresetError, preset_main
from kvgate.bench.stats import RequestResult, Slo, Summary, ratio, summarize, window_tokens
from kvgate.bench.workloads import BenchRequest, ChatMessage, unique_prompt_words

PRESET = "batch-and-online"
ONLINE_FRACTION = 0.6  # the online load, as a share of the pool's measured capacity
TTFT_P90_TARGET = 1.15  # online TTFT p90 beside the batch / alone, at most
LEFTOVER_TARGET = 0.70  # the batch's tokens/s / (capacity - online alone), at least
# Throughput is counted over each run's arrival window less its first fifth (queues filling).
WINDOW_START = 0.2
BATCH_FINAL = ("completed", "failed", "cancelled", "expired")

CAPACITY = "capacity"
ONLINE = "online alone"
MIXED = "online + batch"


def _say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def online_requests(run: str, prompt_tokens: int, output_tokens: int, seed: int) -> Iterator[BenchRequest]:
    rng = random.Random(f"{seed}:{run}:online")
    index = 0
    while True:
        words = unique_prompt_words(rng, f"{run.replace(' ', '-')}-{index}", prompt_tokens)
        yield BenchRequest(
            index=index,
            messages=(ChatMessage("user", " ".join(words)),),
            max_tokens=output_tokens,
            group=f"online-{index}",
            nominal_words=tuple(words),
        )
        index += 1


def batch_input(model: str, lines: int, prompt_tokens: int, output_tokens: int, seed: int) -> bytes:
    """The batch's JSONL: chat requests of the online shape, each answering exactly
    `output_tokens` tokens (ignore_eos, as the online ones do)."""
    rng = random.Random(f"{seed}:batch")
    out = []
    for i in range(lines):
        body = {
            "model": model,
            "messages": [
                {"role": "user", "content": " ".join(unique_prompt_words(rng, f"batch-{i}", prompt_tokens))}
            ],
            "max_tokens": output_tokens,
            "ignore_eos": True,
        }
        out.append(
            json.dumps(
                {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            )
        )
    return ("\n".join(out) + "\n").encode()


@dataclass
class RunRow:
    run: str
    offered_req_s: float | None  # None: a closed loop
    summary: Summary
    window_tok_s: float  # the online (or capacity) requests' output tokens/s in the window
    pool_tok_s: float | None = None  # every engine's output tokens/s in the same window
    results: list[RequestResult] = field(default_factory=list, repr=False)

    def record(self) -> dict[str, object]:
        return {
            "run": self.run,
            "offered_req_s": self.offered_req_s,
            "window_output_tok_s": self.window_tok_s,
            "pool_output_tok_s": self.pool_tok_s,
            "requests_sent": len(self.results),
            "requests_ok": sum(1 for r in self.results if r.ok),
            **self.summary.as_record(),
        }


@dataclass
class BatchOutcome:
    lines: int
    status: str = "not submitted"
    completed: int = 0
    failed: int = 0
    submitted_at: float = 0.0  # monotonic
    lines_done_in_window: int = 0
    seconds_to_final: float | None = None  # from its creation until a final status


@dataclass
class BatchAndOnlineResult:
    rows: list[RunRow]
    batch: BatchOutcome
    settings: dict[str, object]

    def row(self, run: str) -> RunRow | None:
        return next((r for r in self.rows if r.run == run), None)

    def capacity_tok_s(self) -> float | None:
        cap = self.row(CAPACITY)
        return cap.window_tok_s if cap else None

    def leftover_tok_s(self) -> float | None:
        cap, alone = self.row(CAPACITY), self.row(ONLINE)
        if cap is None or alone is None:
            return None
        return max(0.0, cap.window_tok_s - alone.window_tok_s)

    def batch_tok_s(self) -> float | None:
        mixed = self.row(MIXED)
        if mixed is None or mixed.pool_tok_s is None:
            return None
        return max(0.0, mixed.pool_tok_s - mixed.window_tok_s)

    def ttft_p90_ratio(self) -> float | None:
        alone, mixed = self.row(ONLINE), self.row(MIXED)
        if alone is None or mixed is None:
            return None
        return ratio(mixed.summary.ttft_p90_s, alone.summary.ttft_p90_s)

    def leftover_share(self) -> float | None:
        return ratio(self.batch_tok_s(), self.leftover_tok_s())

    def targets_met(self) -> bool:
        ratio, share = self.ttft_p90_ratio(), self.leftover_share()
        return (
            ratio is not None and share is not None and ratio <= TTFT_P90_TARGET and share >= LEFTOVER_TARGET
        )


# -- the batch API, over plain HTTP (the openai client is a test dependency, not the bench's) --


class BatchClient:
    def __init__(self, gateway_url: str, timeout_s: float = 120.0) -> None:
        self.http = httpx.Client(base_url=gateway_url, timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def _ok(self, resp: httpx.Response) -> dict:
        if resp.status_code != 200:
            raise PresetError(
                f"{resp.request.method} {resp.request.url.path}: {resp.status_code} {resp.text[:300]}"
            )
        return resp.json()

    def submit(self, data: bytes) -> str:
        f = self._ok(
            self.http.post("/v1/files", files={"file": ("batch.jsonl", data)}, data={"purpose": "batch"})
        )
        b = self._ok(
            self.http.post(
                "/v1/batches",
                json={
                    "input_file_id": f["id"],
                    "endpoint": "/v1/chat/completions",
                    "completion_window": "24h",
                },
            )
        )
        return str(b["id"])

    def retrieve(self, batch_id: str) -> dict:
        return self._ok(self.http.get(f"/v1/batches/{batch_id}"))

    def cancel(self, batch_id: str) -> dict:
        return self._ok(self.http.post(f"/v1/batches/{batch_id}/cancel"))


def _counts(doc: dict) -> tuple[int, int]:
    counts = doc.get("request_counts") or {}
    return int(counts.get("completed") or 0), int(counts.get("failed") or 0)


# -- running ----------------------------------------------------------------------------------


def check_args(args: argparse.Namespace) -> None:
    """ValueError for what this preset cannot do."""
    if args.url or args.stack_file:
        raise ValueError(f"--preset {PRESET} starts its own stack; drop --url/--stack-file")
    if args.compare or args.pd:
        raise ValueError(f"--preset {PRESET} runs one stack at its defaults; drop --compare/--pd")
    if not args.simulate:
        raise ValueError(f"--preset {PRESET} runs simulated engines: add --simulate")
    if args.duration is None or args.duration <= 0:
        raise ValueError("--duration must be > 0")
    if args.min_prompt_tokens < 1 or args.output_tokens < 1:
        raise ValueError("--min-prompt-tokens and --output-tokens must be at least 1")
    if (args.engines or 0) < 1:
        raise ValueError("--engines must be at least 1")
    if (args.max_num_seqs or 0) < 1:
        raise ValueError("--max-num-seqs must be at least 1")
    if args.batch_lines < 1:
        raise ValueError("--batch-lines must be at least 1")


async def _engine_tokens(urls: Sequence[str]) -> float:
    from kvgate.api.contracts import metrics as m
    from kvgate.bench import engine_metrics

    snap = await engine_metrics.snapshot(urls)
    if snap.reachable != len(urls):
        raise PresetError(f"only {snap.reachable} of {len(urls)} engines answered /metrics")
    return snap.values.get(m.GENERATION_TOKENS_TOTAL, 0.0)


async def _drive(
    gateway: str,
    model: str,
    run: str,
    load_rate: float | None,
    concurrency: int | None,
    args: argparse.Namespace,
    on_result,
) -> tuple[list[RequestResult], float]:
    from kvgate.bench.loadgen import LoadSpec, Target, run_load

    target = Target(base_url=gateway, model=model)
    load = LoadSpec(request_rate=load_rate, concurrency=concurrency, duration_s=args.duration, seed=args.seed)
    return await run_load(target, run_requests(run, args), load, on_result=on_result)


def run_requests(run: str, args: argparse.Namespace) -> Iterator[BenchRequest]:
    """A run's online requests: prompts of its own in every run (one run's prompts sent again
    would be prefix-cache hits in the next), the same shape in all."""
    return online_requests(run, args.min_prompt_tokens, args.output_tokens, args.seed)


async def _measured(
    gateway: str,
    model: str,
    engine_metrics_urls: Sequence[str],
    run: str,
    rate: float | None,
    concurrency: int | None,
    args: argparse.Namespace,
    on_result,
) -> tuple[list[RequestResult], float, float]:
    """The run's results, its wall time, and every engine's output tokens/s over its window."""
    window = args.duration
    load = asyncio.create_task(_drive(gateway, model, run, rate, concurrency, args, on_result))
    await asyncio.sleep(WINDOW_START * window)
    before = await _engine_tokens(engine_metrics_urls)
    t0 = time.perf_counter()
    await asyncio.sleep((1 - WINDOW_START) * window)
    after = await _engine_tokens(engine_metrics_urls)
    pool = (after - before) / max(time.perf_counter() - t0, 1e-9)
    results, duration = await load
    return results, duration, pool


def _row(
    run: str, rate: float | None, results: list[RequestResult], duration: float, pool: float, args, slo: Slo
) -> RunRow:
    window = args.duration
    start = WINDOW_START * window
    tok_s = window_tokens(results, start, window) / max(window - start, 1e-9)
    summary = summarize(run, results, duration, slo, request_rate=rate)
    return RunRow(run, rate, summary, tok_s, pool, results)


def run_preset(args: argparse.Namespace, slo: Slo, progress: bool | None) -> BatchAndOnlineResult:
    from kvgate.bench.runner import _Progress
    from kvgate.local.ports import PortBusyError, plan_ports
    from kvgate.local.stack import LocalStack, SimTiming, StackConfig, StackError

    check_args(args)
    engines, seqs = args.engines, args.max_num_seqs
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_root = Path(args.log_dir) if args.log_dir else Path("bench") / "results" / f"logs-{stamp}"
    log_root.mkdir(parents=True, exist_ok=True)
    _say(f"component logs under {log_root}")
    replicas = 2  # kvgate up's default
    cfg = StackConfig(
        ports=plan_ports(0, 0, engines, replicas, batch=True),
        engines=engines,
        epp_replicas=replicas,
        model=args.engine_model,
        simulate=True,
        sim=SimTiming.from_args(args),
        max_num_seqs=seqs,
        envoy_bin=args.envoy_bin,
        log_dir=log_root,
        ready_timeout_s=args.ready_timeout,
        failure_mode="FailOpen",  # kvgate up's without --tenants
        epp_args=tuple(getattr(args, "epp_arg", None) or ()),
    )
    stack = LocalStack(cfg, echo=None, progress=lambda m: None)
    rows: list[RunRow] = []
    outcome = BatchOutcome(args.batch_lines)
    try:
        _say(
            f"starting {engines} simulated engine(s) of {seqs} batch slots, {replicas} EPP replicas, Envoy and the batch service"
        )
        try:
            info = stack.start()
        except PortBusyError as exc:
            raise PresetError(str(exc)) from None
        except StackError as exc:
            raise PresetError(str(exc), exc.details) from None
        urls, gateway, model = info.engine_metrics_urls, info.gateway_url, info.model

        def run(name: str, rate: float | None, concurrency: int | None) -> RunRow:
            bar = _Progress(None, name, progress)
            try:
                results, duration, pool = asyncio.run(
                    _measured(gateway, model, urls, name, rate, concurrency, args, bar)
                )
            finally:
                bar.close()
            row = _row(name, rate, results, duration, pool, args, slo)
            rows.append(row)
            return row

        flood = engines * seqs * 2
        _say(f"{CAPACITY}: {flood} streaming requests in flight for {args.duration:g} s")
        cap = run(CAPACITY, None, flood)
        cap_req_s = sum(1 for r in cap.results if r.ok) / max(cap.summary.duration_s, 1e-9)
        if cap.window_tok_s <= 0 or cap_req_s <= 0:
            raise PresetError("the capacity run completed nothing")
        rate = ONLINE_FRACTION * cap_req_s
        _say(
            f"capacity {cap.window_tok_s:.0f} output tok/s ({cap_req_s:.2f} req/s); online at {rate:.2f} req/s"
        )
        time.sleep(1.0)  # the flood's last requests end, the EPPs' scrapes settle
        _say(f"{ONLINE}: {rate:.2f} req/s for {args.duration:g} s")
        run(ONLINE, rate, None)
        time.sleep(1.0)
        client = BatchClient(gateway)
        try:
            data = batch_input(model, args.batch_lines, args.min_prompt_tokens, args.output_tokens, args.seed)
            outcome.submitted_at = time.monotonic()
            batch_id = client.submit(data)
            _say(f"batch {batch_id}: {args.batch_lines:,} lines submitted ({len(data) / 1e6:.1f} MB)")
            deadline = time.monotonic() + 60
            while client.retrieve(batch_id)["status"] == "validating":
                if time.monotonic() > deadline:
                    raise PresetError(f"batch {batch_id} still validating after 60 s")
                time.sleep(0.2)
            done_before = sum(_counts(client.retrieve(batch_id)))
            _say(f"{MIXED}: {rate:.2f} req/s for {args.duration:g} s beside the batch")
            run(MIXED, rate, None)
            doc = client.retrieve(batch_id)
            outcome.lines_done_in_window = sum(_counts(doc)) - done_before
            deadline = time.monotonic() + args.batch_timeout
            bar = _Progress(args.batch_lines, "batch", progress)
            try:
                while doc["status"] not in BATCH_FINAL:
                    if time.monotonic() > deadline:
                        _say(f"batch {batch_id} not done after {args.batch_timeout:g} s more: cancelling it")
                        client.cancel(batch_id)
                        deadline = time.monotonic() + 60
                    time.sleep(1.0)
                    doc = client.retrieve(batch_id)
                    bar.bar.update(sum(_counts(doc)) - bar.bar.n)
            finally:
                bar.close()
            outcome.status = str(doc["status"])
            outcome.completed, outcome.failed = _counts(doc)
            created, ended = (
                doc.get("created_at"),
                doc.get("completed_at") or doc.get("cancelled_at") or doc.get("failed_at"),
            )
            if isinstance(created, int) and isinstance(ended, int):
                outcome.seconds_to_final = float(ended - created)
        finally:
            client.close()
    finally:
        stack.stop()
    settings: dict[str, object] = {
        "preset": PRESET,
        "engines": engines,
        "max_num_seqs": seqs,
        "epp_replicas": replicas,
        "duration": args.duration,
        "seed": args.seed,
        "prompt_tokens": args.min_prompt_tokens,
        "output_tokens": args.output_tokens,
        "batch_lines": args.batch_lines,
        "online_fraction": ONLINE_FRACTION,
        "window_start_s": WINDOW_START * args.duration,
        "epp_args": list(cfg.epp_args),
        **{
            k: getattr(args, k, None)
            for k in "sim_prefill_time_per_token sim_itl sim_itl_per_seq sim_kv_blocks sim_time_scale".split()
        },
    }
    return BatchAndOnlineResult(rows, outcome, settings)


# -- report -----------------------------------------------------------------------------------


TABLE_HEADERS = [
    "run",
    "req/s",
    "sent",
    "ok",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "ITL p50 ms",
    "ITL p90 ms",
    "client tok/s",
    "pool tok/s",
]


def table_rows(rows: Sequence[RunRow]) -> list[list[str]]:
    out = []
    for r in rows:
        s = r.summary
        out.append(
            [
                r.run,
                "closed loop" if r.offered_req_s is None else f"{r.offered_req_s:.2f}",
                str(len(r.results)),
                str(sum(1 for x in r.results if x.ok)),
                report.ms(s.ttft_p50_s),
                report.ms(s.ttft_p90_s),
                report.ms(s.itl_p50_s),
                report.ms(s.itl_p90_s),
                f"{r.window_tok_s:.0f}",
                "-" if r.pool_tok_s is None else f"{r.pool_tok_s:.0f}",
            ]
        )
    return out


def summary_lines(result: BatchAndOnlineResult) -> list[str]:
    b = result.batch
    ratio, share = result.ttft_p90_ratio(), result.leftover_share()
    left, batch = result.leftover_tok_s(), result.batch_tok_s()
    lines = [
        f"online TTFT p90 beside the batch / alone: {report.times(ratio)} (target <= {TTFT_P90_TARGET:g}x)",
        f"batch output tok/s in the online window: {'-' if batch is None else f'{batch:.0f}'} of "
        f"{'-' if left is None else f'{left:.0f}'} left over by the online load "
        f"({'-' if share is None else f'{share * 100:.0f}%'}; target >= {LEFTOVER_TARGET * 100:.0f}%)",
        f"batch: {b.status}, {b.completed:,} of {b.lines:,} lines completed, {b.failed:,} failed, "
        f"{b.lines_done_in_window:,} during the online window"
        + ("" if b.seconds_to_final is None else f"; {b.seconds_to_final:.0f} s from creation to {b.status}"),
    ]
    return lines


def print_report(args: argparse.Namespace, result: BatchAndOnlineResult, started: str) -> None:
    s = result.settings
    print(
        f"batch-and-online: {s['engines']} simulated engine(s) of {s['max_num_seqs']} batch slots, "
        f"{s['epp_replicas']} EPP replicas at their defaults, {s['prompt_tokens']}-token prompts, "
        f"{s['output_tokens']}-token answers, {s['duration']:g} s per run, online at "
        f"{ONLINE_FRACTION * 100:.0f}% of the measured capacity, seed {s['seed']}"
    )
    print(f"tokens/s counted from {s['window_start_s']:g} s to the end of each run's arrivals")
    print()
    print(report.plain_table(TABLE_HEADERS, table_rows(result.rows), left=1))
    print()
    for line in summary_lines(result):
        print(line)
    if args.markdown:
        print()
        print(report.markdown_rows(TABLE_HEADERS, table_rows(result.rows)))
    if args.json:
        path = Path(args.json)
        write_json(path, result, started)
        print(f"results: {path}")


def write_json(path: Path, result: BatchAndOnlineResult, started: str) -> None:
    doc = {
        "preset": PRESET,
        "settings": {**result.settings, "started": started},
        "rows": [r.record() for r in result.rows],
        "batch": asdict(result.batch),
        "capacity_output_tok_s": result.capacity_tok_s(),
        "leftover_output_tok_s": result.leftover_tok_s(),
        "batch_output_tok_s": result.batch_tok_s(),
        "online_ttft_p90_ratio": result.ttft_p90_ratio(),
        "batch_share_of_leftover": result.leftover_share(),
        "targets": {"ttft_p90_ratio_max": TTFT_P90_TARGET, "leftover_share_min": LEFTOVER_TARGET},
        "targets_met": result.targets_met(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")


def main(args: argparse.Namespace, slo: Slo, progress: bool | None) -> int:
    """`kvgate bench --preset batch-and-online` after the preset filled its flags. Exit 1 when
    a run completed no request or the batch did not complete."""
    return preset_main(
        args,
        check_args,
        lambda: run_preset(args, slo, progress),
        print_report,
        lambda result: (
            all(any(r.ok for r in row.results) for row in result.rows) and result.batch.status == "completed"
        ),
    )
