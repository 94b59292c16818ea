"""What the OpenAI serving modules share: per-choice state, the engine loop, SSE, engine errors.

`run_choices` sends one engine request per choice and turns engine steps into ChoiceProcessor
deltas. Whatever ends it — success, error, client disconnect, cancellation — every engine
request still running is aborted. Each delta comes with the engine steps whose tokens it
releases (in order), for APIs that shape logprobs from token ids (chat).
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec
from aiohttp import web

from frontend.engine_client import EngineClient, EngineDeadError, OutputStream, StepItem
from frontend.errors import OpenAIError, bad_request
from frontend.output_processor import ChoiceDelta, ChoiceProcessor
from shared.messages import SamplingParams

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class EngineRequestError(Exception):
    """The engine finished a request with "error" (e.g. it can never fit in the KV cache)."""


@dataclass
class ChoiceState:
    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    processor: ChoiceProcessor
    started: bool = False
    # Steps that brought a token whose entry the processor has not released yet. The processor
    # releases one entry per token, in order, so a delta with k token ids releases the first k.
    pending: deque[StepItem] = field(default_factory=deque)


class ChoiceOutput(NamedTuple):
    index: int
    delta: ChoiceDelta
    steps: list[StepItem]  # the steps whose tokens `delta.token_ids` are, in order


async def run_choices(
    client: EngineClient, choices: Sequence[ChoiceState]
) -> AsyncGenerator[ChoiceOutput, None]:
    """Yield each choice's outputs as the engine produces; abort leftovers on exit.

    `choices[i].index` must be i. Raises EngineRequestError or EngineDeadError.
    """
    stream = OutputStream()
    try:
        for c in choices:
            client.add(c.request_id, c.prompt_ids, c.params, stream, c.index)
        while batch := await stream.get():
            for item in batch:
                for output in advance(client, choices[item.choice], item):
                    yield output
    finally:
        client.abort(stream.unfinished)


def advance(client: EngineClient, choice: ChoiceState, item: StepItem) -> list[ChoiceOutput]:
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
    if item.token_id is not None:
        choice.pending.append(item)
    if item.token_id is not None or item.finish_reason is not None:
        deltas.append(
            proc.step(item.token_id, item.logprob, item.finish_reason, item.stop_token_id)
        )
    if proc.stopped_by_string:
        client.abort([choice.request_id], stopped=True)
    return [ChoiceOutput(choice.index, d, _released(choice, d)) for d in deltas]


def _released(choice: ChoiceState, delta: ChoiceDelta) -> list[StepItem]:
    return [choice.pending.popleft() for _ in delta.token_ids]


class SSEWriter:
    """Server-sent events, prepared lazily at the first event: an error found before anything
    was sent can still be answered with a plain status and JSON body."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response = web.StreamResponse(headers=_SSE_HEADERS)
        self.started = False
        self._encoder = msgspec.json.Encoder()

    async def send(self, payload: msgspec.Struct) -> None:
        await self._write(self._encoder.encode(payload))

    async def fail(self, error_json: bytes) -> web.StreamResponse:
        """Send an error event and end the stream (no [DONE])."""
        await self._write(error_json)
        await self.response.write_eof()
        return self.response

    async def done(self) -> web.StreamResponse:
        await self._write(b"[DONE]")
        await self.response.write_eof()
        return self.response

    async def _write(self, data: bytes) -> None:
        if not self.started:
            self.started = True
            await self.response.prepare(self.request)
        await self.response.write(b"data: " + data + b"\n\n")


def engine_error(exc: Exception) -> OpenAIError:
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, f"The engine is unavailable: {exc}. Retry later.")
    return bad_request(str(exc))
