"""Adaptive concurrency for the lines sent to the gateway: AIMD, with Retry-After honoured.

Halve the allowed concurrency on a refusal (429/503), add one per success up to the cap, and
send nothing until a refusal's Retry-After (or an exponential backoff without one) has passed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Aimd:
    cap: int
    limit: float = 1.0
    min_backoff_s: float = 0.25
    max_backoff_s: float = 30.0
    in_flight: int = 0
    not_before: float = 0.0  # monotonic time before which nothing is sent
    _refusals_in_a_row: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        self.limit = max(1.0, min(float(self.cap), self.limit))

    def room(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        if now < self.not_before:
            return 0
        return max(0, int(self.limit) - self.in_flight)

    def wait_s(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        return max(0.0, self.not_before - now)

    def success(self) -> None:
        self._refusals_in_a_row = 0
        self.limit = min(float(self.cap), self.limit + 1.0)

    def refused(self, retry_after_s: float | None, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._refusals_in_a_row += 1
        self.limit = max(1.0, self.limit / 2.0)
        if retry_after_s is None:
            retry_after_s = self.min_backoff_s * 2 ** min(self._refusals_in_a_row - 1, 10)
        self.not_before = max(self.not_before, now + min(self.max_backoff_s, max(0.0, retry_after_s)))


def retry_after(value: str | None) -> float | None:
    """Retry-After in seconds (only the delta-seconds form; an HTTP date is ignored)."""
    if not value:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        return None
    return seconds if seconds >= 0 else None
