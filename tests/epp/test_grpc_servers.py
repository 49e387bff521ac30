"""Both ext_proc servers (--grpc-server grpclib, the default, and grpcio) over real gRPC on
loopback, plaintext and TLS: a pick, a refusal that ends the stream, gRPC health on the ext_proc
port (Envoy's cluster check), and (grpclib) a stop that lets a stream under way finish."""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import statistics
import time
from collections.abc import AsyncIterator
from contextlib import closing
from typing import Any

import h2.exceptions
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from grpc_health.v1 import health_pb2
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.exceptions import GRPCError, ProtocolError, StreamTerminatedError

from kvgate.epp.datastore import Endpoint
from kvgate.epp.health import EXT_PROC
from kvgate.epp.scheduling.config import load_config
from kvgate.epp.server import EppServer, ServerSettings

METRICS = (
    b'vllm:num_requests_waiting{model_name="m"} 0\n'
    b'vllm:num_requests_running{model_name="m"} 0\n'
    b'vllm:kv_cache_usage_perc{model_name="m"} 0.0\n'
)
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
CHECK = "/grpc.health.v1.Health/Check"


@pytest.fixture(params=["grpclib", "grpcio"])
def server_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=[False, True], ids=["plaintext", "tls"])
def secure(request: pytest.FixtureRequest) -> bool:
    return request.param


async def _engine_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """An engine's /metrics and /health, all the EPP's scraper reads (the pick never dials it)."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            payload = METRICS if head.startswith(b"GET /metrics") else b"{}"
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


@pytest.fixture
async def engine() -> AsyncIterator[str]:
    stub = await asyncio.start_server(_engine_answer, "127.0.0.1", 0)
    yield f"127.0.0.1:{stub.sockets[0].getsockname()[1]}"
    stub.close()


async def started(engine: str, server_kind: str, secure: bool = False, **settings: Any) -> EppServer:
    server = EppServer(
        ServerSettings(
            config=load_config(None, "round-robin"),
            endpoints=[Endpoint(engine)],
            grpc_port=0,
            grpc_health_port=0,
            metrics_port=0,
            secure_serving=secure,
            grpc_server=server_kind,
            **settings,
        )
    )
    await server.start()
    for _ in range(200):  # scraped once: a candidate
        if all(server.datastore.reachable(st) for st in server.datastore.all()):
            return server
        await asyncio.sleep(0.025)
    await server.stop()
    raise AssertionError("the engine stub was never scraped")


@pytest.fixture
async def epp(engine: str, server_kind: str, secure: bool) -> AsyncIterator[EppServer]:
    server = await started(engine, server_kind, secure)
    try:
        yield server
    finally:
        await server.stop()


def channel(server: EppServer) -> Channel:
    ctx = None
    if server.settings.secure_serving:  # a self-signed certificate, unverified (as Envoy does)
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        ctx.set_alpn_protocols(["h2"])
    return Channel("127.0.0.1", server.grpc_port, ssl=ctx)


def headers(eos: bool = False) -> ep.ProcessingRequest:
    hm = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
            base_pb2.HeaderValue(key="x-request-id", raw_value=b"req-1"),
        ]
    )
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hm, end_of_stream=eos))


def body(data: bytes) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=True))


CHAT = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


async def test_a_pick_and_the_body_back(epp: EppServer) -> None:
    with closing(channel(epp)) as ch:
        async with ch.request(
            PROCESS, Cardinality.STREAM_STREAM, ep.ProcessingRequest, ep.ProcessingResponse
        ) as s:
            await s.send_message(headers())
            await s.send_message(body(CHAT))
            first = await s.recv_message()
            second = await s.recv_message()
            await s.end()
            assert await s.recv_message() is None  # the EPP ends its side once Envoy has
    assert first is not None and second is not None
    muts = {
        h.header.key: h.header.raw_value for h in first.request_headers.response.header_mutation.set_headers
    }
    engine = epp.settings.endpoints[0].address
    assert muts["x-gateway-destination-endpoint"] == engine.encode()
    assert (
        first.dynamic_metadata.fields["envoy.lb"]
        .struct_value.fields["x-gateway-destination-endpoint"]
        .string_value
        == engine
    )
    streamed = second.request_body.response.body_mutation.streamed_response
    assert streamed.body == CHAT and streamed.end_of_stream


async def test_a_refusal_ends_the_stream(epp: EppServer) -> None:
    tail: object = "unread"
    with closing(channel(epp)) as ch:
        try:
            async with ch.request(
                PROCESS, Cardinality.STREAM_STREAM, ep.ProcessingRequest, ep.ProcessingResponse
            ) as s:
                await s.send_message(headers())
                await s.send_message(body(b"{not json"))
                refusal = await s.recv_message()
                tail = await s.recv_message()  # no end from us: the EPP closed the stream
                await s.end()
        except (StreamTerminatedError, ProtocolError):
            # grpcio also resets the stream, which grpclib's client reports
            assert epp.settings.grpc_server == "grpcio"
    assert refusal is not None and refusal.immediate_response.status.code == 400
    assert tail is None or epp.settings.grpc_server == "grpcio"


async def test_health_on_the_ext_proc_port(epp: EppServer) -> None:
    async def check(service: str) -> health_pb2.HealthCheckResponse:
        with closing(channel(epp)) as ch:
            async with ch.request(
                CHECK, Cardinality.UNARY_UNARY, health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
            ) as s:
                await s.send_message(health_pb2.HealthCheckRequest(service=service), end=True)
                reply = await s.recv_message()
                assert reply is not None
                return reply

    assert (await check(EXT_PROC)).status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(GRPCError) as err:
        await check("no.such.Service")
    assert err.value.status == Status.NOT_FOUND


async def test_stop_lets_a_stream_under_way_finish(engine: str) -> None:
    """grpclib only: grpcio's asyncio server.stop(grace=1.0) returned within 0.2 s here with
    the stream still open."""
    server = await started(engine, "grpclib")
    with closing(channel(server)) as ch:
        async with ch.request(
            PROCESS, Cardinality.STREAM_STREAM, ep.ProcessingRequest, ep.ProcessingResponse
        ) as s:
            await s.send_message(headers())
            stopping = asyncio.create_task(server.stop())
            await asyncio.sleep(0.2)  # the stop has begun; the stream is still open
            assert not stopping.done()
            await s.send_message(body(CHAT))
            first = await s.recv_message()
            assert first is not None and first.HasField("request_headers")
            await s.recv_message()
            await s.end()
        await asyncio.wait_for(stopping, 5)


async def test_answers_are_not_held_by_nagle(epp: EppServer) -> None:
    """The two answers of a pick leave at once: without TCP_NODELAY the second waited for the
    client's delayed ACK, ~40 ms a pick (Envoy+EPP added +20-44 ms p50 instead of ~3 ms)."""
    times = []
    with closing(channel(epp)) as ch:
        for _ in range(15):
            t0 = time.perf_counter()
            async with ch.request(
                PROCESS, Cardinality.STREAM_STREAM, ep.ProcessingRequest, ep.ProcessingResponse
            ) as s:
                await s.send_message(headers())
                await s.send_message(body(CHAT))
                await s.recv_message()
                await s.recv_message()
                times.append(time.perf_counter() - t0)
                await s.end()
                await s.recv_message()
    assert statistics.median(times) < 0.02, times


GIB = 1024**3


async def _raw_stream_answer(server: EppServer, path: str, prefix: bytes, payload: bytes) -> Status | None:
    """Sends a hand-made length prefix and ``payload`` (sent whole within the 4 MiB HTTP/2 stream
    window, so no read by the server is needed to send it), then waits up to 5 s for the server's
    status (None: a message or nothing came back)."""
    with closing(channel(server)) as ch:
        try:
            async with asyncio.timeout(10):  # a server waiting for the whole message never answers
                async with ch.request(
                    path, Cardinality.STREAM_STREAM, ep.ProcessingRequest, ep.ProcessingResponse
                ) as s:
                    await s.send_request()
                    # the client's own framing, bypassed; the server may refuse before it is all sent
                    with contextlib.suppress(h2.exceptions.StreamClosedError, StreamTerminatedError):
                        await s._stream.send_data(prefix + payload)
                    # the server resets the stream (NO_ERROR) after its trailers, as our side is
                    # still open: grpclib's client then reports the status on leaving the block
                    with contextlib.suppress(StreamTerminatedError, TimeoutError):
                        await asyncio.wait_for(s.recv_message(), 5)
        except GRPCError as err:
            return err.status
        except TimeoutError:
            return None
    return None


async def test_an_oversized_message_is_refused_from_its_prefix_and_the_server_goes_on(
    epp: EppServer,
) -> None:
    """A message declaring 1 GiB gets RESOURCE_EXHAUSTED once its prefix is in, with 3 MiB of it
    sent: the server never waits to buffer the rest (grpclib's own recv_message read up to 4 GiB
    per message, acknowledging every byte, so any client could OOM the EPP). Then a pick works."""
    prefix = b"\x00" + GIB.to_bytes(4, "big")
    t0 = time.perf_counter()
    assert await _raw_stream_answer(epp, PROCESS, prefix, b"\x00" * (3 << 20)) == Status.RESOURCE_EXHAUSTED
    assert time.perf_counter() - t0 < 3
    # just over the limit, on the health service too (Envoy's check on the same port)
    over = b"\x00" + (epp.settings.grpc_max_message_bytes + 1).to_bytes(4, "big")
    assert await _raw_stream_answer(epp, CHECK, over, b"") == Status.RESOURCE_EXHAUSTED
    await test_a_pick_and_the_body_back(epp)


async def test_a_compressed_message_is_a_clean_grpc_error(
    epp: EppServer, caplog: pytest.LogCaptureFixture
) -> None:
    """No grpc-encoding was negotiated; grpclib's own recv_message raised NotImplementedError
    (UNKNOWN and a traceback in the log)."""
    message = headers().SerializeToString()
    prefix = b"\x01" + len(message).to_bytes(4, "big")
    status = await _raw_stream_answer(epp, PROCESS, prefix, message)
    if epp.settings.grpc_server == "grpclib":
        assert status == Status.UNIMPLEMENTED
        assert "Traceback" not in caplog.text and "NotImplementedError" not in caplog.text
    else:  # grpcio: INTERNAL ("compression algorithm ... not enabled")
        assert status != Status.OK
    await test_a_pick_and_the_body_back(epp)


async def test_the_message_limit_is_a_setting(engine: str, server_kind: str) -> None:
    """--grpc-max-message-bytes: a 58-byte header message is over a 32-byte limit."""
    server = await started(engine, server_kind, grpc_max_message_bytes=32)
    try:
        message = headers().SerializeToString()
        assert len(message) > 32
        prefix = b"\x00" + len(message).to_bytes(4, "big")
        assert await _raw_stream_answer(server, PROCESS, prefix, message) == Status.RESOURCE_EXHAUSTED
    finally:
        await server.stop()


def test_grpclib_internals_the_bounded_receive_uses() -> None:
    """recv_bounded reads grpclib's server Stream internals; an upgrade that moves them fails
    here (and the pin in pyproject.toml says which versions were checked)."""
    import inspect

    import grpclib
    from grpclib.protocol import Stream as H2Stream
    from grpclib.server import Stream

    assert tuple(int(p) for p in grpclib.__version__.split(".")[:2]) == (0, 4)
    init = inspect.signature(Stream.__init__).parameters
    assert {"stream", "codec", "recv_type"} <= set(init)
    source = inspect.getsource(Stream.__init__)
    assert "self._stream = stream" in source and "self._codec = codec" in source
    assert "self._recv_type = recv_type" in source
    assert inspect.iscoroutinefunction(H2Stream.recv_data)


async def test_grpclib_server_allows_as_many_streams_as_envoy_may_open(engine: str) -> None:
    """h2's default is 100 streams a connection, and one HEADERS frame over it made grpclib close
    the connection with every stream on it: the server's first SETTINGS says 65,536, and 150
    streams open at once on one connection are all served."""
    import socket

    import h2.config
    import h2.connection
    import h2.events
    from h2.settings import SettingCodes

    from kvgate.epp.grpclib_server import MAX_CONCURRENT_STREAMS

    server = await started(engine, "grpclib")
    try:
        raw = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        raw.initiate_connection()
        loop = asyncio.get_running_loop()
        with socket.create_connection(("127.0.0.1", server.grpc_port)) as sock:
            sock.setblocking(False)
            await loop.sock_sendall(sock, raw.data_to_send())
            events = raw.receive_data(await loop.sock_recv(sock, 65535))
            changed = next(e for e in events if isinstance(e, h2.events.RemoteSettingsChanged))
            assert (
                changed.changed_settings[SettingCodes.MAX_CONCURRENT_STREAMS].new_value
                == MAX_CONCURRENT_STREAMS
            )
            assert MAX_CONCURRENT_STREAMS >= 1024  # Envoy's default circuit breaker, at least
            head = [(":method", "POST"), (":scheme", "http"), (":path", CHECK), (":authority", "epp"),
                    ("content-type", "application/grpc"), ("te", "trailers")]  # fmt: skip
            request = health_pb2.HealthCheckRequest(service="").SerializeToString()
            ids: list[int] = []
            for _ in range(150):
                sid = raw.get_next_available_stream_id()
                raw.send_headers(sid, head)
                ids.append(sid)
            for sid in ids:
                raw.send_data(sid, b"\x00" + len(request).to_bytes(4, "big") + request, end_stream=True)
            await loop.sock_sendall(sock, raw.data_to_send())
            ended: set[int] = set()
            async with asyncio.timeout(20):
                while len(ended) < 150:
                    data = await loop.sock_recv(sock, 65535)
                    assert data, "the server closed the connection"
                    for event in raw.receive_data(data):
                        assert not isinstance(
                            event, h2.events.ConnectionTerminated | h2.events.StreamReset
                        ), event
                        if isinstance(event, h2.events.StreamEnded):
                            ended.add(event.stream_id)
                    await loop.sock_sendall(sock, raw.data_to_send())
    finally:
        await server.stop()
