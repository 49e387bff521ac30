"""KV-cache events over ZMQ, in vLLM's wire layout (what llm-d's indexer subscribes to).

PUB socket (bound, or connected to a subscriber that binds — llm-d's push layout): every engine step that changed the cache sends one 3-frame message
``[topic, seq (8-byte big-endian), msgpack([ts, [event, ...], dp_rank])]``. Sequence numbers
start at 0 and grow by one per batch, so a subscriber sees a gap when it missed messages.

ROUTER replay socket (optional): a client (DEALER, or REQ) sends one frame holding an 8-byte
big-endian start sequence number. The server answers, in order, with one message per buffered
batch whose seq >= start — frames ``[seq (8 bytes), payload]`` — followed by an end marker
``[b"\\xff" * 8 (seq -1 as signed 8 bytes), b""]``. Only the last `buffer_size` batches are kept;
a start older than the buffer gets what is left. This is vLLM's `ZmqEventPublisher` behaviour.

`publish` is called from the engine thread only (ZMQ sockets are single-threaded); the replay
socket lives in its own thread and reads the shared ring buffer under a lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence

import zmq

from kvgate.api.contracts import admissions
from kvgate.api.contracts.kv_events import KVEvent, KVEventBatch, encode_batch, encode_seq

log = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    def __init__(
        self,
        endpoint: str,
        topic: str,
        replay_endpoint: str | None = None,
        buffer_size: int = 10_000,
        data_parallel_rank: int = 0,
        connect: bool = False,
    ) -> None:
        self.topic = topic.encode()
        # kv@<host:port>@<model> -> kvgate-admitted@<host:port>@<model>
        self.admission_topic = admissions.TOPIC_PREFIX.encode() + self.topic.partition(b"@")[2]
        self._dp_rank = data_parallel_rank
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        if connect:  # push mode (llm-d style): the subscriber binds, every engine connects to it
            self._pub.connect(endpoint)
            self.endpoint = endpoint
        else:
            self._pub.bind(endpoint)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_size)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.replay_endpoint: str | None = None
        self._replay_thread: threading.Thread | None = None
        if replay_endpoint:
            ready = threading.Event()
            self._replay_thread = threading.Thread(
                target=self._serve_replay, args=(replay_endpoint, ready), name="kv-replay", daemon=True
            )
            self._replay_thread.start()
            ready.wait(5)
            if self.replay_endpoint is None:
                self._pub.close()
                raise OSError(f"cannot bind the KV-event replay socket at {replay_endpoint}")

    def publish(self, events: Sequence[KVEvent]) -> None:
        if not events:
            return
        payload = encode_batch(
            KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=self._dp_rank)
        )
        seq = self._seq
        self._seq += 1
        with self._lock:
            self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self.topic, encode_seq(seq), payload), flags=zmq.NOBLOCK)
        except zmq.Again:  # PUB never blocks past its HWM; a slow subscriber catches up via replay
            pass

    def publish_admission(
        self,
        picked_by: str,
        token_ids: list[int],
        lora_id: int | None,
        fairness_id: str | None = None,
        service_tokens: float = 0.0,
    ) -> None:
        """Announce a request a kvgate EPP replica picked (see kvgate.api.contracts.admissions),
        with the tenant it served and the service it charged when the EPP said them.
        Not sequenced or replayed: an announcement only bridges the seconds before the KV events
        and scrapes that follow it, so a lost one costs nothing lasting (for fair shares: that
        tenant's service on this replica is counted a little low until its next pick)."""
        payload = admissions.encode(
            admissions.Admission(
                picked_by, token_ids, lora_id, fairness_id=fairness_id, service_tokens=service_tokens
            )
        )
        try:
            self._pub.send_multipart((self.admission_topic, payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _serve_replay(self, endpoint: str, ready: threading.Event) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(endpoint)
            self.replay_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            log.error("KV-event replay socket: cannot bind %s: %s", endpoint, exc)
            sock.close()
            return
        finally:
            ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                # The timeout only bounds how long `close` waits; requests wake the poll at once.
                if not poller.poll(250):
                    continue
                frames = sock.recv_multipart()
                self._answer(sock, frames)
        finally:
            sock.close()

    def _answer(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        # [identity, b"", start] from REQ/DEALER-with-delimiter, [identity, start] from a bare DEALER.
        if len(frames) == 3 and frames[1] == b"":
            envelope, start_frame = frames[:2], frames[2]
        elif len(frames) == 2:
            envelope, start_frame = frames[:1], frames[1]
        else:
            log.warning("KV-event replay: ignoring a malformed request of %d frames", len(frames))
            return
        if len(start_frame) != 8:
            log.warning("KV-event replay: start sequence must be 8 bytes, got %d", len(start_frame))
            sock.send_multipart([*envelope, END_SEQ, b""])
            return
        start = int.from_bytes(start_frame, "big")
        with self._lock:
            batches = [(seq, payload) for seq, payload in self._buffer if seq >= start]
        for seq, payload in batches:
            sock.send_multipart([*envelope, encode_seq(seq), payload])
        sock.send_multipart([*envelope, END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        if self._replay_thread is not None:
            self._replay_thread.join(timeout=2)
        self._pub.close()
