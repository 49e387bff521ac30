"""`kvgate batch status`: a key's batches at a gateway, each with a progress bar; --watch follows
one (or all unfinished) until it ends."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvgate.batch.progress import duration, progress

HELP = (
    "show batches (status, a progress bar of lines done and failed, rate and ETA) at a gateway; --watch "
    "follows them"
)
FINAL = ("completed", "failed", "cancelled", "expired")
EXIT_USAGE = 2


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("batch_id", nargs="?", default=None, help="one batch (default: the key's most recent)")
    p.add_argument(
        "--url",
        default=None,
        help="the gateway (or the batch service) base URL; default: --stack-file's gateway, else "
        "http://127.0.0.1:8080",
    )
    p.add_argument("--stack-file", default=None, type=Path, help="stack.json written by `kvgate up`")
    p.add_argument(
        "--api-key",
        default=None,
        help="the key the batches were created with (each key sees only its own); default: $OPENAI_API_KEY",
    )
    p.add_argument("--limit", type=int, default=10, help="how many recent batches to list")
    p.add_argument("--watch", action="store_true", help="redraw until every batch shown has ended")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between redraws with --watch")
    p.add_argument("--json", action="store_true", help="print the Batch objects as JSON instead")


def bar(done: int, failed: int, total: int, width: int = 30) -> str:
    """[####xx......]  done+failed of total, # done and x failed."""
    if total <= 0:
        return "[" + "." * width + "]"
    n_done = int(width * done / total)
    n_failed = min(width - n_done, int(width * (done + failed) / total) - n_done)
    return "[" + "#" * n_done + "x" * n_failed + "." * (width - n_done - n_failed) + "]"


def line(b: dict[str, Any], now: float | None = None) -> str:
    """One batch: status, bar, lines finished; while in progress its rate since it started and
    the time left at that rate (from the Batch object's in_progress_at and request_counts)."""
    counts = b.get("request_counts") or {}
    total, done, failed = (int(counts.get(k) or 0) for k in ("total", "completed", "failed"))
    pct = 100.0 * (done + failed) / total if total else 0.0
    text = (
        f"{b['id']}  {b['status']:<11} {bar(done, failed, total)} {done + failed}/{total} "
        f"({pct:.0f}%), {failed} failed"
    )
    if b.get("status") == "in_progress":
        started = b.get("in_progress_at")
        p = progress(
            total, done, failed, float(started) if started else None, time.time() if now is None else now
        )
        if p.lines_per_s is None or p.eta_s is None:
            text += ", ETA unknown"
        else:
            text += f", {p.lines_per_s:.2f} lines/s, ETA {duration(p.eta_s)}"
    return text


def _base_url(args: argparse.Namespace) -> str:
    if args.url:
        return str(args.url).rstrip("/")
    if args.stack_file:
        return str(json.loads(args.stack_file.read_text())["gateway_url"]).rstrip("/")
    return "http://127.0.0.1:8080"


def run(args: argparse.Namespace) -> int:
    import httpx

    if args.interval <= 0 or not 1 <= args.limit <= 100:
        print("kvgate batch status: --interval must be > 0 and --limit within 1..100", file=sys.stderr)
        return EXIT_USAGE
    try:
        base = _base_url(args)
    except (OSError, ValueError, KeyError) as exc:
        print(f"kvgate batch status: --stack-file: {exc}", file=sys.stderr)
        return EXIT_USAGE
    key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"authorization": f"Bearer {key}"} if key else {}
    redraw = args.watch and sys.stdout.isatty()
    drawn = 0
    with _client() as client:
        while True:
            try:
                if args.batch_id:
                    r = client.get(f"{base}/v1/batches/{args.batch_id}", headers=headers)
                    if r.status_code != 200:
                        print(f"kvgate batch status: {base}: {_message(r)}", file=sys.stderr)
                        return 1
                    batches = [r.json()]
                else:
                    r = client.get(f"{base}/v1/batches", params={"limit": args.limit}, headers=headers)
                    if r.status_code != 200:
                        print(f"kvgate batch status: {base}: {_message(r)}", file=sys.stderr)
                        return 1
                    batches = list(r.json()["data"])
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                print(f"kvgate batch status: {base}: {type(exc).__name__}: {exc}", file=sys.stderr)
                return 1
            if args.json:
                out = [json.dumps(b) for b in batches]
            else:
                out = [line(b) for b in batches] or ["no batches for this key"]
            if redraw and drawn:
                sys.stdout.write(f"\x1b[{drawn}F\x1b[J")  # back over the last drawing
            sys.stdout.write("\n".join(out) + "\n")
            sys.stdout.flush()
            drawn = len(out)
            if not args.watch or all(b["status"] in FINAL for b in batches):
                return 0
            time.sleep(args.interval)


def _client() -> Any:
    import httpx

    return httpx.Client(timeout=10.0, trust_env=False)


def _message(r: Any) -> str:
    try:
        return f"{r.status_code}: {r.json()['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{r.status_code}: {r.text[:200]}"
