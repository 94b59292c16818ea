"""Where one HTTP request's engine outputs go: an `OutputStream`, and the consumer it wakes.

The EngineClient's routing task `put`s what each engine step brought each request. One stream
holds every engine request of one HTTP request (its n choices), told apart by the caller's
choice index. A stream either keeps what arrives as `StepItem`s, for a consumer that awaits
`get()`, or hands every row as it is routed to a `StepSink`: the consumer's own processors,
fed in the routing loop itself, as vLLM's output processor is fed in its output handler. A
sink's consumer then only takes what the processors made since it last looked (`news()`).

This is the frontend's hottest path (every token of every stream passes here), so a stream is
a flag, a list or a sink call, and at most one future: news wakes a waiting consumer once,
whatever arrives before it runs is handed over together, and a consumer that is behind catches
up in one wake-up (docs/architecture.md, "Output merging").

A consumer may also `listen`: while it is not waiting, news makes the stream call its listener
once, after the routing task has routed every frame already received, and the listener takes
what arrived without a task switch. The routing task puts rows with a `news` list and, once
every waiting frame is routed, `notify()`s each stream in it: one synchronous call per stream
per engine wake-up, no event-loop callback.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from shared.messages import FinishReason
from shared.step_outputs import TokenLogprob

logger = logging.getLogger(__name__)


class StepItem(NamedTuple):
    """What one engine step brought one request. Rows with nothing in them are not delivered."""

    choice: int  # the caller's index for this request within its OutputStream
    token_id: int | None  # None: no token sampled this step (prefill only, or finished)
    logprob: TokenLogprob | None
    prompt_logprobs: Sequence[TokenLogprob] | None  # prompt tokens 1..P-1, once, when asked
    finish_reason: FinishReason | None
    stop_token_id: int | None = None
    error: str | None = None  # the engine's message with finish_reason "error"
    embedding: bytes = b""  # a pooling request's vector (float32), on its finish


class StepSink(Protocol):
    """Takes a stream's rows as they are routed. `token` is the common row (a sampled token,
    nothing else); `item` any other. Neither may block; an exception fails the stream."""

    def token(self, choice: int, token_id: int, logprob: TokenLogprob | None) -> None: ...

    def item(self, item: StepItem) -> None: ...


class OutputStream:
    """The outputs of one or more engine requests (e.g. the n choices of one HTTP request).

    Without a sink, the consumer awaits `get()`, which returns every pending item at once (so a
    slow consumer catches up in one wake-up), `[]` once every request of the stream has finished
    or been aborted, and raises EngineDeadError if the engine died. With a sink, it awaits
    `news()` instead: True when rows were fed to the sink since the last call, False once every
    request finished, the engine's error if it died.
    """

    # (__weakref__: EngineGroup maps a stream to its engine in a WeakKeyDictionary)
    __slots__ = ("_items", "_sink", "_fresh", "_open", "_waiter", "_error", "_listener",
                 "_called", "_in_news", "__weakref__")

    def __init__(self, sink: StepSink | None = None) -> None:
        self._items: list[StepItem] = []  # without a sink
        self._sink = sink
        self._fresh = False  # rows arrived that the consumer has not taken
        self._open: set[str] = set()
        self._waiter: asyncio.Future[None] | None = None  # the consumer, while it waits
        self._error: Exception | None = None
        self._listener: Callable[[], None] | None = None
        self._called = False  # the listener's call is scheduled
        self._in_news = False  # in a routing task's news list, to be notified

    @property
    def unfinished(self) -> list[str]:
        """Request ids that have neither finished nor been aborted."""
        return list(self._open)

    @property
    def pending(self) -> bool:
        """True while rows wait for the consumer."""
        return self._fresh

    @property
    def ended(self) -> bool:
        """Nothing pending and nothing more to come: every request finished, or the engine died
        (taking then raises)."""
        return not self._fresh and not self._open

    def listen(self, listener: Callable[[], None] | None) -> None:
        """Call `listener` soon after news arrives (rows, an end, a failure) while no consumer
        waits: once per event-loop round, however much arrived. None: stop (a listener is
        usually a method of an object that holds the stream; dropping it when done leaves no
        reference cycle, so a finished request is freed at once, not by the GC)."""
        self._listener = listener

    def detach(self) -> None:
        """Drop the sink and the listener once the consumer is done with the stream (they are
        usually the objects that hold it: no reference cycle is left, the request is freed at
        once, not by the GC)."""
        self._sink = self._listener = None

    def open(self, request_id: str) -> None:
        self._open.add(request_id)

    def close(self, request_id: str) -> None:
        self._open.discard(request_id)
        self._wake()

    def put(self, request_id: str, item: StepItem,
            news: list[OutputStream] | None = None) -> None:
        """Add an item and wake the consumer soon; with `news`, enter that list instead (once)
        and leave the waking to the caller's `notify()`."""
        if item.finish_reason is not None:
            self._open.discard(request_id)
        sink = self._sink
        if sink is None:
            self._items.append(item)
        else:
            try:
                sink.item(item)
            except Exception as exc:  # noqa: BLE001 - the consumer's failure, not the router's
                self._sink_failed(exc)
        self._fresh = True
        if news is None:
            self._wake()
        elif not self._in_news:
            self._in_news = True
            news.append(self)

    def put_token(self, choice: int, token_id: int, logprob: TokenLogprob | None,
                  news: list[OutputStream]) -> None:
        """`put` of the common row, a sampled token and nothing else, left for `notify()`."""
        sink = self._sink
        if sink is None:
            self._items.append(StepItem(choice, token_id, logprob, None, None))
        else:
            try:
                sink.token(choice, token_id, logprob)
            except Exception as exc:  # noqa: BLE001 - the consumer's failure, not the router's
                self._sink_failed(exc)
        self._fresh = True
        if not self._in_news:
            self._in_news = True
            news.append(self)

    def notify(self) -> None:
        """Tell the consumer, now, about what was put with `news`: wake a waiting consumer, or
        call the listener (synchronously)."""
        self._in_news = False
        waiter = self._waiter
        if waiter is not None:
            if not waiter.done():
                waiter.set_result(None)
        elif self._listener is not None:
            self._listener()

    def fail(self, exc: Exception) -> None:
        self._error = exc
        self._open.clear()
        self._wake()

    async def get(self) -> list[StepItem]:
        await self._wait()
        return self.take()

    def take(self) -> list[StepItem]:
        """Every pending item now, without waiting ([] if none); raises EngineDeadError if the
        engine died and nothing is pending. (A stream without a sink.)"""
        if self._fresh:
            self._fresh = False
            items, self._items = self._items, []
            return items
        if self._error is not None:
            raise self._error
        return []

    async def news(self) -> bool:
        """Wait for rows fed to the sink: True once some were, False once every request
        finished; raises the engine's error if it died. (A stream with a sink.)"""
        await self._wait()
        return self.take_news()

    def take_news(self) -> bool:
        """`news()` without waiting: False also while nothing arrived."""
        if self._fresh:
            self._fresh = False
            return True
        if self._error is not None:
            raise self._error
        return False

    async def _wait(self) -> None:
        while not self._fresh and self._open and self._error is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _sink_failed(self, exc: Exception) -> None:
        logger.error("failed to hand engine outputs to a request", exc_info=exc)
        self._sink = None  # nothing more reaches it: the consumer raises and aborts the rest
        self._error = exc

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            if not waiter.done():
                waiter.set_result(None)
        elif self._listener is not None and not self._called:
            self._called = True
            asyncio.get_running_loop().call_soon(self._call)

    def _call(self) -> None:
        self._called = False
        if self._listener is not None and self._waiter is None:
            self._listener()
