"""TCP across a network namespace's wall, through Unix sockets in the filesystem (which every
namespace shares): how `make cluster` gives Envoy Gateway's controller a network of its own.

The controller is a Go program that binds fixed ports on every address (18000, 18002, 8080,
8081): on the node's shared loopback those would collide with pods' ports. In a network
namespace of its own (`unshare --net`, loopback only) it binds them freely; two relays, one on
each side, carry just the connections it needs:

    inside:  --tcp 127.0.0.1:API=api.sock        (the controller reaches the API server)
             --unix xds.sock=127.0.0.1:18000     (the proxies reach its xDS server)
    outside: --unix api.sock=127.0.0.1:API
             --tcp 127.9.0.1:18000=xds.sock

    python -m kvgate.testing.netns_relay --tcp HOST:PORT=SOCKET --unix SOCKET=HOST:PORT ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import os
import signal
import sys
from collections.abc import Awaitable, Callable

Opener = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()  # a half-close travels on
    except (OSError, RuntimeError):
        pass


async def splice(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    up_reader: asyncio.StreamReader,
    up_writer: asyncio.StreamWriter,
) -> None:
    """Both directions of a connection and its upstream, until both are done; then both close."""
    await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
    for w in (writer, up_writer):
        with contextlib.suppress(OSError, RuntimeError):
            w.close()


def _relay(open_upstream: Opener) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await open_upstream()
        except OSError:
            writer.close()
            return
        await splice(reader, writer, up_reader, up_writer)

    return handle


def _hostport(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


async def serve(tcp: list[str], unix: list[str]) -> None:
    servers: list[asyncio.Server] = []
    for spec in tcp:  # listen on TCP, forward to a Unix socket
        listen, _, path = spec.partition("=")
        host, port = _hostport(listen)
        servers.append(
            await asyncio.start_server(
                _relay(functools.partial(asyncio.open_unix_connection, path)), host, port
            )
        )
    for spec in unix:  # listen on a Unix socket, forward to TCP
        path, _, target = spec.partition("=")
        host, port = _hostport(target)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        servers.append(
            await asyncio.start_unix_server(
                _relay(functools.partial(asyncio.open_connection, host, port)), path
            )
        )
    print("relaying", flush=True)
    await asyncio.Event().wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvgate.testing.netns_relay", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--tcp", action="append", default=[], metavar="HOST:PORT=SOCKET", help="TCP in, Unix out")
    p.add_argument("--unix", action="append", default=[], metavar="SOCKET=HOST:PORT", help="Unix in, TCP out")
    p.add_argument(
        "--die-with-parent", action="store_true", help="exit when the process that started it does"
    )
    args = p.parse_args(argv)
    if args.die_with_parent:  # the relay inside goes with the controller it serves
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    loop = asyncio.new_event_loop()
    task = loop.create_task(serve(args.tcp, args.unix))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        loop.run_until_complete(task)
    return 0


if __name__ == "__main__":
    sys.exit(main())
