"""What the OpenAI generation APIs share below them: running a plan's choices against the engine,
answering as JSON or as server-sent events, and mapping engine failures to OpenAI errors.

`run_choices` sends one engine request per choice and turns engine steps into ChoiceProcessor
deltas. Whatever ends it — success, error, client disconnect, a client that stopped reading,
cancellation — every engine request still running is aborted. `collect_choices` (a JSON answer)
and `stream_choices` (SSE) consume the very same deltas, so a streamed and a non-streamed answer
agree exactly. `prepare` decodes and plans a large body on a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable, Sequence
from contextlib import aclosing
from typing import Any, NamedTuple, TypeVar

import msgspec
from aiohttp import web

from frontend.engine.client import EngineClient, EngineDeadError, EngineOverloadedError
from frontend.engine.stream import OutputStream, StepItem
from frontend.errors import OpenAIError, bad_request
from frontend.http_limits import HTTP_LIMITS
from frontend.openai.plan import ChoiceState, RequestPlan
from frontend.openai.protocol import Usage
from frontend.text.output_processor import ChoiceDelta

logger = logging.getLogger(__name__)

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# A body this large is decoded, tokenized and planned on a worker thread (docs/reliability.md:
# tokenizing takes ~1 ms per KiB on a slow core); `tokenizers` releases the GIL meanwhile.
OFF_LOOP_BYTES = 16 * 1024
RETRY_AFTER_S = 1  # what every 503 tells the client (the Retry-After header)
T = TypeVar("T")

ChunksOf = Callable[[int, ChoiceDelta], Iterable[msgspec.Struct]]  # (choice, delta) -> payloads
UsageChunk = Callable[[Usage], msgspec.Struct]  # the last payload, when usage was asked


class EngineRequestError(Exception):
    """The engine finished a request with "error" (e.g. it can never fit in the KV cache)."""


class ClientGoneError(Exception):
    """A stream's client is gone: it closed its connection (or took nothing for the write
    timeout, and the connection was closed)."""


class StalledClientError(ClientGoneError):
    """A stream's client took nothing for the write timeout; its connection is closed."""


async def prepare(body: bytes, make: Callable[[bytes], T]) -> T:
    """`make(body)`: decode, check, tokenize and plan a request; on a worker thread when the
    body is large, so that no one request holds the event loop."""
    if len(body) < OFF_LOOP_BYTES:
        return make(body)
    return await asyncio.to_thread(make, body)


class ChoiceOutput(NamedTuple):
    choice: int  # the choice's index
    delta: ChoiceDelta


async def run_choices(
    client: EngineClient, choices: Sequence[ChoiceState]
) -> AsyncGenerator[ChoiceOutput, None]:
    """Yield each choice's deltas as the engine produces them; abort leftovers on exit.

    `choices[i].index` must be i. Raises EngineRequestError or EngineDeadError.
    """
    stream = OutputStream()
    try:
        for c in choices:
            client.add(c.request_id, c.prompt_ids, c.params, stream, c.index)
        while batch := await stream.get():
            for item in batch:
                for delta in advance(client, choices[item.choice], item):
                    yield ChoiceOutput(item.choice, delta)
    finally:
        client.abort(stream.unfinished)


def advance(client: EngineClient, choice: ChoiceState, item: StepItem) -> list[ChoiceDelta]:
    """Feed one engine step to the choice's processor."""
    proc = choice.processor
    if proc.finished:  # stopped by a string: what was already in flight is dropped
        return []
    if item.finish_reason == "error":
        raise EngineRequestError(item.error or "the engine could not run this request")
    deltas = []
    if not choice.started:
        choice.started = True
        deltas.append(proc.prompt(item.prompt_logprobs))
    if item.token_id is not None or item.finish_reason is not None:
        deltas.append(
            proc.step(item.token_id, item.logprob, item.finish_reason, item.stop_token_id)
        )
    if proc.stopped_by_string:
        client.abort([choice.request_id], stopped=True)
    return deltas


async def collect_choices(client: EngineClient, plan: RequestPlan) -> list[list[ChoiceDelta]]:
    """Every delta of every choice, in order (for a JSON answer); raises OpenAIError."""
    collected: list[list[ChoiceDelta]] = [[] for _ in plan.choices]
    try:
        async with aclosing(run_choices(client, plan.choices)) as outputs:
            async for index, delta in outputs:
                collected[index].append(delta)
    except (EngineRequestError, EngineDeadError) as exc:
        raise engine_error(exc, plan.constraint_param) from None
    return collected


async def stream_choices(
    request: web.Request,
    client: EngineClient,
    plan: RequestPlan,
    chunks_of: ChunksOf,
    usage_chunk: UsageChunk | None,
) -> web.StreamResponse:
    """Answer with server-sent events: `chunks_of` each delta, then `usage_chunk` if given, then
    [DONE]. An engine failure before the first event is a plain error response; after it, an
    error event ends the stream."""
    sse = SSEWriter(request, request.app[HTTP_LIMITS].write_timeout)
    try:
        try:
            async with aclosing(run_choices(client, plan.choices)) as outputs:
                async for index, delta in outputs:
                    for payload in chunks_of(index, delta):
                        await sse.send(payload)
        except (EngineRequestError, EngineDeadError) as exc:
            if not sse.started:
                raise engine_error(exc, plan.constraint_param) from None
            return await sse.fail(engine_error(exc, plan.constraint_param).to_json())
        if usage_chunk is not None:
            await sse.send(usage_chunk(plan.usage()))
        return await sse.done()
    except ClientGoneError as exc:  # its engine requests were aborted on the way out
        logger.info("closed the stream of %s: %s", plan.id, exc)
        return sse.response


class SSEWriter:
    """Server-sent events, prepared lazily at the first event: an error found before anything
    was sent can still be answered with a plain status and JSON body. A write the client does
    not take within `write_timeout` closes the connection and raises StalledClientError; a write
    to a connection the client closed raises ClientGoneError."""

    def __init__(self, request: web.Request, write_timeout: float) -> None:
        self.request = request
        self.response = web.StreamResponse(headers=_SSE_HEADERS)
        self.started = False
        self.write_timeout = write_timeout
        self._encoder = msgspec.json.Encoder()

    async def send(self, payload: msgspec.Struct, event: str | None = None) -> None:
        """One `data:` event; named by an `event:` line when given (the Responses API's)."""
        head = b"" if event is None else b"event: " + event.encode() + b"\n"
        await self._write(self._encoder.encode(payload), head)

    async def fail(self, error_json: bytes) -> web.StreamResponse:
        """Send an error event and end the stream (no [DONE])."""
        await self._write(error_json)
        await self._timed(self.response.write_eof())
        return self.response

    async def done(self) -> web.StreamResponse:
        await self._write(b"[DONE]")
        return await self.end()

    async def end(self) -> web.StreamResponse:
        """End the stream (after [DONE], or without it where the API sends none)."""
        await self._timed(self.response.write_eof())
        return self.response

    async def _write(self, data: bytes, head: bytes = b"") -> None:
        if not self.started:
            self.started = True
            await self._timed(self.response.prepare(self.request))
        await self._timed(self.response.write(head + b"data: " + data + b"\n\n"))

    async def _timed(self, write: Awaitable[Any]) -> None:
        """A write waits while the client's socket buffers are full: at most write_timeout."""
        try:
            async with asyncio.timeout(self.write_timeout):
                await write
        except TimeoutError:
            if (transport := self.request.transport) is not None:
                transport.abort()  # close() would wait for the client to take what is queued
            raise StalledClientError(
                f"the client took nothing for {self.write_timeout:g} s") from None
        except ConnectionResetError:  # aiohttp: "Cannot write to closing transport"
            raise ClientGoneError("the client closed the connection") from None


def json_response(payload: Any) -> web.Response:
    """A 200 with `payload` (a msgspec Struct, or plain JSON data) as its JSON body."""
    return web.Response(body=msgspec.json.encode(payload), content_type="application/json")


def engine_error(exc: Exception, param: str | None = None) -> OpenAIError:
    """A dead or overloaded engine is a 503 to retry; a request the engine refused, a 400
    (naming `param`: a constrained request's refusal is about its constraint, which only
    the engine compiles)."""
    if isinstance(exc, EngineOverloadedError):  # the engine's words: how many wait, its limit
        reason = str(exc).removeprefix("the server is overloaded: ")
        return OpenAIError(503, f"The server is overloaded: {reason}; retry after "
                                f"{RETRY_AFTER_S} s.")
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, f"The engine is unavailable: {exc}. Retry later.")
    return bad_request(str(exc), param)
