"""The order in which the scheduler admits waiting requests.

Three policies, the first two vLLM's (`--scheduling-policy`):

- ``fcfs``: arrival order; a preempted request goes back to the front.
- ``priority``: the request's ``priority`` (lower first, vLLM's convention), then arrival.
- ``fair`` (the default): priority first, then the tenant that has been served least, then
  arrival. "Served" is a virtual token counter per tenant (VTC: prompt tokens computed plus
  output tokens, each weighted), charged as the scheduler computes them. A tenant that was idle
  starts again at the least-served backlogged tenant's count, so idling banks no credit.

With one tenant and one priority (traffic the gateway did not tag) every policy is arrival
order. Why the engine: a router places a request where its prefix lives; if that engine's queue
is in arrival order the request waits behind every prompt another tenant queued there first.
Ordering the queue here keeps the placement and drops the wait.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterator

from kvgate.engine.core.request import Request

POLICIES = ("fcfs", "priority", "fair")
# Weighted tokens of service within which tenants count as equally served (arrival order among
# them). Measured on the virtual pool (docs/tenancy.md): strict VTC order between four
# balanced tenants cost 16% of the output on llm-d's shared-prefix shape at 24 req/s, by
# moving requests away from the order the router placed their prefixes in; within 16,384
# tokens, 3.7%.
FAIR_TOLERANCE = 16384.0
# Counters kept for tenants with nothing queued: beyond this many, the least-served are
# forgotten first (they would be lifted to the backlog's minimum on return anyway).
MAX_IDLE_TENANTS = 4096


def _key(request: Request) -> tuple[int, float, int]:
    return (request.priority, request.arrival_time, request.seq_no)


class WaitingQueue:
    def __init__(
        self,
        policy: str = "fair",
        prompt_weight: float = 1.0,
        output_weight: float = 2.0,
        tolerance: float = FAIR_TOLERANCE,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        self.policy = policy
        self.prompt_weight = prompt_weight
        self.output_weight = output_weight
        self.tolerance = tolerance
        self._fifo: deque[Request] = deque()  # fcfs
        self._queues: dict[str, list[Request]] = {}  # priority/fair: per tenant, sorted by _key
        self.service: dict[str, float] = {}  # fair: each tenant's virtual token counter
        self._present: dict[str, int] = {}  # requests in the engine (waiting or running) per tenant
        self._len = 0

    # -- contents ------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request (in admission order for fcfs; otherwise tenant by tenant)."""
        if self.policy == "fcfs":
            yield from self._fifo
        else:
            for queue in self._queues.values():
                yield from queue

    def tenant_of(self, request: Request) -> str:
        """Whose share a request counts against: its tenant under the fair policy; one for all
        otherwise."""
        return request.tenant if self.policy == "fair" else ""

    def order_key(self, request: Request, floor: float | None = None) -> tuple[int, int, float, int]:
        """The policy's order (lower first) for any request, waiting or running: priority, then
        (fair) how many ``tolerance``s its tenant's service is above the least-served tenant
        in the engine (``floor``), then arrival. Tenants within one tolerance of each other
        are served in arrival order, which keeps the order a router placed prefixes by."""
        if self.policy == "fcfs":
            return (0, 0, request.arrival_time, request.seq_no)
        rank = 0
        if self.policy == "fair":
            if floor is None:
                floor = self.floor()
            rank = int((self.service.get(request.tenant, 0.0) - floor) // self.tolerance)
        return (request.priority, rank, request.arrival_time, request.seq_no)

    def floor(self) -> float:
        """The least service among the tenants with requests in the engine."""
        return min((self.service.get(t, 0.0) for t in self._present), default=0.0)

    # -- changes -------------------------------------------------------------------------
    def arrived(self, request: Request) -> None:
        """A new request entered the engine: it waits, in its place by (priority, arrival); for
        fcfs last."""
        tenant = self.tenant_of(request)
        if not self._present.get(tenant):
            self._lift(tenant)
        self._present[tenant] = self._present.get(tenant, 0) + 1
        self._insert(request, front=False)

    def departed(self, request: Request) -> None:
        """A request left the engine (finished or aborted, after ``remove`` if it waited)."""
        tenant = self.tenant_of(request)
        left = self._present.get(tenant, 0) - 1
        if left > 0:
            self._present[tenant] = left
        else:
            self._present.pop(tenant, None)
            self._forget_idle()

    def add_front(self, request: Request) -> None:
        """A request taken back from the running set or passed over: first of all for fcfs (it
        was ahead of everything still waiting); otherwise in its place, as vLLM's priority queue
        puts a preempted request back."""
        self._insert(request, front=True)

    def _insert(self, request: Request, front: bool) -> None:
        self._len += 1
        if self.policy == "fcfs":
            if front:
                self._fifo.appendleft(request)
            else:
                self._fifo.append(request)
            return
        bisect.insort(self._queues.setdefault(self.tenant_of(request), []), request, key=_key)

    def remove(self, request: Request) -> None:
        """Take a request out (aborted, or admitted); ValueError if it is not waiting."""
        if self.policy == "fcfs":
            self._fifo.remove(request)
        else:
            tenant = self.tenant_of(request)
            queue = self._queues.get(tenant)
            if queue is None:
                raise ValueError(f"request {request.request_id} is not waiting")
            queue.remove(request)
            if not queue:
                del self._queues[tenant]
        self._len -= 1

    def peek(self) -> Request | None:
        """The request to admit next, or None when none waits."""
        if self.policy == "fcfs":
            return self._fifo[0] if self._fifo else None
        floor = self.floor()
        return min(
            (queue[0] for queue in self._queues.values()),
            key=lambda r: self.order_key(r, floor),
            default=None,
        )

    # -- service accounting (fair) ---------------------------------------------------------
    def charge(self, request: Request, prompt_tokens: int, output_tokens: int) -> None:
        """The scheduler computed this many of the request's tokens in a step."""
        if self.policy != "fair":
            return
        cost = self.prompt_weight * prompt_tokens + self.output_weight * output_tokens
        self.service[request.tenant] = self.service.get(request.tenant, 0.0) + cost

    def _lift(self, tenant: str) -> None:
        """A tenant with nothing in the engine sends a request: it starts no lower than the
        least-served tenant that is in the engine (VTC's rule; otherwise a tenant idle for an hour
        would come back owed the hour)."""
        if self.policy != "fair":
            return
        others = [self.service.get(t, 0.0) for t in self._present if t != tenant]
        if others:
            # one tolerance below them: a light tenant's request goes before the queued work
            # of tenants that are using the engine, not after what arrived before it
            self.service[tenant] = max(self.service.get(tenant, -math.inf), min(others) - self.tolerance)

    def _forget_idle(self) -> None:
        """Bound the counters of tenants with nothing in the engine, least-served first (one
        that comes back is lifted to the others' minimum anyway)."""
        extra = len(self.service) - len(self._present) - MAX_IDLE_TENANTS
        if extra <= 0:
            return
        idle = sorted((v, t) for t, v in self.service.items() if t not in self._present)
        for _, tenant in idle[:extra]:
            del self.service[tenant]
