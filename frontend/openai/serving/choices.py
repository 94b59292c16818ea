"""What the OpenAI generation APIs share below them: running a plan's choices against the engine,
answering as JSON or as server-sent events, and mapping engine failures to OpenAI errors.

`ChoiceRun` sends one engine request per choice and turns engine steps into ChoiceProcessor
deltas, one per choice per wake-up however many steps arrived meanwhile (the output merging of
docs/architecture.md). Whatever ends it — success, error, client disconnect, a client that
stopped reading, cancellation — every engine request still running is aborted.
`collect_choices` (a JSON answer) and `stream_events` (SSE: every API's stream lifecycle, with
its events as `StreamEvents`; `stream_choices` for chat's and completions' chunks) consume the
very same deltas, so a streamed and a non-streamed answer agree exactly. `prepare` decodes and
plans a large body on a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from frontend.engine.client import EngineDeadError, EngineOverloadedError
from frontend.engine.group import EngineGroup
from frontend.engine.stream import OutputStream, StepItem
from frontend.errors import OpenAIError, bad_request
from frontend.http_limits import HTTP_LIMITS
from frontend.openai.protocol.base import Usage
from frontend.openai.serving.plan import ChoiceState, RequestPlan
from frontend.openai.serving.sse import ClientGoneError, SSEWriter
from frontend.text.output_processor import ChoiceDelta
from shared.step_outputs import TokenLogprob

logger = logging.getLogger(__name__)

# A body this large is decoded, tokenized and planned on a worker thread (docs/reliability.md:
# tokenizing takes ~1 ms per KiB on a slow core); `tokenizers` releases the GIL meanwhile.
OFF_LOOP_BYTES = 16 * 1024
RETRY_AFTER_S = 1  # what every 503 tells the client (the Retry-After header)
T = TypeVar("T")

ChunksOf = Callable[[int, ChoiceDelta], list[bytes]]  # (choice, delta) -> its events
UsageChunk = Callable[[Usage], msgspec.Struct]  # the last payload, when usage was asked


class EngineRequestError(Exception):
    """The engine finished a request with "error" (e.g. it can never fit in the KV cache)."""


async def prepare(body: bytes, make: Callable[[bytes], T]) -> T:
    """`make(body)`: decode, check, tokenize and plan a request; on a worker thread when the
    body is large, so that no one request holds the event loop."""
    if len(body) < OFF_LOOP_BYTES:
        return make(body)
    return await asyncio.to_thread(make, body)


# One choice's delta of a wake-up: (the choice's index, its delta). A plain tuple, not a named
# one: one per choice per wake-up, on the hottest path.
ChoiceOutput = tuple[int, ChoiceDelta]


@dataclass(frozen=True)
class StreamingOptions:
    """How streamed outputs are grouped into chunks (set once per frontend, from its flags).

    `stream_interval`: vLLM's --stream-interval: a choice's first output is sent at once, then
    its text waits until it carries this many more tokens (or the choice finished).
    `merge_steps` (tests only): every consumer waits for this many engine wake-ups before it
    sends, so that the merged path runs on every step even on a fast machine."""

    stream_interval: int = 1
    merge_steps: int = 1


STREAMING = web.AppKey("streaming", StreamingOptions)
NO_GROUPING = StreamingOptions()


class ChoiceRun:
    """A plan's choices against the engine, one engine request each.

    `start()` sends them. The run is its stream's sink (`StepSink`): the routing task feeds
    each row to its choice's processor as it routes it. `await next()` then returns, per
    wake-up, one delta per choice that gained anything: whatever engine steps were fed to it
    since the last call, folded into one (exactly the concatenation of their separate deltas:
    ChoiceProcessor.delta), so a consumer that fell behind catches up in one chunk; `[]` once
    every choice finished. `close()` aborts whatever still runs: call it however the run ends
    (success, error, disconnect, cancellation). `choices[i].index` must be i. `next()` raises
    EngineRequestError or EngineDeadError.
    """

    def __init__(self, client: EngineGroup, choices: Sequence[ChoiceState],
                 options: StreamingOptions = NO_GROUPING) -> None:
        self._client = client
        self._choices = choices
        self._stream = OutputStream(self)
        self._interval = options.stream_interval
        self._merge_steps = options.merge_steps
        self._held = [0] * len(choices)  # tokens fed and not yet sent, per choice
        self._sent = [False] * len(choices)  # a delta of the choice went out
        self._touched: list[int] = []  # choices fed since the last deltas, in order
        self._error: EngineRequestError | None = None  # a choice the engine failed
        self._wakeups = 0  # listener calls since outputs were last taken (merge_steps)

    def start(self) -> None:
        """Send the engine requests; raises EngineDeadError while the engine is not answering."""
        for c in self._choices:
            self._client.add(c.request_id, c.prompt_ids, c.params, self._stream, c.index)

    def close(self) -> None:
        self._client.abort(self._stream.unfinished)
        self._stream.detach()

    @property
    def ended(self) -> bool:
        """Every choice finished (or the engine died): `next()` has nothing more to give."""
        return self._stream.ended

    @property
    def pending(self) -> bool:
        """Engine outputs arrived and wait to be taken."""
        return self._stream.pending

    def listen(self, listener: Callable[[], None] | None) -> None:
        """Have `listener` called when outputs arrive while nobody awaits `next()`
        (OutputStream.listen); it takes them with `take_now()`."""
        self._stream.listen(listener)

    # -- the stream's sink: rows as the routing task routes them ----------------------------

    def token(self, index: int, token_id: int, logprob: TokenLogprob | None) -> None:
        """A sampled token and nothing else (the common row)."""
        choice = self._choices[index]
        if not choice.started:
            self.item(StepItem(index, token_id, logprob, None, None))
            return
        proc = choice.processor
        if proc.finish_reason is not None:  # stopped by a string: what was in flight is dropped
            return
        proc.feed(token_id, logprob, None)
        self._held[index] += 1
        touched = self._touched
        if not touched or touched[-1] != index:
            touched.append(index)
        if proc.finish_reason is not None and proc.stopped_by_string:
            self._client.abort([choice.request_id], stopped=True)

    def item(self, item: StepItem) -> None:
        index, token_id, logprob, prompt_logprobs, finish_reason, stop_token_id, error, _ = item
        choice = self._choices[index]
        proc = choice.processor
        if proc.finished:
            return
        if finish_reason is not None and finish_reason == "error":
            if self._error is None:
                self._error = EngineRequestError(error or "the engine could not run this request")
            return
        if not choice.started:
            choice.started = True
            proc.feed_prompt(prompt_logprobs)
        if token_id is not None:
            proc.feed(token_id, logprob, finish_reason, stop_token_id)
            self._held[index] += 1
        elif finish_reason is not None:
            proc.feed(None, None, finish_reason, stop_token_id)
        touched = self._touched
        if not touched or touched[-1] != index:
            touched.append(index)
        if proc.stopped_by_string:
            self._client.abort([choice.request_id], stopped=True)

    # -- the consumer -------------------------------------------------------------------------

    def take_now(self) -> list[ChoiceOutput]:
        """`next()` without waiting: the deltas of what has arrived ([] if nothing is due)."""
        self._wakeups += 1
        if self._wakeups < self._merge_steps and self._stream.unfinished:
            return []
        self._wakeups = 0
        if self._stream.take_news():
            return self._outputs()
        return self._rest() if self.ended else []

    async def next(self) -> list[ChoiceOutput]:
        while await self._news():
            if outputs := self._outputs():
                return outputs
        return self._rest()

    async def _news(self) -> bool:
        news = await self._stream.news()
        for _ in range(self._merge_steps - 1):
            if not self._stream.unfinished:
                break
            news = await self._stream.news() or news
        return news

    def _outputs(self) -> list[ChoiceOutput]:
        """One delta per choice fed since the last call and due; raises a failed choice's
        EngineRequestError."""
        if self._error is not None:
            raise self._error
        touched, self._touched = self._touched, []
        if len(touched) > 1:
            touched = list(dict.fromkeys(touched))
        if self._interval == 1:
            return [(i, self._take_delta(i)) for i in touched]
        return [(i, self._take_delta(i)) for i in touched if self._due(i)]

    def _due(self, index: int) -> bool:
        """vLLM's stream interval: the first output at once, then every `interval` tokens."""
        return (not self._sent[index] or self._held[index] >= self._interval
                or self._choices[index].processor.finished)

    def _take_delta(self, index: int) -> ChoiceDelta:
        delta = self._choices[index].processor.delta()
        if delta.text:  # (a first token that only starts a character shows nothing yet)
            self._sent[index] = True
        self._held[index] = 0
        return delta

    def _rest(self) -> list[ChoiceOutput]:
        """At the end: what a stream interval still held (choices aborted unfinished)."""
        return [(i, self._take_delta(i)) for i in range(len(self._choices))
                if self._held[i]]


async def collect_choices(client: EngineGroup, plan: RequestPlan) -> list[list[ChoiceDelta]]:
    """Every delta of every choice, in order (for a JSON answer); raises OpenAIError."""
    collected: list[list[ChoiceDelta]] = [[] for _ in plan.choices]
    run = ChoiceRun(client, plan.choices)
    try:
        run.start()
        while outputs := await run.next():
            for index, delta in outputs:
                collected[index].append(delta)
    except (EngineRequestError, EngineDeadError) as exc:
        raise engine_error(exc, plan.constraint_param) from None
    finally:
        run.close()
    return collected


@dataclass(frozen=True)
class StreamEvents:
    """What one API streams on the lifecycle every stream shares (`stream_events`).

    `chunks_of`: a choice's delta as its events (none for a delta that shows nothing); `last`:
    the events after the last delta; `failed`: the event that ends a stream the engine failed
    after it started. `named`: each event is whole, named by an `event:` line
    (`sse.named_event`), and the stream ends without [DONE] (the Responses API's); otherwise
    each is a `data:` event's JSON and [DONE] ends the stream (chat's and completions')."""

    chunks_of: ChunksOf
    last: Callable[[], list[bytes]]
    failed: Callable[[OpenAIError], bytes]
    named: bool = False


async def stream_choices(
    request: web.Request,
    client: EngineGroup,
    plan: RequestPlan,
    chunks_of: ChunksOf,
    usage_chunk: UsageChunk | None,
) -> web.StreamResponse:
    """Chat's and completions' stream: `chunks_of` each delta, then `usage_chunk` if given,
    then [DONE]; an engine failure after the first event is OpenAI's error JSON as an event."""

    def last() -> list[bytes]:
        if usage_chunk is None:
            return []
        return [msgspec.json.encode(usage_chunk(plan.usage()))]

    return await stream_events(request, client, plan,
                               StreamEvents(chunks_of, last, OpenAIError.to_json))


async def stream_events(request: web.Request, client: EngineGroup, plan: RequestPlan,
                        events: StreamEvents) -> web.StreamResponse:
    """Answer with server-sent events: each wake-up's deltas as `events.chunks_of` (every event
    of one wake-up in one write), then `events.last()`, then the end. An engine failure before
    the first event is a plain error response; after it, `events.failed` ends the stream. A
    client that is gone ends it quietly; the run's engine requests are aborted however it ends.
    """
    sse = SSEWriter(request, request.app[HTTP_LIMITS].write_timeout, events.named)
    run = ChoiceRun(client, plan.choices, request.app.get(STREAMING, NO_GROUPING))
    try:
        try:
            run.start()
            await EventPump(run, sse, events.chunks_of).run()
        except (EngineRequestError, EngineDeadError) as exc:
            error = engine_error(exc, plan.constraint_param)
            if not sse.started:
                raise error from None
            await sse.send_all([events.failed(error)])
            return await sse.end()
        await sse.send_all(events.last())
        return await (sse.end() if events.named else sse.done())
    except ClientGoneError as exc:  # its engine requests were aborted on the way out
        logger.info("closed the stream of %s: %s", plan.id, exc)
        return sse.response
    finally:
        run.close()
        sse.close()


class EventPump:
    """Writes a run's deltas as events until every choice finished.

    While the client takes everything as it comes, the handler task parks and the run's
    listener writes each wake-up's events straight to the socket (`SSEWriter.write_now`): no
    task switch and no coroutine per token. The task takes over, awaiting the run and writing
    through aiohttp (which waits for a lagging client's socket to drain), for the first event
    (the response is prepared then), whenever the socket holds a backlog (then what arrives
    meanwhile merges), and at the end or on an error, which the listener hands it."""

    def __init__(self, run: ChoiceRun, sse: SSEWriter, chunks_of: ChunksOf) -> None:
        self._run = run
        self._sse = sse
        self._chunks_of = chunks_of
        self._parked: asyncio.Future[None] | None = None

    async def run(self) -> None:
        self._run.listen(self._on_outputs)
        try:
            while outputs := await self._run.next():
                await self._sse.send_all(self._payloads(outputs))
                if self._sse.can_write_now() and not self._run.pending and not self._run.ended:
                    await self._park()
        finally:
            self._run.listen(None)  # no cycle through the stream: the request is freed at once

    async def _park(self) -> None:
        self._parked = asyncio.get_running_loop().create_future()
        try:
            await self._parked
        finally:
            self._parked = None

    def _on_outputs(self) -> None:
        parked = self._parked
        if parked is None or parked.done():  # the task is at work: it takes them itself
            return
        sse, run = self._sse, self._run
        try:
            if not sse.can_write_now():  # a backlog, or a closed connection
                parked.set_result(None)
                return
            if outputs := run.take_now():
                sse.write_now(self._payloads(outputs))
            if run.ended:
                parked.set_result(None)
        except Exception as exc:  # noqa: BLE001 - the task raises it (an engine error...)
            parked.set_exception(exc)

    def _payloads(self, outputs: list[ChoiceOutput]) -> list[bytes]:
        chunks_of = self._chunks_of
        if len(outputs) == 1:  # the common case: one choice
            return chunks_of(*outputs[0])
        return [chunk for index, delta in outputs for chunk in chunks_of(index, delta)]


def chunk_head(request_id: str, created: int, model: str) -> bytes:
    """What every streamed chunk of a request starts with, up to its choice's index: msgspec's
    encoding of a chunk's first fields (id, created, model, then the choices), for the
    per-request chunk templates of completions and chat."""
    encode = msgspec.json.encode
    return (b'{"id":' + encode(request_id) + b',"created":' + encode(created)
            + b',"model":' + encode(model) + b',"choices":[{"index":')


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
