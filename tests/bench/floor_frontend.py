"""The least an aiohttp frontend does per streamed token: a stand-in for `frontend.server` that
streams without an engine, a tokenizer or a detokenizer.

    tests/bench/floor_frontend.py --port P [--reuse-port] [--ready-file F] [--step-interval S]

Per request it reads and decodes the JSON body and prepares an SSE response as Tandem's
frontend does; then at every tick (one every --step-interval seconds, for all streams: the
engine's steps) the ticker writes each stream's next completion chunk of one character straight
to its transport, as `EventPump`'s listener does with `SSEWriter.write_now` (no task switch per
token), until `max_tokens` chunks went out; then the usage chunk if asked, and [DONE]. A client
that lags (a write buffered) has its stream cut short: this measures the cost of keeping up.

`frontend_only.py --floor` runs it in place of the real frontends, so that its CPU per streamed
token is what the process, aiohttp, asyncio and the kernel's loopback TCP cost without any of
Tandem's own work: the floor under the real frontend's figure (issue 27). The text it streams
is not the engine's, so `frontend_only.py`'s text check does not apply.
Flags `frontend_only.py` passes to real frontends (--engine, --shutdown-grace, --log-level) are
accepted and ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
from pathlib import Path

import msgspec
from aiohttp import web

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class Stream:
    """One response's chunks, written at each tick by the ticker itself (no task switch per
    token, as Tandem's EventPump writes from its listener); its handler waits for the end."""

    def __init__(self, transport: asyncio.Transport, tokens: int) -> None:
        self.transport = transport
        self.left = tokens
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.middle = framed(chunk("cmpl-floor", "x", None))
        self.last = framed(chunk("cmpl-floor", "x", "length"))

    def tick(self) -> bool:
        """Write the next chunk; False once the last went out (or the client left)."""
        self.left -= 1
        if self.transport.is_closing() or self.transport.get_write_buffer_size():
            self.done.set_result(None)  # closed, or a lagging client: the handler ends it
            return False
        self.transport.write(self.last if self.left == 0 else self.middle)
        if self.left == 0:
            self.done.set_result(None)
            return False
        return True


class Ticker:
    """Every `interval` s, one chunk for each stream (the engine's step)."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.streams: list[Stream] = []

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time()
        while True:  # on a fixed schedule, as the no-op engine's steps
            due = max(due + self.interval, loop.time())
            await asyncio.sleep(due - loop.time())
            self.streams = [s for s in self.streams if s.tick()]


TICKER = web.AppKey("ticker", Ticker)


def chunk(request_id: str, text: str, finish: str | None) -> bytes:
    return msgspec.json.encode({
        "id": request_id, "created": 0, "model": "floor",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                     "stop_reason": None}],
        "usage": None, "object": "text_completion"})


def framed(payload: bytes) -> bytes:
    """One SSE event in one HTTP chunk, as SSEWriter.write_now frames it."""
    event = b"data: %b\n\n" % payload
    return b"%x\r\n%b\r\n" % (len(event), event)


async def completions(request: web.Request) -> web.StreamResponse:
    body = msgspec.json.decode(await request.read())
    tokens = max(1, int(body.get("max_tokens") or 16))
    with_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    transport = request.transport
    assert transport is not None
    stream = Stream(transport, tokens)  # type: ignore[arg-type]
    request.app[TICKER].streams.append(stream)
    await stream.done
    tail = b""
    if with_usage:
        usage = {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}
        tail = b"data: %b\n\n" % msgspec.json.encode({
            "id": "cmpl-floor", "created": 0, "model": "floor", "choices": [],
            "usage": usage, "object": "text_completion"})
    await response.write_eof(tail + b"data: [DONE]\n\n")
    return response


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "floor", "object": "model"}]})


async def serve(args: argparse.Namespace) -> None:
    app = web.Application()
    ticker = Ticker(args.step_interval)
    app[TICKER] = ticker
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if args.reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((args.host, args.port))
    await web.SockSite(runner, sock).start()
    tick = asyncio.create_task(ticker.run())
    if args.ready_file:
        Path(args.ready_file).write_text("ready\n")
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await stop.wait()
    finally:
        tick.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await tick
        await runner.cleanup()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--reuse-port", action="store_true")
    parser.add_argument("--ready-file", default=None)
    parser.add_argument("--step-interval", type=float, default=0.005,
                        help="seconds between ticks (one chunk per stream per tick)")
    for ignored in ("--engine", "--shutdown-grace", "--log-level"):
        parser.add_argument(ignored, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step_interval <= 0:
        parser.error("--step-interval must be above 0")
    from frontend.memory import settle_gc

    settle_gc()  # as the real frontend sets the garbage collector
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
