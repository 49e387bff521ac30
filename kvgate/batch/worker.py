"""The worker: sends each batch's pending lines through the gateway and finalizes batches.

A line is sent with ``x-gateway-inference-objective`` set to the batch objective (run the EPP
with ``--objective batch=-1`` so it is sheddable) and the submitting client's Authorization.
Its outcome is committed before it counts. A 429/503 refusal puts the line back (its attempt
refunded) and backs the whole worker off (AIMD, Retry-After); other failures (5xx, connection
errors) are retried until ``max_attempts``; a 4xx answer is final and goes to the error file.

Replicas sharing one database each claim their own lines (see store.py): each renews the leases
of the lines it is sending, and takes back lines whose lease ran out (a replica that died).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx
from sqlalchemy.exc import SQLAlchemyError

from kvgate.batch import objects
from kvgate.batch.blobs import Blobs
from kvgate.batch.limiter import Aimd, retry_after
from kvgate.batch.metrics import BatchMetrics, completion_tokens
from kvgate.batch.store import (
    CANCELLED,
    CANCELLING,
    COMPLETED,
    DONE,
    EXPIRED,
    FAILED,
    FINALIZING,
    IN_PROGRESS,
    VALIDATING,
    FileRow,
    LineToSend,
    Store,
    TransitionError,
    new_id,
)

log = logging.getLogger(__name__)

OBJECTIVE_HEADER = "x-gateway-inference-objective"
EXPIRED_ERROR = "batch_expired: this request was not run before the batch's completion window ended"
REFUSED = (429, 503)


class Worker:
    def __init__(
        self,
        store: Store,
        blobs: Blobs,
        gateway_url: str,
        *,
        objective: str = "batch",
        max_concurrency: int = 16,
        max_attempts: int = 3,
        request_timeout_s: float = 600.0,
        poll_s: float = 0.1,
        client: httpx.AsyncClient | None = None,
        commit_retry_s: float = 30.0,
        metrics: BatchMetrics | None = None,
    ) -> None:
        self.store = store
        self.blobs = blobs
        self.gateway_url = gateway_url.rstrip("/")
        self.objective = objective
        self.max_attempts = max_attempts
        self.limiter = Aimd(cap=max_concurrency)
        self.poll_s = poll_s
        self.client = client or httpx.AsyncClient(timeout=request_timeout_s, trust_env=False)
        self.tasks: dict[int, tuple[str, asyncio.Task[None]]] = {}  # line id -> (batch id, task)
        self._wake = asyncio.Event()
        self.commit_retry_s = commit_retry_s  # how long an outcome is retried while the database is away
        self._next_lease_work = 0.0
        self.metrics = metrics or BatchMetrics(store)
        self.metrics.concurrency.set_function(lambda: self.limiter.limit)
        self.metrics.in_flight.set_function(lambda: self.limiter.in_flight)

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        recovered = self.store.recover()
        if recovered:
            log.info("%d lines in flight at the last stop are pending again", recovered)
        try:
            while True:
                try:
                    self._leases()
                    self.step()
                except Exception as exc:
                    log.warning("batch worker step failed (%s: %s); retrying", type(exc).__name__, exc)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=max(self.poll_s, self.limiter.wait_s()))
        finally:
            for _, task in list(self.tasks.values()):
                task.cancel()
            await asyncio.gather(*(t for _, t in self.tasks.values()), return_exceptions=True)
            await self.client.aclose()

    def _leases(self) -> None:
        """Every third of a lease: renew ours, and take back lines whose lease ran out."""
        now = time.monotonic()
        if now < self._next_lease_work:
            return
        self._next_lease_work = now + self.store.lease_s / 3
        self.store.renew(list(self.tasks))
        taken = self.store.recover(own=False)
        if taken:
            log.info("%d lines whose lease ran out are pending again", taken)

    def step(self) -> None:
        for b in self.store.batches_in(VALIDATING):
            with contextlib.suppress(TransitionError):
                self.store.transition(b.id, (VALIDATING,), IN_PROGRESS)
        for b in self.store.batches_in(CANCELLING):
            self._cancel_in_flight(b.id)
            # and no other replica still sending one of its lines (it puts them back, or its
            # leases run out)
            if self.store.in_flight(b.id) == 0:
                self._finalize(b.id, CANCELLED)
        now = time.time()
        for b in self.store.batches_in(IN_PROGRESS):
            if b.expires_at is not None and now >= b.expires_at:
                self._expire(b.id)
                continue
            room = self.limiter.room()
            for line in self.store.claim(b.id, room):
                self._send(line, b.created_at)
            if self.store.unfinished(b.id) == 0:
                with contextlib.suppress(TransitionError):
                    self.store.transition(b.id, (IN_PROGRESS,), FINALIZING)
        for b in self.store.batches_in(FINALIZING):
            self._finalize(b.id, COMPLETED)

    def _expire(self, batch_id: str) -> None:
        """Past its completion window (OpenAI's ``expired``): nothing more is sent, the lines in
        flight are taken back, and once no replica sends any, what never ran fails with
        ``batch_expired`` into the error file; finished lines keep their results."""
        self._cancel_in_flight(batch_id)
        if self.store.in_flight(batch_id) == 0:
            self.store.expire_pending(batch_id, EXPIRED_ERROR)
            self._finalize(batch_id, EXPIRED)

    def _send(self, line: LineToSend, batch_created_at: float) -> None:
        self.limiter.in_flight += 1
        task = asyncio.create_task(self._attempt(line, batch_created_at))
        self.tasks[line.id] = (line.batch_id, task)

    def _cancel_in_flight(self, batch_id: str) -> None:
        for line_id, (bid, task) in list(self.tasks.items()):
            if bid == batch_id:
                task.cancel()
                self.tasks.pop(line_id, None)
                self.limiter.in_flight -= 1
                self.store.release_line(line_id, refund_attempt=True)  # our claim: we still track it

    async def _attempt(self, line: LineToSend, batch_created_at: float) -> None:
        try:
            await self._attempt_once(line, batch_created_at)
        except Exception as exc:  # the outcome could not be committed: the lease runs out, it is retried
            log.warning("line %s of %s: %s: %s", line.custom_id, line.batch_id, type(exc).__name__, exc)
        finally:
            if self.tasks.pop(line.id, None) is not None:
                self.limiter.in_flight -= 1
            self.wake()

    async def _attempt_once(self, line: LineToSend, batch_created_at: float) -> None:
        headers = {"content-type": "application/json", OBJECTIVE_HEADER: self.objective}
        if line.authorization:
            headers["authorization"] = line.authorization
        sent = time.monotonic()
        try:
            r = await self.client.post(self.gateway_url + line.url, content=line.body, headers=headers)
        except httpx.HTTPError as exc:
            self.metrics.attempts.labels("error").inc()
            await self._retry_or_fail(
                line, None, None, f"connection_error: {type(exc).__name__}: {exc}"[:500]
            )
            return
        request_id = r.headers.get("x-request-id")
        if r.status_code in REFUSED:
            self.metrics.attempts.labels("refused").inc()
            self.limiter.refused(retry_after(r.headers.get("retry-after")))
            await self._commit(
                lambda: self.store.release_line(line.id, refund_attempt=True, attempt=line.attempts)
            )
            return
        self.metrics.duration_seconds.observe(time.monotonic() - sent)
        if line.attempts == 1:  # its first send the pool took (a refusal refunds the attempt)
            self.metrics.queue_seconds.observe(max(0.0, time.time() - batch_created_at))
        if 200 <= r.status_code < 300:
            self.metrics.attempts.labels("ok").inc()
            self.limiter.success()
            ours = await self._commit(
                lambda: self.store.finish_line(
                    line.id,
                    DONE,
                    status_code=r.status_code,
                    result=r.text,
                    request_id=request_id,
                    attempt=line.attempts,
                )
            )
            if ours:
                self.metrics.lines.labels("completed").inc()
                self.metrics.output_tokens.inc(completion_tokens(r.text))
            return
        self.metrics.attempts.labels("error").inc()
        if r.status_code >= 500:
            await self._retry_or_fail(
                line, r.status_code, r.text, f"server_error: the gateway answered {r.status_code}"
            )
            return
        ours = await self._commit(
            lambda: self.store.finish_line(
                line.id,
                FAILED,
                status_code=r.status_code,
                result=r.text,
                error=f"{_error_code(r.text, r.status_code)}: {_error_message(r.text, r.status_code)}",
                request_id=request_id,
                attempt=line.attempts,
            )
        )
        if ours:
            self.metrics.lines.labels("failed").inc()

    async def _commit(self, write: Callable[[], object]) -> object:
        """A line's outcome written, retried while the database is unreachable (restarting):
        the answer is in hand, and sending the line again would run it twice. Returns what the
        write did (finish_line: False when the line was no longer ours)."""
        deadline = time.monotonic() + self.commit_retry_s
        delay = 0.1
        while True:
            try:
                return write()
            except SQLAlchemyError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)

    async def _retry_or_fail(
        self, line: LineToSend, status: int | None, body: str | None, reason: str
    ) -> None:
        if line.attempts >= self.max_attempts:
            code, _, message = reason.partition(": ")
            ours = await self._commit(
                lambda: self.store.finish_line(
                    line.id,
                    FAILED,
                    status_code=status,
                    result=body,
                    error=f"{code}: failed after {line.attempts} attempts; last: {message}",
                    attempt=line.attempts,
                )
            )
            if ours:
                self.metrics.lines.labels("failed").inc()
        else:
            await self._commit(
                lambda: self.store.release_line(line.id, refund_attempt=False, attempt=line.attempts)
            )

    def _finalize(self, batch_id: str, to: str) -> None:
        """Writes the output and error files from the finished lines, then ends the batch."""
        row = self.store.get_batch(batch_id)
        if row is None:
            return
        done: list[dict[str, Any]] = []
        failed: list[dict[str, Any]] = []
        for line in self.store.finished_lines(batch_id):
            (done if line.status == DONE else failed).append(objects.output_line(line))
        now = int(time.time())
        files: list[tuple[str, FileRow]] = []
        for attr, lines, name in (("output_file_id", done, "output"), ("error_file_id", failed, "error")):
            if not lines:
                continue
            data = "".join(json.dumps(x, separators=(",", ":")) + "\n" for x in lines).encode()
            file_id = new_id("file-")
            path = self.blobs.write(file_id, data)
            files.append(
                (
                    attr,
                    FileRow(
                        id=file_id,
                        owner=row.owner,
                        filename=f"{batch_id}_{name}.jsonl",
                        purpose="batch_output",
                        bytes=len(data),
                        created_at=now,
                        path=str(path),
                    ),
                )
            )
        final = self.store.finalize(batch_id, to, files)
        if any(getattr(final, attr) != f.id for attr, f in files):  # another replica was first
            for _, f in files:
                self.blobs.delete(f.id)
            return
        log.info("batch %s %s: %d done, %d failed", batch_id, to, len(done), len(failed))


def _error_doc(text: str) -> dict:
    try:
        doc = json.loads(text)
    except ValueError:
        return {}
    err = doc.get("error") if isinstance(doc, dict) else None
    return err if isinstance(err, dict) else {}


def _error_code(text: str, status: int) -> str:
    return str(_error_doc(text).get("code") or f"http_{status}")


def _error_message(text: str, status: int) -> str:
    return str(_error_doc(text).get("message") or f"the gateway answered {status}")[:500]
