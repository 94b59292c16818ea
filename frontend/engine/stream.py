"""Where one HTTP request's engine outputs wait for it: `StepItem`s in an `OutputStream`.

The EngineClient's routing task `put`s what each engine step brought each request; the request's
handler awaits `get()`. One stream holds every engine request of one HTTP request (its n
choices), told apart by the caller's choice index.

This is the frontend's hottest path (every token of every stream passes here), so a stream is
a plain list and at most one future: `put` wakes a waiting consumer once, whatever arrives
before it runs is handed over together, and a consumer that is behind catches up in one
wake-up (docs/architecture.md, "Output merging").

A consumer may also `listen`: while it is not waiting in `get()`, news makes the stream call
its listener once, after the routing task has routed every frame already received, and the
listener `take()`s what arrived without a task switch. The routing task puts rows into a
`news` list (`put(..., news=...)`) and, once every waiting frame is routed, `notify()`s each
stream in it: one synchronous call per stream per engine wake-up, no event-loop callback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import NamedTuple

from shared.messages import FinishReason
from shared.step_outputs import TokenLogprob


class StepItem(NamedTuple):
    """What one engine step brought one request. Rows with nothing in them are not delivered."""

    choice: int  # the caller's index for this request within its OutputStream
    token_id: int | None  # None: no token sampled this step (prefill only, or finished)
    logprob: TokenLogprob | None
    prompt_logprobs: Sequence[TokenLogprob] | None  # prompt tokens 1..P-1, once, when asked
    finish_reason: FinishReason | None
    stop_token_id: int | None = None
    error: str | None = None  # the engine's message with finish_reason "error"


class OutputStream:
    """The outputs of one or more engine requests (e.g. the n choices of one HTTP request).

    The routing task `put`s items; the consumer awaits `get()`, which returns every pending
    item at once (so a slow consumer catches up in one wake-up), `[]` once every request of the
    stream has finished or been aborted, and raises EngineDeadError if the engine died.
    """

    # (__weakref__: EngineGroup maps a stream to its engine in a WeakKeyDictionary)
    __slots__ = ("_items", "_open", "_waiter", "_error", "_listener", "_called", "_in_news",
                 "__weakref__")

    def __init__(self) -> None:
        self._items: list[StepItem] = []
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
        """True while items wait for the consumer."""
        return bool(self._items)

    @property
    def ended(self) -> bool:
        """Nothing pending and nothing more to come: every request finished, or the engine died
        (`take()` then raises)."""
        return not self._items and not self._open

    def listen(self, listener: Callable[[], None] | None) -> None:
        """Call `listener` soon after news arrives (items, an end, a failure) while no consumer
        waits in `get()`: once per event-loop round, however much arrived. None: stop (a
        listener is usually a method of an object that holds the stream; dropping it when done
        leaves no reference cycle, so a finished request is freed at once, not by the GC)."""
        self._listener = listener

    def open(self, request_id: str) -> None:
        self._open.add(request_id)

    def close(self, request_id: str) -> None:
        self._open.discard(request_id)
        self._wake()

    def put(self, request_id: str, item: StepItem,
            news: list[OutputStream] | None = None) -> None:
        """Add an item and wake the consumer soon; with `news`, enter that list instead (once)
        and leave the waking to the caller's `notify()`."""
        self._items.append(item)
        if item.finish_reason is not None:
            self._open.discard(request_id)
        if news is None:
            self._wake()
        elif not self._in_news:
            self._in_news = True
            news.append(self)

    def notify(self) -> None:
        """Tell the consumer, now, about what was put with `news`: wake a waiting `get()`, or
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
        while not self._items and self._open and self._error is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.take()

    def take(self) -> list[StepItem]:
        """Every pending item now, without waiting ([] if none); raises EngineDeadError if the
        engine died and nothing is pending."""
        if self._items:
            items, self._items = self._items, []
            return items
        if self._error is not None:
            raise self._error
        return []

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
