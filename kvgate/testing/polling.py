"""`eventually()`: the one way the tests wait for something to become true.

A test never sleeps for a fixed time and then asserts: it polls the real condition until it
holds, and fails with what it was waiting for (and the last thing it saw) when it does not.
`eventually` is for plain code and threads, `eventually_async` for coroutines; both take the
same arguments and treat an exception raised by ``check`` as "not yet".
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, TypeVar

T = TypeVar("T")

INTERVAL_S = 0.05


class Watched(Protocol):
    """A process worth watching while waiting: if it dies, waiting any longer is pointless."""

    name: str

    def alive(self) -> bool: ...

    def log_tail(self, n: int = 30) -> str: ...


class NotReached(AssertionError):
    """What ``eventually`` waited for did not happen (in time, or a watched process died)."""


def _dead(what: str, watch: Sequence[Watched]) -> NotReached | None:
    for proc in watch:
        if not proc.alive():
            return NotReached(f"{what}: {proc.name} exited\n{proc.log_tail()}")
    return None


def _timed_out(what: str, within: float, last: object, watch: Sequence[Watched]) -> NotReached:
    logs = "".join(f"\n--- {p.name}:\n{p.log_tail()}" for p in watch)
    return NotReached(f"{what}: not within {within:g} s (last: {last!r}){logs}")


def _cause(last: object) -> BaseException | None:
    return last if isinstance(last, BaseException) else None


def eventually(
    check: Callable[[], T],
    within: float = 10.0,
    what: str = "condition",
    *,
    interval: float = INTERVAL_S,
    watch: Sequence[Watched] = (),
) -> T:
    """Calls ``check`` until it returns something truthy, and returns that.

    An exception from ``check`` counts as "not yet" (a server not listening yet, a key not
    there yet) and is shown if time runs out. ``watch``: processes whose death ends the wait
    at once, with their last log lines.
    """
    deadline = time.monotonic() + within
    last: object = None
    while True:
        try:
            last = check()
            if last:
                return last
        except Exception as exc:
            last = exc
        if (dead := _dead(what, watch)) is not None:
            raise dead
        if time.monotonic() >= deadline:
            raise _timed_out(what, within, last, watch) from _cause(last)
        time.sleep(interval)


async def eventually_async(
    check: Callable[[], T | Awaitable[T]],
    within: float = 10.0,
    what: str = "condition",
    *,
    interval: float = INTERVAL_S,
    watch: Sequence[Watched] = (),
) -> T:
    """`eventually` inside an event loop: ``check`` may be plain or return an awaitable, and
    the loop keeps running between tries."""
    deadline = time.monotonic() + within
    last: object = None
    while True:
        try:
            result = check()
            if inspect.isawaitable(result):
                result = await result
            last = result
            if result:
                return result
        except Exception as exc:
            last = exc
        if (dead := _dead(what, watch)) is not None:
            raise dead
        if time.monotonic() >= deadline:
            raise _timed_out(what, within, last, watch) from _cause(last)
        await asyncio.sleep(interval)
