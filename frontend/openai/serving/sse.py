"""Server-sent events on one aiohttp response: lazily prepared, one write deadline per stream,
and a synchronous write for the common case where the client keeps up.

`SSEWriter.send_all` (a coroutine) writes through aiohttp, which waits for the socket to drain
when the client lags. `write_now` writes straight to the transport, framed as aiohttp frames a
chunk (chunked transfer encoding, or the bare bytes when the response is not chunked), for a
caller that cannot await: only when `can_write_now()`, i.e. the response is prepared, no write is
waiting, and the socket took everything written so far; a lagging client therefore always
goes through aiohttp's flow control.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class ClientGoneError(Exception):
    """A stream's client is gone: it closed its connection (or took nothing for the write
    timeout, and the connection was closed)."""


class StalledClientError(ClientGoneError):
    """A stream's client took nothing for the write timeout; its connection is closed."""


def events(payloads: Sequence[bytes]) -> bytes:
    """Server-sent events of JSON payloads, back to back."""
    if len(payloads) == 1:
        return b"data: %b\n\n" % payloads[0]
    return b"".join([b"data: %b\n\n" % p for p in payloads])


def named_event(name: str, payload: bytes) -> bytes:
    """One whole event, named by an `event:` line (the Responses API's), of a JSON payload."""
    return b"event: %b\ndata: %b\n\n" % (name.encode(), payload)


class SSEWriter:
    """Server-sent events, prepared lazily at the first event: an error found before anything
    was sent can still be answered with a plain status and JSON body. A write the client does
    not take within `write_timeout` closes the connection and raises StalledClientError; a write
    to a connection the client closed raises ClientGoneError. Its payloads are `data:` events'
    JSON, or with `named` whole events (`named_event`), written as they are.

    One deadline per stream rather than a timer per write: a write notes when it began, and one
    watchdog timer, re-armed for the earliest moment a write could be overdue, aborts the
    connection of a write still unfinished then (which ends that write)."""

    def __init__(self, request: web.Request, write_timeout: float, named: bool = False) -> None:
        self.request = request
        self.response = web.StreamResponse(headers=SSE_HEADERS)
        self.started = False
        self.write_timeout = write_timeout
        # payloads -> the bytes of their events
        self._frame: Callable[[Sequence[bytes]], bytes] = b"".join if named else events
        self._named = named
        self._loop = asyncio.get_running_loop()
        self._writing_since: float | None = None
        self._watchdog: asyncio.TimerHandle | None = None
        self._stalled = False
        self._transport: asyncio.Transport | None = None  # once prepared
        self._chunked = False
        self._one_data_chunk = False  # chunked data events: write_now frames one in one go

    async def send_all(self, payloads: Sequence[bytes]) -> None:
        """Several events in one write."""
        if payloads:
            await self._write(self._frame(payloads))

    def can_write_now(self) -> bool:
        """True when `write_now` may write: prepared, no write waiting, and the socket has
        taken everything written so far (a connection that closed cannot be written to)."""
        transport = self._transport  # once a connection's transport closes, it stays closing
        return (self._writing_since is None and transport is not None
                and not transport.is_closing() and not transport.get_write_buffer_size())

    def write_now(self, payloads: Sequence[bytes]) -> None:
        """Write events at once, without waiting (only when `can_write_now()`)."""
        if not payloads:
            return
        transport = self._transport
        assert transport is not None
        if self._one_data_chunk and len(payloads) == 1:  # one event, framed in one go
            payload = payloads[0]
            transport.write(b"%x\r\ndata: %b\n\n\r\n" % (len(payload) + 8, payload))
            return
        data = self._frame(payloads)
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data)

    async def done(self) -> web.StreamResponse:
        """Send [DONE] and end the stream (one write once the response is prepared)."""
        if not self.started:
            await self._write(events([b"[DONE]"]))
            return await self.end()
        await self._guarded(self.response.write_eof(events([b"[DONE]"])))
        return self.response

    async def end(self) -> web.StreamResponse:
        """End the stream (after [DONE], or without it where the API sends none)."""
        await self._guarded(self.response.write_eof())
        return self.response

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    async def _write(self, data: bytes) -> None:
        if not self.started:
            self.started = True
            self._watchdog = self._loop.call_later(self.write_timeout, self._check)
            await self._guarded(self.response.prepare(self.request))
            self._chunked = self.response.headers.get("Transfer-Encoding") == "chunked"
            self._one_data_chunk = self._chunked and not self._named
            # write_now frames bare or chunked bytes: never into a compressed or sized body
            if not self.response.compression and self.response.content_length is None:
                self._transport = self.request.transport
        await self._guarded(self.response.write(data))

    async def _guarded(self, write: Awaitable[Any]) -> None:
        """A write waits while the client's socket buffers are full: at most write_timeout."""
        self._writing_since = self._loop.time()
        try:
            await write
        except ConnectionResetError:  # aiohttp: "Cannot write to closing transport"
            raise self._gone() from None
        finally:
            self._writing_since = None
        if self._stalled:  # aborted while it waited: the write returned without sending
            raise self._gone()

    def _gone(self) -> ClientGoneError:
        if self._stalled:
            return StalledClientError(f"the client took nothing for {self.write_timeout:g} s")
        return ClientGoneError("the client closed the connection")

    def _check(self) -> None:
        now, since = self._loop.time(), self._writing_since
        if since is not None and now - since >= self.write_timeout:
            self._watchdog = None
            self._stalled = True
            if (transport := self.request.transport) is not None:
                transport.abort()  # close() would wait for the client to take what is queued
            return
        due = now + self.write_timeout if since is None else since + self.write_timeout
        self._watchdog = self._loop.call_at(due, self._check)
