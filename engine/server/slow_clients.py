"""Slow-client protection for uvicorn: a connection must finish a request's headers in time.

uvicorn bounds idle keep-alive connections but not a client that trickles a request's headers
one byte at a time (slowloris): every byte re-arms nothing and the connection lives forever,
holding a socket and a parser. These protocol subclasses start a timer when a request begins
(connection made, or the first byte of the next request on a kept-alive connection) and close
the connection if its headers are not complete when it fires. Body reads are bounded in the
app (`read_body`), where a 408 can still be answered.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)


class _HeaderDeadline:
    """Mixed into a uvicorn HTTP protocol class; `header_timeout` is set on the subclass."""

    header_timeout: float = 10.0
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    _header_timer: asyncio.TimerHandle | None = None

    def _arm_header_timer(self) -> None:
        if self._header_timer is None and self.header_timeout > 0:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        log.info("closing a connection that did not send its request headers within %gs", self.header_timeout)
        self.transport.close()


def _httptools(base: type[Any]) -> type[Any]:
    class HeaderDeadlineHttpTools(_HeaderDeadline, base):
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm_header_timer()

        def on_headers_complete(self) -> None:
            self._disarm_header_timer()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

    return HeaderDeadlineHttpTools


def _h11(base: type[Any]) -> type[Any]:
    class HeaderDeadlineH11(_HeaderDeadline, base):
        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self._arm_header_timer()

        def data_received(self, data: bytes) -> None:
            if self.cycle is None or self.cycle.response_complete:
                self._arm_header_timer()  # bytes of a new request
            before = self.cycle
            super().data_received(data)
            if self.cycle is not before:  # h11 produced a Request event: headers complete
                self._disarm_header_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            super().connection_lost(exc)

    return HeaderDeadlineH11


def protocol_class(parser: str, header_timeout: float) -> type[Any]:
    """The uvicorn protocol class for `parser` ("auto" | "httptools" | "h11") with a deadline."""
    if parser in ("auto", "httptools"):
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

            cls = _httptools(HttpToolsProtocol)
        except ImportError:
            if parser == "httptools":
                raise
            parser = "h11"
    if parser == "h11":
        from uvicorn.protocols.http.h11_impl import H11Protocol

        cls = _h11(H11Protocol)
    cls.header_timeout = header_timeout
    return cls
