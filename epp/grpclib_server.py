"""The ext_proc service (and gRPC health, for Envoy's cluster check) on grpclib.

grpclib speaks HTTP/2 in the EPP's own event loop. grpcio's asyncio server hands every read and
write between its poller thread and the loop, and an ext_proc request is four of them (request
headers, body; header answer, body answer), each write waiting for the last to complete: on a
busy 2-core host each hand-off is a thread wake-up. ``bench/epp_latency.py latency`` (a
no-scoring EPP on each server, each behind its own Envoy, paired requests, 4 runs of 20 s):
Envoy+EPP added p50 1.82 ms (grpclib) vs 2.48 ms (grpcio) over Envoy direct at 200 req/s, p99
3.41 vs 4.76 ms; 1.67 vs 2.51 ms p50 at 50 req/s. ``--grpc-server grpcio`` keeps the old server.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
from typing import Any

from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2
from grpclib.const import Cardinality, Handler, Status
from grpclib.exceptions import GRPCError
from grpclib.protocol import Connection, EventsProcessor, H2Protocol
from grpclib.server import Server, Stream
from h2.connection import H2Connection
from h2.settings import SettingCodes, Settings

from kvgate.epp.extproc import EndpointPickerHandler, run_exchange
from kvgate.epp.health import EppHealth

PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
HEALTH_CHECK = "/grpc.health.v1.Health/Check"
HEALTH_WATCH = "/grpc.health.v1.Health/Watch"
# grpcio's default grpc.max_receive_message_length; Envoy sends ext_proc bodies in chunks
# (FULL_DUPLEX_STREAMED), far below it
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# HTTP/2 streams one connection may hold open (SETTINGS_MAX_CONCURRENT_STREAMS). h2 offers 100,
# and a HEADERS frame over the limit raises out of h2 (it cannot refuse just that stream without
# breaking HPACK), so grpclib closed the whole connection: every ext_proc stream on it reset, and
# Envoy's outlier detection ejected the EPP. Envoy holds one stream per request in flight, so an
# overloaded gateway passes 100 on its one connection. grpcio advertises no limit; Envoy's own
# circuit breaker (max_requests, 1,024 by default) bounds what it opens, far below this.
MAX_CONCURRENT_STREAMS = 65_536
# listen() backlog: grpclib's default of 100 dropped connections Envoy opened in a burst
LISTEN_BACKLOG = socket.SOMAXCONN


async def recv_bounded(stream: Stream[Any, Any], limit: int) -> Any | None:
    """The next message, or None at the end of the client's side; a declared length over
    ``limit`` is refused from its 5-byte prefix, before any of it is read.

    grpclib's ``Stream.recv_message`` reads whatever length the prefix declares (up to 4 GiB),
    acknowledging (so inviting) every byte, so one client could make the EPP buffer gigabytes.
    Only this function uses grpclib's internals (the HTTP/2 stream's ``recv_data``, the codec,
    the request type; grpclib 0.4.x, pinned in pyproject.toml, and tested in
    tests/epp/test_grpc_servers.py). Unread bytes stay unacknowledged, so HTTP/2 flow control
    (4 MiB windows) stops the sender; the GRPCError ends the stream with its status, and grpclib
    acknowledges and drops whatever arrives for it afterwards.
    """
    h2_stream, codec, message_type = stream._stream, stream._codec, stream._recv_type
    try:
        prefix: bytes = await h2_stream.recv_data(5)
    except AssertionError:  # grpclib's "Received less data than expected": the stream ended early
        raise GRPCError(Status.INVALID_ARGUMENT, "truncated gRPC message") from None
    if not prefix:
        return None
    compressed, length = struct.unpack(">?I", prefix)
    if compressed:  # never negotiated (no grpc-encoding offered); grpclib raised NotImplementedError
        raise GRPCError(Status.UNIMPLEMENTED, "compressed gRPC messages are not supported")
    if length > limit:
        raise GRPCError(
            Status.RESOURCE_EXHAUSTED, f"gRPC message of {length} bytes is over the limit of {limit}"
        )
    try:
        data: bytes = await h2_stream.recv_data(length)
    except AssertionError:
        raise GRPCError(Status.INVALID_ARGUMENT, "truncated gRPC message") from None
    try:
        return codec.decode(data, message_type)
    except DecodeError:
        raise GRPCError(Status.INVALID_ARGUMENT, "the gRPC message is not valid protobuf") from None


class _ExtProc:
    def __init__(self, handler: EndpointPickerHandler, max_message_bytes: int) -> None:
        self.handler = handler
        self.max_message_bytes = max_message_bytes
        self.streams = 0  # under way, for a graceful stop
        self.idle = asyncio.Event()
        self.idle.set()

    async def process(self, stream: Stream[ep.ProcessingRequest, ep.ProcessingResponse]) -> None:
        self.streams += 1
        self.idle.clear()
        try:
            limit = self.max_message_bytes
            await run_exchange(self.handler, lambda: recv_bounded(stream, limit), stream.send_message)
        finally:
            self.streams -= 1
            if not self.streams:
                self.idle.set()

    def __mapping__(self) -> dict[str, Handler]:
        return {
            PROCESS: Handler(
                self.process, Cardinality.STREAM_STREAM, ep.ProcessingRequest, ep.ProcessingResponse
            )
        }


class _Health:
    """grpc.health.v1 from EppHealth's statuses (the same answers as the grpcio servicer)."""

    def __init__(self, health: EppHealth, max_message_bytes: int, watch_interval: float = 0.2) -> None:
        self.health = health
        self.max_message_bytes = max_message_bytes
        self.watch_interval = watch_interval

    def _status(self, service: str) -> int | None:
        return self.health.statuses.get(service)

    async def _request(
        self, stream: Stream[health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse]
    ) -> health_pb2.HealthCheckRequest:
        request = await recv_bounded(stream, self.max_message_bytes)
        if request is None:
            raise GRPCError(Status.INVALID_ARGUMENT, "no HealthCheckRequest")
        return request

    async def check(
        self, stream: Stream[health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse]
    ) -> None:
        request = await self._request(stream)
        status = self._status(request.service)
        if status is None:
            raise GRPCError(Status.NOT_FOUND, f"unknown service {request.service!r}")
        await stream.send_message(health_pb2.HealthCheckResponse(status=status))

    async def watch(
        self, stream: Stream[health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse]
    ) -> None:
        request = await self._request(stream)
        last: int | None = -1
        while True:
            status = self._status(request.service)
            if status != last:
                unknown = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
                await stream.send_message(
                    health_pb2.HealthCheckResponse(status=unknown if status is None else status)
                )
                last = status
            await asyncio.sleep(self.watch_interval)

    def __mapping__(self) -> dict[str, Handler]:
        req, resp = health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
        return {
            HEALTH_CHECK: Handler(self.check, Cardinality.UNARY_UNARY, req, resp),
            HEALTH_WATCH: Handler(self.watch, Cardinality.UNARY_STREAM, req, resp),
        }


class _H2Protocol(H2Protocol):
    """grpclib's server protocol with MAX_CONCURRENT_STREAMS in its first SETTINGS frame.

    grpclib builds its h2 connection in ``connection_made`` with h2's fixed 100; this does the
    same steps (grpclib 0.4.x, checked in tests/epp/test_grpc_servers.py) with the limit set
    before the preface, so it holds from the first stream, not from the peer's SETTINGS ACK."""

    def connection_made(self, transport: Any) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None:  # as grpclib: no Nagle delay on answers
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        h2_conn = H2Connection(config=self.h2_config)
        h2_conn.local_settings = Settings(
            client=False,
            initial_values={
                SettingCodes.MAX_CONCURRENT_STREAMS: MAX_CONCURRENT_STREAMS,
                SettingCodes.MAX_HEADER_LIST_SIZE: H2Connection.DEFAULT_MAX_HEADER_LIST_SIZE,
            },
        )
        h2_conn.initiate_connection()
        initial = h2_conn.local_settings.initial_window_size
        if delta := self.config.http2_connection_window_size - initial:
            h2_conn.increment_flow_control_window(delta)
        if self.config.http2_stream_window_size != initial:
            h2_conn.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: self.config.http2_stream_window_size})
        self.connection = Connection(h2_conn, transport, config=self.config)
        self.connection.flush()
        self.connection.initialize()
        self.processor = EventsProcessor(self.handler, self.connection)


class _Server(Server):
    def _protocol_factory(self) -> H2Protocol:
        protocol = super()._protocol_factory()
        return _H2Protocol(protocol.handler, protocol.config, protocol.h2_config)


class GrpclibExtProcServer:
    """Bound at construction (port 0 picks a free one, like grpcio's add_port)."""

    def __init__(
        self,
        handler: EndpointPickerHandler,
        health: EppHealth,
        host: str,
        port: int,
        tls: tuple[bytes, bytes] | None = None,  # (certificate PEM, key PEM)
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.extproc = _ExtProc(handler, max_message_bytes)
        self.server = _Server([self.extproc, _Health(health, max_message_bytes)])
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP spelled out: asyncio sets TCP_NODELAY only on accepted sockets whose proto
        # says TCP, and without it Nagle held each answer for a delayed ACK (+20-44 ms per pick)
        self.sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError:
            self.sock.close()
            raise
        self.port: int = self.sock.getsockname()[1]
        self.ssl: ssl.SSLContext | None = None
        if tls is not None:
            self.ssl = _server_tls(*tls)

    async def start(self) -> None:
        await self.server.start(sock=self.sock, ssl=self.ssl, backlog=LISTEN_BACKLOG)

    async def stop(self, grace: float) -> None:
        """Streams under way get ``grace`` seconds to finish (health already says NOT_SERVING,
        so Envoy sends no new ones), then every connection closes."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.extproc.idle.wait(), grace)
        self.server.close()
        await self.server.wait_closed()


def _server_tls(cert: bytes, key: bytes) -> ssl.SSLContext:
    import tempfile
    from pathlib import Path

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory() as tmp:
        c, k = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
        c.write_bytes(cert)
        k.write_bytes(key)
        ctx.load_cert_chain(c, k)
    ctx.set_alpn_protocols(["h2"])
    return ctx
