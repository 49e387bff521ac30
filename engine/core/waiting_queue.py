"""The order in which the scheduler admits waiting requests.

Three policies, the first two vLLM's (`--scheduling-policy`):

- ``fcfs``: arrival order; a preempted request goes back to the front.
- ``priority``: the request's ``priority`` (lower first, vLLM's convention), then arrival.
- ``fair`` (the default): priority first, then requests of tenants within their share of the
  pool before those of tenants over it, then arrival.

Who is over their share is the EPP's judgement, pool-wide (kvgate.api.contracts.queue_order:
it marks a request whose tenant sent more than its weighted share of the recent work). One
engine's own count would not do: it sees a few requests a second, and on llm-d's
shared-prefix shape with four equally loaded tenants ordering by it moved requests away from
the order the router placed their prefixes in, for 14-25% of the output past saturation.

Untagged traffic (no EPP, or one tenant) keeps arrival order under every policy. Why the
engine: a router places a request where its prefix lives; if that engine's queue is in arrival
order the request waits behind every prompt another tenant queued there first. Ordering the
queue here keeps the placement and drops the wait.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from kvgate.engine.core.request import Request

POLICIES = ("fcfs", "priority", "fair")


class WaitingQueue:
    def __init__(self, policy: str = "fair") -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        self.policy = policy
        self._fifo: deque[Request] = deque()  # fcfs
        self._sorted: list[Request] = []  # priority/fair: by order_key

    # -- contents ------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._fifo) if self.policy == "fcfs" else len(self._sorted)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, in admission order."""
        yield from self._fifo if self.policy == "fcfs" else self._sorted

    def tenant_of(self, request: Request) -> str:
        """Whose share a request counts against: its tenant under the fair policy; one for all
        otherwise."""
        return request.tenant if self.policy == "fair" else ""

    def order_key(self, request: Request) -> tuple[int, int, float, int]:
        """The policy's order (lower first) for any request, waiting or running."""
        if self.policy == "fcfs":
            return (0, 0, request.arrival_time, request.seq_no)
        over = int(request.over_share) if self.policy == "fair" else 0
        return (request.priority, over, request.arrival_time, request.seq_no)

    # -- changes -------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """A new arrival: it takes its place (last, for fcfs)."""
        if self.policy == "fcfs":
            self._fifo.append(request)
        else:
            bisect.insort(self._sorted, request, key=self.order_key)

    def add_front(self, request: Request) -> None:
        """A request taken back from the running set or passed over: first of all for fcfs (it
        was ahead of everything still waiting); otherwise in its place, as vLLM's priority queue
        puts a preempted request back."""
        if self.policy == "fcfs":
            self._fifo.appendleft(request)
        else:
            bisect.insort(self._sorted, request, key=self.order_key)

    def remove(self, request: Request) -> None:
        """Take a request out (aborted, or admitted); ValueError if it is not waiting."""
        (self._fifo if self.policy == "fcfs" else self._sorted).remove(request)

    def peek(self) -> Request | None:
        """The request to admit next, or None when none waits."""
        queue = self._fifo if self.policy == "fcfs" else self._sorted
        return queue[0] if queue else None
