"""POST /v1/completions: validate, tokenize, run one engine request per choice, answer.

Choice i*n + j is sample j of prompt i (OpenAI's indexing for batched prompts). Each choice
has its own ChoiceProcessor; the non-streaming answer is built from the very deltas a stream
would send (`to_choice`), so both agree exactly. Whatever ends the handler — success, error,
client disconnect, cancellation — every engine request still running is aborted.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from frontend.engine_client import EngineClient, EngineDeadError
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
from frontend.serving_common import (
    ChoiceState,
    EngineRequestError,
    SSEWriter,
    engine_error,
    run_choices,
)
from shared.messages import SamplingParams


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

    def plan(
        self, req: CompletionRequest, options: OutputOptions | None = None, id_prefix: str = "cmpl"
    ) -> CompletionPlan:
        """Validate against the model and build every choice; raises a 4xx OpenAIError.

        `options` replaces the output options the request implies (the chat API, which shapes
        its own logprobs, plans its rendered prompt through here)."""
        check_completion_request(req)
        self.check_model(req.model)
        self.check_ids(list(parse_logit_bias(req.logit_bias) or ()), "logit_bias")
        self.check_ids(req.stop_token_ids or [], "stop_token_ids")
        prompts = [self._tokenize(p) for p in split_prompts(req.prompt)]
        budgets = [max_tokens_for(req, len(p), self.max_model_len) for p in prompts]
        plan = CompletionPlan(req, prompts, [], id=f"{id_prefix}-{uuid.uuid4().hex}")
        options = options or output_options(req)
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
        self.check_ids(ids, "prompt")
        return list(ids)

    def check_model(self, model: str | None) -> None:
        """A request naming another model than the one served is a 404."""
        if model is not None and model != self.model_name:
            raise OpenAIError(
                404,
                f"The model `{model}` does not exist.",
                param="model",
                code="model_not_found",
            )

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        """Every id must be in the vocabulary both the tokenizer and the model know."""
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(
                f"token id {bad[0]} in {param} is out of vocabulary "
                f"(valid ids are 0..{self.vocab_size - 1})",
                param,
            )

    async def _complete(self, plan: CompletionPlan) -> web.Response:
        collected: list[list[ChoiceDelta]] = [[] for _ in plan.choices]
        try:
            async with aclosing(run_choices(self.client, plan.choices)) as outputs:
                async for output in outputs:
                    collected[output.index].append(output.delta)
        except (EngineRequestError, EngineDeadError) as exc:
            raise engine_error(exc) from None
        choices = [to_choice(i, d, plan.with_logprobs) for i, d in enumerate(collected)]
        body = CompletionResponse(plan.id, plan.created, self.model_name, choices, plan.usage())
        return web.Response(body=msgspec.json.encode(body), content_type="application/json")

    async def _stream(self, request: web.Request, plan: CompletionPlan) -> web.StreamResponse:
        sse = SSEWriter(request)
        options = plan.request.stream_options
        try:
            async with aclosing(run_choices(self.client, plan.choices)) as outputs:
                async for index, delta, _ in outputs:
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
