"""How far a running batch has got: its rate since it started and the time left at that rate
(the metrics' gauges and `kvgate batch status` share it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """Where a running batch stands: lines finished per second since it started, and the
    seconds left at that rate (None until a line has finished)."""

    total: int
    completed: int
    failed: int
    lines_per_s: float | None
    eta_s: float | None


def progress(total: int, completed: int, failed: int, started_at: float | None, now: float) -> Progress:
    finished = completed + failed
    elapsed = now - started_at if started_at is not None else 0.0
    if finished <= 0 or elapsed <= 0:
        return Progress(total, completed, failed, None, None)
    rate = finished / elapsed
    return Progress(total, completed, failed, rate, max(0, total - finished) / rate)


def duration(seconds: float) -> str:
    """3h04m, 4m05s, 12s."""
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"
