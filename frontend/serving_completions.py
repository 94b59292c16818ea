"""POST /v1/completions: validate, tokenize, run one engine request per choice, answer.

Choice i*n + j is sample j of prompt i (OpenAI's indexing for batched prompts). Each choice
has its own ChoiceProcessor; the non-streaming answer is built from the very deltas a stream
would send (`to_choice`), so both agree exactly. Whatever ends the handler — success, error,
client disconnect, cancellation — every engine request still running is aborted.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from frontend.engine_client import EngineClient, EngineDeadError, OutputStream, StepItem
from frontend.errors import OpenAIError, bad_request
from frontend.output_processor import (
    ChoiceDelta,
    ChoiceProcessor,
    OutputOptions,
    TokenTextCache,
    merge_deltas,
)
from frontend.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChunk,
    Usage,
    check_completion_request,
    decode_completion_request,
    max_tokens_for,
    parse_logit_bias,
    split_prompts,
    stop_strings,
)
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


@dataclass
class CompletionPlan:
    """A validated request: its prompts, one ChoiceState per choice, its response id."""

    request: CompletionRequest
    prompts: list[list[int]]
    choices: list[ChoiceState]
    id: str = field(default_factory=lambda: f"cmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def with_logprobs(self) -> bool:
        return self.request.logprobs is not None

    def usage(self) -> Usage:
        generated = sum(c.processor.num_generated_tokens for c in self.choices)
        return Usage.of(sum(len(p) for p in self.prompts), generated)


class ServingCompletions:
    """The /v1/completions logic for one engine, tokenizer and served model name."""

    def __init__(
        self, client: EngineClient, tokenizer: Any, token_text: TokenTextCache, model_name: str
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.token_text = token_text
        self.model_name = model_name
        self.max_model_len = client.ready.max_model_len
        self.vocab_size = min(len(tokenizer), client.ready.vocab_size)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        plan = self.plan(decode_completion_request(await request.read()))
        if plan.request.stream:
            return await self._stream(request, plan)
        return await self._complete(plan)

    def plan(self, req: CompletionRequest) -> CompletionPlan:
        """Validate against the model and build every choice; raises a 4xx OpenAIError."""
        check_completion_request(req)
        if req.model is not None and req.model != self.model_name:
            raise OpenAIError(
                404,
                f"The model `{req.model}` does not exist.",
                param="model",
                code="model_not_found",
            )
        self._check_ids(list(parse_logit_bias(req.logit_bias) or ()), "logit_bias")
        self._check_ids(req.stop_token_ids or [], "stop_token_ids")
        prompts = [self._tokenize(p) for p in split_prompts(req.prompt)]
        budgets = [max_tokens_for(req, len(p), self.max_model_len) for p in prompts]
        plan = CompletionPlan(req, prompts, [])
        options = output_options(req)
        for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
            for j in range(req.n):
                index = i * req.n + j
                processor = ChoiceProcessor(self.tokenizer, prompt, options, self.token_text)
                params = sampling_params(req, budget, j)
                plan.choices.append(
                    ChoiceState(index, f"{plan.id}-{index}", prompt, params, processor)
                )
        return plan

    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        if not ids:
            raise bad_request("prompt must not be empty", "prompt")
        self._check_ids(ids, "prompt")
        return list(ids)

    def _check_ids(self, ids: Sequence[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(
                f"token id {bad[0]} in {param} is out of vocabulary "
                f"(valid ids are 0..{self.vocab_size - 1})",
                param,
            )

    async def _run(self, plan: CompletionPlan) -> AsyncGenerator[tuple[int, ChoiceDelta], None]:
        """Yield (choice index, delta) as the engine produces; abort leftovers on exit."""
        stream = OutputStream()
        try:
            for c in plan.choices:
                self.client.add(c.request_id, c.prompt_ids, c.params, stream, c.index)
            while batch := await stream.get():
                for item in batch:
                    for delta in self._advance(plan.choices[item.choice], item):
                        yield item.choice, delta
        finally:
            self.client.abort(stream.unfinished)

    def _advance(self, choice: ChoiceState, item: StepItem) -> list[ChoiceDelta]:
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
            self.client.abort([choice.request_id])
        return deltas

    async def _complete(self, plan: CompletionPlan) -> web.Response:
        collected: list[list[ChoiceDelta]] = [[] for _ in plan.choices]
        try:
            async with aclosing(self._run(plan)) as deltas:
                async for index, delta in deltas:
                    collected[index].append(delta)
        except (EngineRequestError, EngineDeadError) as exc:
            raise engine_error(exc) from None
        choices = [to_choice(i, d, plan.with_logprobs) for i, d in enumerate(collected)]
        body = CompletionResponse(plan.id, plan.created, self.model_name, choices, plan.usage())
        return web.Response(body=msgspec.json.encode(body), content_type="application/json")

    async def _stream(self, request: web.Request, plan: CompletionPlan) -> web.StreamResponse:
        sse = SSEWriter(request)
        options = plan.request.stream_options
        try:
            async with aclosing(self._run(plan)) as deltas:
                async for index, delta in deltas:
                    if not is_empty(delta):
                        await sse.send(self._chunk(plan, index, delta))
        except (EngineRequestError, EngineDeadError) as exc:
            if not sse.started:
                raise engine_error(exc) from None
            return await sse.fail(engine_error(exc).to_json())
        if options is not None and options.include_usage:
            await sse.send(
                CompletionStreamChunk(plan.id, plan.created, self.model_name, [], plan.usage())
            )
        return await sse.done()

    def _chunk(self, plan: CompletionPlan, index: int, delta: ChoiceDelta) -> CompletionStreamChunk:
        options = plan.request.stream_options
        usage = None
        if options is not None and options.continuous_usage_stats:
            choice = plan.choices[index]
            usage = Usage.of(len(choice.prompt_ids), choice.processor.num_generated_tokens)
        choices = [to_choice(index, [delta], plan.with_logprobs)]
        return CompletionStreamChunk(plan.id, plan.created, self.model_name, choices, usage)


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


def output_options(req: CompletionRequest) -> OutputOptions:
    return OutputOptions(
        echo=req.echo,
        logprobs=req.logprobs,
        stop=stop_strings(req),
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        return_tokens_as_token_ids=req.return_tokens_as_token_ids,
    )


def sampling_params(req: CompletionRequest, max_tokens: int, sample: int) -> SamplingParams:
    """Engine parameters for sample `sample` of a prompt; samples get distinct seeds."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=None if req.seed is None else req.seed + sample,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=parse_logit_bias(req.logit_bias),
        min_tokens=req.min_tokens,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=req.logprobs,
        prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None,
    )


def to_choice(index: int, deltas: Sequence[ChoiceDelta], with_logprobs: bool) -> CompletionChoice:
    """One choice from its deltas, concatenated (a stream chunk is the case of one delta)."""
    d = merge_deltas(deltas)
    logprobs = None
    if with_logprobs:
        logprobs = CompletionLogprobs(d.text_offset, d.token_logprobs, d.tokens, d.top_logprobs)
    return CompletionChoice(index, d.text, logprobs, d.finish_reason, d.stop_reason)


def is_empty(delta: ChoiceDelta) -> bool:
    """A delta worth no chunk: no text, no logprob entries, no finish."""
    return not delta.text and not delta.tokens and delta.finish_reason is None


def engine_error(exc: Exception) -> OpenAIError:
    if isinstance(exc, EngineDeadError):
        return OpenAIError(503, f"The engine is unavailable: {exc}. Retry later.")
    return bad_request(str(exc))
