"""POST /v1/completions: decode, plan, run one engine request per choice, answer.

Each choice has its own ChoiceProcessor; the non-streaming answer is built from the very deltas
a stream would send (`to_choice`), so both agree exactly: the text-offset contract of
docs/architecture.md (Contracts).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from aiohttp import web

from frontend.engine.group import EngineGroup
from frontend.errors import bad_request
from frontend.openai.completions.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChunk,
)
from frontend.openai.protocol.base import Usage, decode_request
from frontend.openai.serving.choices import (
    chunk_head,
    collect_choices,
    json_response,
    prepare,
    stream_choices,
)
from frontend.openai.serving.plan import ApiFields, RequestPlan, plan_request
from frontend.openai.serving.served_model import ServedModel
from frontend.text.output_processor import ChoiceDelta, merge_deltas


class ServingCompletions:
    """The /v1/completions endpoint for one engine and one served model."""

    def __init__(self, client: EngineGroup, served: ServedModel) -> None:
        self.client = client
        self.served = served

    async def handle(self, request: web.Request) -> web.StreamResponse:
        req, plan = await prepare(await request.read(), self.read)
        if req.stream:
            return await self._stream(request, req, plan)
        return await self._complete(req, plan)

    def read(self, body: bytes) -> tuple[CompletionRequest, RequestPlan]:
        """Decode, check, tokenize and plan a request body; raises a 4xx."""
        req = decode_request(body, CompletionRequest, self.served.sampling_defaults)
        check_completion_request(req)
        return req, plan_request(req, completion_fields(req), self.served, "cmpl")

    async def _complete(self, req: CompletionRequest, plan: RequestPlan) -> web.Response:
        collected = await collect_choices(self.client, plan)
        with_logprobs = req.logprobs is not None
        choices = [to_choice(i, d, with_logprobs) for i, d in enumerate(collected)]
        return json_response(
            CompletionResponse(plan.id, plan.created, plan.model, choices, plan.usage())
        )

    async def _stream(
        self, request: web.Request, req: CompletionRequest, plan: RequestPlan
    ) -> web.StreamResponse:
        options = req.stream_options
        with_usage = options is not None and options.continuous_usage_stats
        template = ChunkTemplate(plan.id, plan.created, plan.model, req.logprobs is not None)

        def chunks_of(index: int, delta: ChoiceDelta) -> list[bytes]:
            if delta.is_empty:
                return []
            return [template.chunk(index, delta, plan.choices[index].usage())]

        def usage_chunk(usage: Usage) -> CompletionStreamChunk:
            return CompletionStreamChunk(plan.id, plan.created, plan.model, [], usage)

        final = usage_chunk if options is not None and options.include_usage else None
        return await stream_choices(request, self.client, plan,
                                    chunks_of if with_usage else template.chunks_of, final)


def check_completion_request(req: CompletionRequest) -> None:
    """The completions-only field rules (the shared ones are the planner's); raises a 400."""
    if req.suffix is not None:
        raise bad_request("suffix is not currently supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(
            f"best_of must equal n (got best_of={req.best_of}, n={req.n}): "
            "ranking several samples is not supported",
            param="best_of",
        )


def completion_fields(req: CompletionRequest) -> ApiFields:
    """What the planner needs from a completions request besides the shared fields."""
    return ApiFields(
        prompt=req.prompt,
        max_tokens=req.max_tokens,
        logprobs=req.logprobs,
        echo=req.echo,
        return_tokens_as_token_ids=req.return_tokens_as_token_ids,
    )


class ChunkTemplate:
    """A streamed chunk's JSON bytes from parts encoded once per request: per chunk only the
    delta's own fields are encoded. The bytes are exactly msgspec's encoding of the
    CompletionStreamChunk the same delta makes (the field order of protocol.py)."""

    _UNFINISHED = b',"finish_reason":null,"stop_reason":null}]'
    _PLAIN_TAIL = b',"logprobs":null' + _UNFINISHED
    _END = b',"object":"text_completion"}'
    _PLAIN_END = _PLAIN_TAIL + b',"usage":null' + _END  # no logprobs, no finish, no usage

    def __init__(self, request_id: str, created: int, model: str, with_logprobs: bool) -> None:
        self._head = chunk_head(request_id, created, model)
        self._heads: dict[int, bytes] = {}
        self._with_logprobs = with_logprobs
        self._encode = msgspec.json.Encoder().encode

    def chunks_of(self, index: int, delta: ChoiceDelta) -> list[bytes]:
        """The chunk of a delta that is not empty, without usage (`serving.choices.ChunksOf`)."""
        if delta.finish_reason is None and not self._with_logprobs:  # the common chunk
            if not delta.text:
                return []
            head = self._heads.get(index)
            if head is not None:
                return [head + self._encode(delta.text) + self._PLAIN_END]
        elif delta.is_empty:
            return []
        return [self.chunk(index, delta)]

    def chunk(self, index: int, delta: ChoiceDelta, usage: Usage | None = None) -> bytes:
        head = self._heads.get(index)
        if head is None:
            head = self._heads[index] = self._head + str(index).encode() + b',"text":'
        encode = self._encode
        if usage is None and not self._with_logprobs and delta.finish_reason is None:
            return head + encode(delta.text) + self._PLAIN_END
        if self._with_logprobs or delta.finish_reason is not None:
            logprobs = b"null"
            if self._with_logprobs:
                logprobs = encode(CompletionLogprobs(delta.text_offset, delta.token_logprobs,
                                                     delta.tokens, delta.top_logprobs))
            if delta.finish_reason is None and delta.stop_reason is None:
                tail = b',"logprobs":' + logprobs + self._UNFINISHED
            else:
                tail = (b',"logprobs":' + logprobs + b',"finish_reason":'
                        + encode(delta.finish_reason) + b',"stop_reason":'
                        + encode(delta.stop_reason) + b"}]")
        else:
            tail = self._PLAIN_TAIL
        usage_json = b"null" if usage is None else encode(usage)
        return head + encode(delta.text) + tail + b',"usage":' + usage_json + self._END


def to_choice(index: int, deltas: Sequence[ChoiceDelta], with_logprobs: bool) -> CompletionChoice:
    """One choice from its deltas, concatenated (a stream chunk is the case of one delta)."""
    d = merge_deltas(deltas)
    logprobs = None
    if with_logprobs:
        logprobs = CompletionLogprobs(d.text_offset, d.token_logprobs, d.tokens, d.top_logprobs)
    return CompletionChoice(index, d.text, logprobs, d.finish_reason, d.stop_reason)
