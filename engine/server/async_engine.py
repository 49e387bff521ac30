"""Runs the synchronous `LLMEngine` in its own thread and bridges it to asyncio.

The event loop never touches the engine: it posts commands (add, abort) to a list guarded by
a condition variable, and the engine thread applies them between steps. After each step the
thread hands every new output to the loop in ONE `call_soon_threadsafe` call, which routes it
to the per-request queue. With nothing to do, the thread sleeps on the condition variable.

The engine thread also feeds the metrics (latencies per request, engine counters per step)
and publishes the KV events the step produced, so those stay exact without extra locking. One
read-only exception: on admission the loop looks up how much of the prompt the prefix cache
holds (dict lookups, atomic under the GIL), so /metrics can count the request's prefill work
before the engine thread takes it in.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvgate.api.contracts.admissions import Pick
from kvgate.api.contracts.queue_order import QueueOrder
from kvgate.engine.llm_engine import LoRANotLoaded
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.server.errors import APIError
from kvgate.engine.server.kv_publisher import KVEventPublisher
from kvgate.engine.server.metrics import EngineMetrics, FinishedRequestStats, StatsSnapshot
from kvgate.engine.structured import StructuredOutputSpec

log = logging.getLogger(__name__)


# Longer prompts are counted whole rather than hashed on the event loop (~0.2 ms per 1k tokens).
_PROBE_MAX_TOKENS = 16384


class EngineDeadError(RuntimeError):
    """The engine stopped (crash: 500) or the server is shutting down (503) mid-request."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    lora_id: int | None
    accepted: asyncio.Future[None]
    arrival_wall: float  # time.time() at arrival: the engine's own timestamps are wall clock
    parent: _Parent
    pick: Pick | None = None  # a kvgate EPP replica routed it: announce its admission
    order: QueueOrder = field(default_factory=QueueOrder)  # its place in the waiting queue


@dataclass
class _Parent:
    """The `n` sequences of one prompt (vLLM's parent request): vllm:request_params_n and
    vllm:request_max_num_generation_tokens are observed once, when the last of them ends."""

    n: int
    unfinished: int
    max_generation_tokens: int = 0


@dataclass
class _Timing:
    arrival: float
    arrival_wall: float
    max_tokens: int | None
    parent: _Parent
    last_token: float | None = None


@dataclass
class _StepResult:
    outputs: list[RequestOutput] = field(default_factory=list)
    accepts: list[tuple[asyncio.Future[None], BaseException | None]] = field(default_factory=list)


class RequestHandle:
    """One client request: `n` engine requests whose outputs arrive tagged with their index."""

    def __init__(self, engine: AsyncEngine, ids: list[str]) -> None:
        self._engine = engine
        self.ids = ids
        self.queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException] = asyncio.Queue()
        self.unfinished = set(ids)

    async def next(self) -> tuple[int, RequestOutput]:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        if item[1].finished:
            self.unfinished.discard(item[1].request_id)
        return item

    @property
    def done(self) -> bool:
        return not self.unfinished

    def close(self) -> None:
        """Abort whatever has not finished (client gone, error) and stop routing outputs here."""
        self._engine._release(self)


class AsyncEngine:
    def __init__(
        self,
        engine: Any,  # LLMEngine: duck-typed so the server does not pin its constructor
        metrics: EngineMetrics,
        publisher: KVEventPublisher | None = None,
        max_queued_requests: int | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.publisher = publisher
        self.max_queued_requests = max_queued_requests
        self._cv = threading.Condition()
        self._adds: list[_Add] = []
        self._aborts: list[str] = []
        self._calls: list[tuple[Callable[[Any], Any], asyncio.Future[Any]]] = []
        self._stopping = False
        self._routes: dict[str, tuple[RequestHandle, int]] = {}
        self._handles: set[RequestHandle] = set()
        self._pending: set[asyncio.Future[None]] = set()  # admissions the engine has not answered
        # Requests that will still be waiting after the next step's admissions (engine thread
        # writes): a request that just arrived to a free slot is not "queued".
        self._waiting = 0
        self._max_num_seqs = int(getattr(getattr(engine, "config", None), "max_num_seqs", 0) or 0)
        self._timings: dict[str, _Timing] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.dead_reason: str | None = None
        self._idle_event = asyncio.Event()  # set while no client request is in flight
        self._idle_event.set()
        self._compile_slots = asyncio.Semaphore(2)

    # ---- lifecycle -------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_reason is None

    @property
    def num_in_flight(self) -> int:
        return len(self._handles)

    async def wait_idle(self, within: float) -> bool:
        """Wait until no client request is in flight; False if `within` seconds ran out first."""
        try:
            await asyncio.wait_for(self._idle_event.wait(), within)
            return True
        except TimeoutError:
            return False

    def stop(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.publisher is not None:
            self.publisher.close()

    # ---- event-loop side -------------------------------------------------------------------
    async def compile_structured(self, spec: StructuredOutputSpec) -> None:
        """Compile a structured-output constraint off the event loop, a few at a time (a
        compile is bounded by the grammar library's limits, but many at once would starve
        the engine thread). Raises StructuredOutputError when it cannot be used."""
        async with self._compile_slots:
            await asyncio.to_thread(self.engine.structured.compile, spec)

    async def submit(
        self,
        request_id: str,
        items: list[tuple[list[int], SamplingParams]],
        lora_id: int | None = None,
        pick: Pick | None = None,
        order: QueueOrder | None = None,
    ) -> RequestHandle:
        """Admit one client request as one engine request per (prompt, params) item.

        Engine ids are `request_id` for a single item, else `<request_id>-<i>`. Raises APIError
        when refused (queue full: 429; engine down: 503; bad input the engine caught: 400).
        """
        if not self.alive:
            raise APIError(503, "The engine is not running.", code="engine_dead")
        assert self._loop is not None
        ids = [request_id] if len(items) == 1 else [f"{request_id}-{i}" for i in range(len(items))]
        handle = RequestHandle(self, ids)
        arrival = time.monotonic()
        arrival_wall = time.time()
        parents = _parents(items)
        futures = []
        # The service the EPP charged is the whole request's: announced once, with its first
        # sequence (the others are announced for their prefixes alone).
        rest = Pick(pick.picked_by) if pick is not None else None
        with self._cv:
            if self.max_queued_requests is not None:
                waiting = self._waiting + len(self._adds)
                if waiting + len(ids) > self.max_queued_requests:
                    raise APIError(
                        429,
                        f"The server's waiting queue is full ({waiting} of {self.max_queued_requests} "
                        "requests); retry shortly.",
                        code="queue_full",
                        headers={"Retry-After": "1"},
                    )
            for index, (rid, (prompt, params)) in enumerate(zip(ids, items, strict=True)):
                fut = self._loop.create_future()
                futures.append(fut)
                self._pending.add(fut)
                self._routes[rid] = (handle, index)
                self._adds.append(
                    _Add(
                        rid,
                        prompt,
                        params,
                        arrival,
                        lora_id,
                        fut,
                        arrival_wall,
                        parents[index],
                        pick if index == 0 else rest,
                        order or QueueOrder(),
                    )
                )
            self._cv.notify()
        # Only the uncached part is work: a request whose prefix is cached must not make this
        # engine look busier than it is (a router would send the prefix's next users elsewhere).
        kv = getattr(self.engine, "kv", None)
        work = sum(
            len(prompt)
            - (
                kv.cached_prefix_tokens(prompt, lora_id)
                if kv is not None and len(prompt) <= _PROBE_MAX_TOKENS
                else 0
            )
            for prompt, _ in items
        )
        with self.metrics.lock:
            self.metrics.note_submitted(len(ids), work)
        self._handles.add(handle)
        self._idle_event.clear()
        try:
            await asyncio.gather(*futures)
        except BaseException:
            handle.close()
            raise
        return handle

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run fn(engine) on the engine thread between two steps (e.g. register a LoRA adapter
        that a worker thread has read); its result or exception comes back here."""
        if not self.alive:
            raise APIError(503, "The engine is not running.", code="engine_dead")
        assert self._loop is not None
        fut: asyncio.Future[Any] = self._loop.create_future()
        with self._cv:
            self._calls.append((fn, fut))
            self._cv.notify()
        return await fut

    def _release(self, handle: RequestHandle) -> None:
        if handle not in self._handles:
            return
        self._handles.discard(handle)
        for rid in handle.ids:
            self._routes.pop(rid, None)
        if handle.unfinished:
            with self._cv:
                self._aborts.extend(handle.unfinished)
                self._cv.notify()
        if not self._handles:
            self._idle_event.set()

    def _deliver(self, result: _StepResult) -> None:
        for fut, err in result.accepts:
            self._pending.discard(fut)
            if not fut.done():
                if err is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(err)
        for out in result.outputs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue  # the client left; its abort is on the way
            handle, index = route
            handle.queue.put_nowait((index, out))
            if out.finished:
                self._routes.pop(out.request_id, None)

    def fail_all(self, reason: str, status: int = 500) -> None:
        """End every request in flight with an error (engine crash, or shutdown timeout)."""
        err = EngineDeadError(reason, status)
        for fut in self._pending:
            if not fut.done():
                fut.set_exception(APIError(status if status != 500 else 503, reason, code="engine_stopped"))
        self._pending.clear()
        for handle in list(self._handles):
            handle.queue.put_nowait(err)

    # ---- engine thread ---------------------------------------------------------------------
    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed during shutdown
            pass

    def _run(self) -> None:
        engine = self.engine
        busy = False
        try:
            while True:
                with self._cv:
                    while not (self._adds or self._aborts or self._calls or busy or self._stopping):
                        self._cv.wait()
                    if self._stopping:
                        return
                    adds, self._adds = self._adds, []
                    aborts, self._aborts = self._aborts, []
                    calls, self._calls = self._calls, []
                    for fn, fut in calls:
                        try:
                            self._post(_settle, fut, fn(engine), None)
                        except Exception as exc:  # the caller turns it into its HTTP error
                            self._post(_settle, fut, None, exc)
                    result = _StepResult()
                    for add in adds:
                        refused = self._apply_add(add)
                        result.accepts.append((add.accepted, refused))
                        if refused is None and add.pick is not None and self.publisher is not None:
                            # Before the step: the other EPP replicas learn of this pick now,
                            # not after its prefill stores blocks.
                            self.publisher.publish_admission(
                                add.pick.picked_by,
                                add.prompt_token_ids,
                                add.lora_id,
                                add.pick.fairness_id,
                                add.pick.service_tokens,
                            )
                    # After the adds: a client may leave before its admission was answered.
                    for rid in aborts:
                        # A client that left mid-request counts as finished_reason="abort".
                        if self._timings.pop(rid, None) is not None and engine.abort_request(rid):
                            with self.metrics.lock:
                                self.metrics.request_finished("abort")
                    if adds:
                        stats = engine.get_stats()
                        self._waiting = self._queued(stats.num_waiting, stats.num_running)
                if adds:
                    # The engine's own counts now include them (cache hits known): publish
                    # before the step, which may be long.
                    with self.metrics.lock:
                        self.metrics.update(StatsSnapshot.from_engine_stats(stats))
                    # Answer admissions before the (possibly long) step so errors return at once.
                    self._post(self._deliver, result)
                    result = _StepResult()
                busy = engine.has_unfinished_requests()
                if busy:
                    # A router learns where this step's prompt blocks live at its start, not
                    # after a prefill that may take most of a second.
                    result.outputs = engine.step(on_scheduled=self._publish_kv_events)
                now = time.monotonic()
                self._publish_kv_events()
                snap = StatsSnapshot.from_engine_stats(engine.get_stats())
                self._waiting = self._queued(snap.num_waiting, snap.num_running)
                with self.metrics.lock:
                    if result.outputs:
                        self._observe(result.outputs, now)
                    self.metrics.update(snap)
                if result.outputs:
                    self._post(self._deliver, result)
                busy = engine.has_unfinished_requests()
        except Exception as exc:  # a bug or a device failure: fail loudly, keep serving /health 503
            log.exception("engine loop crashed")
            self.dead_reason = f"engine loop crashed: {type(exc).__name__}"
            self._post(self.fail_all, self.dead_reason)

    def _publish_kv_events(self) -> None:
        events = self.engine.drain_kv_events()
        if self.publisher is not None and events:
            self.publisher.publish(events)

    def _queued(self, waiting: int, running: int) -> int:
        if not self._max_num_seqs:
            return waiting
        return max(0, waiting - max(0, self._max_num_seqs - running))

    def _apply_add(self, add: _Add) -> BaseException | None:
        try:
            self.engine.add_request(
                add.request_id,
                add.prompt_token_ids,
                add.params,
                lora_id=add.lora_id,
                priority=add.order.priority,
                tenant=add.order.tenant,
                over_share=add.order.over_share,
            )
        except LoRANotLoaded:
            # the server checked the name before an unload reached the engine: an unknown model,
            # as vLLM answers it (the server puts the model's name in; it is not known here)
            return APIError(404, "The model does not exist.", param="model", code="model_not_found")
        except ValueError as exc:
            return APIError(400, str(exc), code="invalid_request")
        self._timings[add.request_id] = _Timing(
            add.arrival, add.arrival_wall, add.params.max_tokens, add.parent
        )
        return None

    def _observe(self, outputs: list[RequestOutput], now: float) -> None:
        m = self.metrics
        m.touch()
        # vLLM's iteration tokens: tokens generated this step plus the whole prompt of each
        # request whose prefill completed in it (the same accounting as vllm:prompt_tokens).
        iteration_tokens = 0
        for out in outputs:
            iteration_tokens += len(out.new_token_ids)
            if out.new_token_ids and len(out.token_ids) == len(out.new_token_ids):
                iteration_tokens += len(out.prompt_token_ids)
                m.prompt_done(
                    len(out.prompt_token_ids),
                    out.num_cached_tokens,
                    out.num_recomputed_tokens,
                    out.num_host_cached_tokens,
                )
            timing = self._timings.get(out.request_id)
            if timing is None:
                continue
            if out.new_token_ids:
                if timing.last_token is None:
                    m.ttft.observe(now - timing.arrival)
                else:
                    m.itl.observe(now - timing.last_token)
                timing.last_token = now
            if out.finished:
                del self._timings[out.request_id]
                m.e2e.observe(now - timing.arrival)
                m.request_finished(out.finish_reason)
                m.request_done(_finished_stats(out, timing))
                parent = timing.parent
                parent.unfinished -= 1
                parent.max_generation_tokens = max(parent.max_generation_tokens, len(out.token_ids))
                if parent.unfinished == 0:
                    m.parent_done(parent.n, parent.max_generation_tokens)
        if outputs:
            m.iteration_tokens.observe(iteration_tokens)


def _settle(fut: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _parents(items: list[tuple[list[int], SamplingParams]]) -> list[_Parent]:
    """Which items are the n sequences of one prompt: the server fans `n` out into consecutive
    items sharing one prompt list (a new prompt, even with equal tokens, is a new list)."""
    groups: list[list[int]] = []
    previous: list[int] | None = None
    for index, (prompt, _) in enumerate(items):
        if groups and prompt is previous:
            groups[-1].append(index)
        else:
            groups.append([index])
        previous = prompt
    out: list[_Parent] = [_Parent(1, 1)] * len(items)
    for group in groups:
        parent = _Parent(n=len(group), unfinished=len(group))
        for index in group:
            out[index] = parent
    return out


def _finished_stats(out: RequestOutput, timing: _Timing) -> FinishedRequestStats:
    """vLLM's phases from the engine's wall-clock timestamps; queueing starts at the server's
    arrival, so the wait before the engine thread took the request in counts as queued."""
    end = out.finished_time if out.finished_time is not None else time.time()
    scheduled = out.first_scheduled_time if out.first_scheduled_time is not None else end
    first_token = out.first_token_time if out.first_token_time is not None else end
    return FinishedRequestStats(
        queue_time=max(0.0, scheduled - timing.arrival_wall),
        prefill_time=max(0.0, first_token - scheduled),
        decode_time=max(0.0, end - first_token),
        inference_time=max(0.0, end - scheduled),
        num_prompt_tokens=len(out.prompt_token_ids),
        num_generation_tokens=len(out.token_ids),
        num_cached_tokens=out.num_cached_tokens,
        max_tokens_param=timing.max_tokens,
    )
