"""A zero-latency engine stand-in on keep-alive HTTP/1.1: vLLM's load gauges on GET /metrics, `{}`
on other GETs, a fixed OpenAI-shaped completion on every POST. For measuring or starving what
sits in front of engines (Envoy, the EPP) without an engine's own cost in the way."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Awaitable, Callable, Iterator

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def vllm_metrics(model: str, waiting: int = 0, running: int = 0) -> bytes:
    """An engine's load gauges, as the EPP's scraper reads them (idle by default)."""
    return (
        f'vllm:num_requests_waiting{{model_name="{model}"}} {waiting}\n'
        f'vllm:num_requests_running{{model_name="{model}"}} {running}\n'
        f'vllm:kv_cache_usage_perc{{model_name="{model}"}} 0.0\n'
    ).encode()


COMPLETION = json.dumps(
    {
        "id": "cmpl-stub",
        "object": "text_completion",
        "model": "default",
        "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()


def stub_handler(
    metrics: bytes | Callable[[], bytes], completion: bytes = COMPLETION, heads: list[bytes] | None = None
) -> Handler:
    """The asyncio.start_server callback serving one connection's requests until it closes;
    ``metrics``: the GET /metrics body, or what returns it now (a test that changes the load);
    ``heads``: each POST's request line and headers are appended there (what the engine saw)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                if length:
                    await reader.readexactly(length)
                if heads is not None and head.startswith(b"POST"):
                    heads.append(head)
                if head.startswith(b"GET /metrics"):
                    body, ctype = metrics() if callable(metrics) else metrics, b"text/plain"
                elif head.startswith(b"GET"):
                    body, ctype = b"{}", b"application/json"
                else:
                    body, ctype = completion, b"application/json"
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                    % (ctype, len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    return serve


@contextlib.contextmanager
def stub_in_thread(handler: Handler) -> Iterator[str]:
    """Serve `handler` on 127.0.0.1 from a thread and event loop of its own (a test's loop may
    be the one under test, or starved); yields its "host:port"."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    address: list[str] = []

    def run() -> None:
        server = loop.run_until_complete(asyncio.start_server(handler, "127.0.0.1", 0))
        address.append(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
        ready.set()
        loop.run_forever()
        server.close()
        loop.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("the engine stub did not start within 10 s")
    try:
        yield address[0]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
