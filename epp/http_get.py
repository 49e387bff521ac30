"""A minimal keep-alive HTTP/1.1 GET client for scraping /metrics.

The EPP polls every endpoint about 20 times a second; a general-purpose client (httpx) spent
~70 % of the EPP's CPU doing so under load (py-spy, bench/epp_latency.py). This one keeps one
connection per endpoint and does only what a Prometheus scrape needs.
"""

from __future__ import annotations

import asyncio


class ScrapeError(OSError):
    pass


class EndpointRefused(ScrapeError):
    """Nothing listens there: a definitive sign the endpoint is gone, not a slow one."""


def get_request(host: str, port: int, path: str, api_key: str | None = None) -> bytes:
    """A complete HTTP/1.1 GET (bytes), with the engines' API key as a bearer token if given."""
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    return (
        f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAccept: text/plain\r\n"
        f"User-Agent: kvgate-epp\r\n{auth}\r\n"
    ).encode()


class KeepAliveGetter:
    def __init__(self, host: str, port: int, path: str = "/metrics", timeout: float = 1.0) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self._request = get_request(host, port, path)
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def get(self) -> tuple[int, bytes]:
        return await self.request(self._request)

    async def request(self, raw_request: bytes) -> tuple[int, bytes]:
        """Send one complete HTTP/1.1 request (bytes) on the kept-alive connection."""
        try:
            async with asyncio.timeout(self.timeout):
                return await self._exchange(raw_request)
        except ConnectionRefusedError as exc:
            self.close()
            raise EndpointRefused(f"{self.host}:{self.port} refused the connection") from exc
        except (
            OSError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            TimeoutError,
            ValueError,
        ) as exc:
            self.close()
            raise ScrapeError(f"{self.host}:{self.port}: {exc!r}") from exc

    async def _exchange(self, raw_request: bytes) -> tuple[int, bytes]:
        if self._writer is None or self._writer.is_closing():
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port, limit=1 << 22)
        reader, writer = self._reader, self._writer
        assert reader is not None
        writer.write(raw_request)
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, _, rest = head.partition(b"\r\n")
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise ValueError(f"not an HTTP/1.x response: {status_line[:60]!r}")
        status = int(parts[1])
        length: int | None = None
        chunked = close = False
        for line in rest.split(b"\r\n"):
            key, _, value = line.partition(b":")
            key = key.strip().lower()
            if key == b"content-length":
                length = int(value)
            elif key == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif key == b"connection":
                close = b"close" in value.lower()
        if chunked:
            body = bytearray()
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                if size == 0:
                    await reader.readuntil(b"\r\n")  # no trailers expected from a metrics page
                    break
                body += await reader.readexactly(size)
                await reader.readexactly(2)
            data = bytes(body)
        elif length is not None:
            data = await reader.readexactly(length)
        else:
            data = await reader.read()
            close = True
        if close:
            self.close()
        return status, data

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None
