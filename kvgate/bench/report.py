"""Human and machine output of a bench run: an aligned table, a Markdown table, JSON records."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from kvgate.bench.stats import RequestResult, Summary

# (header, attribute, format) — times shown in milliseconds, rates as percentages.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("strategy", "strategy", "s"),
    ("req", "requests", "d"),
    ("err", "errors", "d"),
    ("TTFT p50 ms", "ttft_p50_s", "ms"),
    ("TTFT p90 ms", "ttft_p90_s", "ms"),
    ("TTFT p99 ms", "ttft_p99_s", "ms"),
    ("ITL p50 ms", "itl_p50_s", "ms"),
    ("ITL p90 ms", "itl_p90_s", "ms"),
    ("ITL p99 ms", "itl_p99_s", "ms"),
    ("E2E p90 ms", "e2e_p90_s", "ms"),
    ("out tok/s", "output_tok_s", ".1f"),
    ("goodput req/s", "goodput_req_s", ".2f"),
    ("prefix hit", "prefix_hit_rate", "%"),
    ("ideal hit", "ideal_prefix_hit_rate", "%"),
    ("KV pulled", "kv_transfer_bytes", "bytes"),
    ("LoRA loads", "lora_loads", "d"),
)


def _cell(value: object, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "ms":
        return f"{float(value) * 1000:.1f}"  # type: ignore[arg-type]
    if fmt == "bytes":
        return human_bytes(float(value))  # type: ignore[arg-type]
    if fmt == "%":
        return f"{float(value) * 100:.1f}%"  # type: ignore[arg-type]
    if fmt == "s":
        return str(value)
    return format(value, fmt)


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def rows(summaries: Sequence[Summary]) -> tuple[list[str], list[list[str]]]:
    headers = [h for h, _, _ in COLUMNS]
    body = [[_cell(getattr(s, attr), fmt) for _, attr, fmt in COLUMNS] for s in summaries]
    return headers, body


def text_table(summaries: Sequence[Summary]) -> str:
    headers, body = rows(summaries)
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in body]
    return "\n".join(out)


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}×" if a is not None and b else "-"


def ratio_table(summaries: Sequence[Summary], candidate: str = "precise-prefix") -> str | None:
    """Per request rate: the candidate's TTFT p50/p90 and output throughput as multiples of each
    other strategy's at that same rate (< 1× is better for TTFT, > 1× for throughput)."""
    by_rate: dict[float | None, list[Summary]] = {}
    for s in summaries:
        by_rate.setdefault(s.request_rate, []).append(s)
    headers = ["req/s", "vs", "TTFT p50", "TTFT p90", "out tok/s", "prefix hit"]
    body: list[list[str]] = []
    for rate, rows in by_rate.items():
        mine = next((s for s in rows if s.strategy == candidate), None)
        if mine is None:
            continue
        for other in rows:
            if other is mine:
                continue
            body.append(
                [
                    "inf" if rate is None else f"{rate:g}",
                    other.strategy,
                    _ratio(mine.ttft_p50_s, other.ttft_p50_s),
                    _ratio(mine.ttft_p90_s, other.ttft_p90_s),
                    _ratio(mine.output_tok_s, other.output_tok_s),
                    _ratio(mine.prefix_hit_rate, other.prefix_hit_rate),
                ]
            )
    if not body:
        return None
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    title = f"{candidate} as a multiple of each other strategy at the same rate"
    return "\n".join([title, line(headers), line(["-" * w for w in widths]), *(line(r) for r in body)])


def markdown_table(summaries: Sequence[Summary]) -> str:
    headers, body = rows(summaries)
    return markdown_rows(headers, body)


def markdown_rows(headers: Sequence[str], body: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(out)


def plain_table(headers: Sequence[str], body: Sequence[Sequence[str]], left: int = 1) -> str:
    """An aligned text table of ready-made cells: the first `left` columns flush left, the rest
    right (numbers)."""
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in body)])


def write_json(path: Path, summaries: Sequence[Summary], settings: dict[str, object]) -> None:
    """A JSON list with one record per strategy (or rate); each carries the run's settings."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = [{**s.as_record(), "settings": settings} for s in summaries]
    path.write_text(json.dumps(doc, indent=2) + "\n")


def slo_line(summaries: Sequence[Summary]) -> str:
    if not summaries:
        return ""
    s = summaries[0]
    return (
        f"goodput: requests/s that succeeded with TTFT ≤ {s.slo_ttft_s * 1000:.0f} ms "
        f"and mean ITL ≤ {s.slo_itl_s * 1000:.0f} ms"
    )


def write_requests_jsonl(path: Path, label: str, results: Sequence[RequestResult]) -> None:
    """Every request's timings, for analysis beyond the summary (one JSON object per line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for r in results:
            rec = {
                "strategy": label,
                "index": r.index,
                "group": r.group,
                "upstream": r.upstream,
                "sent_at": r.sent_at,
                "status": r.status,
                "ttft": r.ttft,
                "e2e": r.e2e,
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "output_tokens": r.output_tokens,
                "itl_max": max(r.itls, default=None),
                "error": r.error,
            }
            f.write(json.dumps(rec) + "\n")


def ms(seconds: float | None) -> str:
    """Seconds as whole milliseconds; '-' for none."""
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def times(v: float | None) -> str:
    """A ratio as 1.23x, 12.3x or 123x; '-' for none."""
    if v is None:
        return "-"
    return f"{v:.0f}x" if v >= 100 else f"{v:.2f}x" if v < 10 else f"{v:.1f}x"
