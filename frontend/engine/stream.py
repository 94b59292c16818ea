"""Where one HTTP request's engine outputs wait for it: `StepItem`s in an `OutputStream`.

The EngineClient's routing task `put`s what each engine step brought each request; the request's
handler awaits `get()`. One stream holds every engine request of one HTTP request (its n
choices), told apart by the caller's choice index.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import NamedTuple

from shared.messages import FinishReason
from shared.step_outputs import TokenLogprob


class StepItem(NamedTuple):
    """What one engine step brought one request. Rows with nothing in them are not delivered."""

    choice: int  # the caller's index for this request within its OutputStream
    token_id: int | None  # None: no token sampled this step (prefill only, or finished)
    logprob: TokenLogprob | None
    prompt_logprobs: list[TokenLogprob] | None  # prompt tokens 1..P-1, once, when asked
    finish_reason: FinishReason | None
    stop_token_id: int | None = None
    error: str | None = None  # the engine's message with finish_reason "error"


class OutputStream:
    """The outputs of one or more engine requests (e.g. the n choices of one HTTP request).

    The routing task `put`s items; the consumer awaits `get()`, which returns every pending
    item at once (so a slow consumer catches up in one wake-up), `[]` once every request of the
    stream has finished or been aborted, and raises EngineDeadError if the engine died.
    """

    def __init__(self) -> None:
        self._items: deque[StepItem] = deque()
        self._open: set[str] = set()
        self._event = asyncio.Event()
        self._error: Exception | None = None

    @property
    def unfinished(self) -> list[str]:
        """Request ids that have neither finished nor been aborted."""
        return list(self._open)

    def open(self, request_id: str) -> None:
        self._open.add(request_id)

    def close(self, request_id: str) -> None:
        self._open.discard(request_id)
        self._event.set()

    def put(self, request_id: str, item: StepItem) -> None:
        self._items.append(item)
        if item.finish_reason is not None:
            self._open.discard(request_id)
        self._event.set()

    def fail(self, exc: Exception) -> None:
        self._error = exc
        self._open.clear()
        self._event.set()

    async def get(self) -> list[StepItem]:
        while not self._items and self._open and self._error is None:
            self._event.clear()
            await self._event.wait()
        if self._items:
            items = list(self._items)
            self._items.clear()
            return items
        if self._error is not None:
            raise self._error
        return []
