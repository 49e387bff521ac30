"""Subscribes to each engine's KV events (vLLM ZMQ layout) and keeps the precise index current.

Sequence numbers are checked; on a gap the missed batches are fetched from the engine's replay
socket (vLLM semantics: a DEALER sends ``["", start_seq]`` and receives ``["", seq, payload]``
frames until ``seq`` is all-ones). If the replay cannot cover the gap, the endpoint's entries
are dropped rather than trusted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from kvgate.api.contracts import admissions
from kvgate.api.contracts.kv_events import KVEventDecodeError, decode_batch, decode_seq, encode_seq
from kvgate.epp.datastore import Datastore, Endpoint
from kvgate.epp.endpoint_tasks import EndpointTasks

log = logging.getLogger("kvgate.epp.kv_events")

END_SEQ = b"\xff" * 8


class EndpointSubscriber:
    """Sequence bookkeeping for one endpoint, separate from sockets so tests can drive it."""

    def __init__(
        self,
        datastore: Datastore,
        endpoint: Endpoint,
        replay: Callable[[int], Awaitable[list[tuple[int, bytes]]]] | None = None,
    ) -> None:
        self.datastore = datastore
        self.endpoint = endpoint
        self.replay = replay
        self.last_seq: int | None = None
        # after the initial replay: batches up to this sequence may still sit in the SUB queue
        # (published while we replayed); they are duplicates, not a publisher restart
        self._replayed_through: int | None = None
        self.gaps = 0
        self.replayed = 0
        self.resets = 0

    def _apply(self, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except KVEventDecodeError as exc:
            log.warning("endpoint %s: undecodable KV-event batch: %s", self.endpoint.address, exc)
            return
        self.datastore.index.apply(self.endpoint.address, batch.events)

    async def initial_sync(self) -> None:
        """Fetch what the engine already holds before trusting live events (EPP readiness waits
        for this). Without a replay socket there is nothing to fetch."""
        if self.replay is None or self.last_seq is not None:
            return
        try:
            batches = sorted(await self.replay(0))
        except Exception as exc:  # readiness must not hang on an engine that never answers
            state = self.datastore.get(self.endpoint.address)
            if state is not None and state.metrics.updated_at == 0:
                # never scraped either: an engine still starting has nothing cached to replay
                log.info(
                    "endpoint %s: no KV-event replay yet (engine starting); following live events",
                    self.endpoint.address,
                )
            else:
                log.warning("endpoint %s: initial KV-event replay failed: %s", self.endpoint.address, exc)
            return
        for _, payload in batches:
            self._apply(payload)
        self.replayed += len(batches)
        if batches:
            self.last_seq = self._replayed_through = batches[-1][0]

    async def on_message(self, seq: int, payload: bytes) -> None:
        through = self._replayed_through
        if through is not None:
            if seq <= through:
                return  # already applied by the initial replay
            self._replayed_through = None
        last = self.last_seq
        if last is not None and seq <= last:
            # the publisher restarted (its counter reset): what we hold is from a dead cache
            log.info(
                "endpoint %s: KV-event sequence went back (%d after %d); resetting",
                self.endpoint.address,
                seq,
                last,
            )
            self.resets += 1
            self.datastore.index.clear(self.endpoint.address)
            last = None
        expected = 0 if last is None else last + 1
        if seq > expected:
            await self._fill_gap(expected, seq, initial=last is None)
        self._apply(payload)
        self.last_seq = seq

    async def _fill_gap(self, start: int, stop: int, initial: bool) -> None:
        self.gaps += 0 if initial else 1
        covered = False
        if self.replay is not None:
            try:
                batches = await self.replay(start)
            except Exception as exc:  # a dead or slow replay socket must not stop the subscriber
                log.warning("endpoint %s: KV-event replay failed: %s", self.endpoint.address, exc)
                batches = []
            batches = [(s, p) for s, p in batches if start <= s < stop]
            covered = bool(batches) and batches[0][0] == start and len(batches) == stop - start
            if covered or initial:
                for _, payload in batches:
                    self._apply(payload)
                self.replayed += len(batches)
        if not covered and not initial:
            log.warning(
                "endpoint %s: missed KV events %d..%d and could not replay them; dropping its index entries",
                self.endpoint.address,
                start,
                stop - 1,
            )
            self.datastore.index.clear(self.endpoint.address)


class KVEventSubscribers:
    """One SUB socket (and optional replay DEALER) per endpoint that publishes KV events."""

    def __init__(self, datastore: Datastore, replay_timeout: float = 1.0, sync_timeout: float = 5.0) -> None:
        self.datastore = datastore
        self.ctx = zmq.asyncio.Context()
        self.replay_timeout = replay_timeout
        # bound on the initial replay: an engine that never answers cannot hold readiness back
        self.sync_timeout = sync_timeout
        self._tasks = EndpointTasks("kv-events")
        self.subscribers: dict[str, EndpointSubscriber] = {}
        datastore.subscribe(self._on_endpoint)
        for state in datastore.all():
            self._on_endpoint(state.endpoint, True)

    def _on_endpoint(self, endpoint: Endpoint, added: bool) -> None:
        self.subscribers.pop(endpoint.address, None)
        run = (lambda: self._run(endpoint)) if added and endpoint.kv_events else None
        self._tasks.replace(endpoint.address, run)

    async def _replay(self, address: str, start: int) -> list[tuple[int, bytes]]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        out: list[tuple[int, bytes]] = []
        try:
            await sock.send_multipart([b"", encode_seq(start)])
            while True:
                if not await sock.poll(int(self.replay_timeout * 1000)):
                    raise TimeoutError(f"no replay answer from {address} within {self.replay_timeout}s")
                frames = await sock.recv_multipart()
                if len(frames) < 3:
                    raise KVEventDecodeError(f"replay frame has {len(frames)} parts, expected 3")
                if frames[1] == END_SEQ:
                    return out
                out.append((decode_seq(frames[1]), frames[2]))
        finally:
            sock.close()

    async def _run(self, endpoint: Endpoint) -> None:
        assert endpoint.kv_events is not None
        replay_addr = endpoint.kv_replay
        replay = (lambda start: self._replay(replay_addr, start)) if replay_addr else None
        sub = EndpointSubscriber(self.datastore, endpoint, replay)
        self.subscribers[endpoint.address] = sub
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint.kv_events)
        state = self.datastore.get(endpoint.address)
        log.info("endpoint %s: subscribed to KV events at %s", endpoint.address, endpoint.kv_events)
        try:
            # SUB is connected first, so batches published during the replay are queued, not lost
            try:
                async with asyncio.timeout(self.sync_timeout):
                    await sub.initial_sync()
            except TimeoutError:
                log.warning(
                    "endpoint %s: no initial KV-event replay within %.0fs; going on without it",
                    endpoint.address,
                    self.sync_timeout,
                )
            if state is not None:
                state.kv_synced = True
            while True:
                frames = await sock.recv_multipart()
                if len(frames) == 2 and admissions.is_admission_topic(frames[0]):
                    self._admission(endpoint.address, frames[1])
                    continue
                if len(frames) != 3:
                    log.warning(
                        "endpoint %s: KV-event message has %d frames, expected 3",
                        endpoint.address,
                        len(frames),
                    )
                    continue
                try:
                    seq = decode_seq(frames[1])
                except KVEventDecodeError as exc:
                    log.warning("endpoint %s: %s", endpoint.address, exc)
                    continue
                await sub.on_message(seq, frames[2])
                if state is not None and not state.kv_events_live:
                    # only an engine that actually publishes is trusted as the prefix source;
                    # until then its prefixes come from our own routing (approximate index)
                    state.kv_events_live = True
                    log.info("endpoint %s: KV events flowing", endpoint.address)
        finally:
            if state is not None:
                state.kv_events_live = False
            sock.close()

    def _admission(self, address: str, payload: bytes) -> None:
        try:
            admission = admissions.decode(payload)
        except admissions.AdmissionDecodeError as exc:
            log.warning("endpoint %s: %s", address, exc)
            return
        self.datastore.note_admission(address, admission)

    async def close(self) -> None:
        await self._tasks.close()
        self.ctx.term()
