"""POST /v1/chat/completions: render the chat template, then sample as completions do.

The messages are rendered with the tokenizer's chat template and tokenized without adding
special tokens again (the template writes BOS itself). The rendered prompt goes through the same
planner and engine loop as completions (validation, ChoiceProcessor, abort handling); this
module only shapes the answer: messages, role/content deltas, and OpenAI's chat logprobs, built
from the generated tokens each delta releases, so that every token carries its real bytes. The
token that ended a choice (EOS or a stop_token_ids token) is not message content and gets no
logprobs entry unless include_stop_str_in_output put its text in the message. Rendering and
planning are `serving.chat_plan.plan_chat`, which the Responses API shares. With a reasoning
parser each choice's text is split first (`reasoning/`): `reasoning` / `delta.reasoning` get
the thinking, and everything else here (content, tool calls) reads only the answer.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from frontend.engine.group import EngineGroup
from frontend.openai.protocol.base import Usage, decode_request
from frontend.openai.protocol.chat import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    DeltaMessage,
    ResponseMessage,
    TokenLogprobEntry,
    TopLogprob,
    check_chat_request,
    top_logprobs,
)
from frontend.openai.reasoning.outputs import ReasoningConfig
from frontend.openai.serving.chat_plan import plan_chat
from frontend.openai.serving.choices import (
    chunk_head,
    collect_choices,
    json_response,
    prepare,
    stream_choices,
)
from frontend.openai.serving.plan import RequestPlan
from frontend.openai.serving.served_model import ServedModel
from frontend.openai.tools.calls import ChoiceTools, ToolPlan, read_tool_plan
from frontend.text.logprob_text import TokenTextCache
from frontend.text.output_processor import ChoiceDelta, GeneratedToken, merge_deltas

NO_TOOLS = ToolPlan("none")


class ServingChat:
    """The /v1/chat/completions endpoint for one engine and one served model."""

    def __init__(
        self,
        client: EngineGroup,
        served: ServedModel,
        auto_tool_parser: str | None = None,
        response_role: str = "assistant",
        reasoning: ReasoningConfig | None = None,
    ) -> None:
        self.client = client
        self.served = served
        self.auto_tool_parser = auto_tool_parser  # None: tool_choice "auto" is refused
        self.response_role = response_role  # the role chat answers carry
        self.reasoning = reasoning  # --reasoning-parser: answers split into reasoning, content

    async def handle(self, request: web.Request) -> web.StreamResponse:
        req, tools, plan = await prepare(await request.read(), self.read)
        if req.stream:
            return await self._stream(request, req, plan, tools)
        return await self._complete(req, plan, tools)

    def read(self, body: bytes) -> tuple[ChatCompletionRequest, ToolPlan, RequestPlan]:
        """Decode, check, render, tokenize and plan a request body; raises a 4xx."""
        req = decode_request(body, ChatCompletionRequest, self.served.sampling_defaults)
        check_chat_request(req)
        tools = read_tool_plan(req, self.auto_tool_parser)
        return req, tools, self.plan(req, tools)

    def plan(self, req: ChatCompletionRequest, tools: ToolPlan = NO_TOOLS) -> RequestPlan:
        """Check, render and plan every choice; raises a 4xx OpenAIError."""
        return plan_chat(req, tools, self.served, self.reasoning)

    async def _complete(
        self, req: ChatCompletionRequest, plan: RequestPlan, tools: ToolPlan
    ) -> web.Response:
        logprobs = ChatLogprobsBuilder(self.served.token_text, top_logprobs(req))
        choices = []
        for index, deltas in enumerate(await collect_choices(self.client, plan)):
            d = merge_deltas(deltas)
            thinking = plan.reasoning.choice() if plan.reasoning else None
            if thinking is not None:  # the rest reads the content alone
                _, d = thinking.split(d, final=True)
            message, finish = ResponseMessage(d.text), d.finish_reason
            if tools.active:
                message, finish = tool_message(tools, d)
            message.role = self.response_role
            if thinking is not None:
                message = thinking.message(message)
            choices.append(ChatChoice(index, message, logprobs.of(d), finish, d.stop_reason))
        return json_response(
            ChatCompletionResponse(plan.id, plan.created, plan.model, choices, plan.usage())
        )

    async def _stream(
        self, request: web.Request, req: ChatCompletionRequest, plan: RequestPlan,
        tools: ToolPlan,
    ) -> web.StreamResponse:
        """The role first, once per choice; then each delta's content in a chunk or, when the
        answer is read for tool calls, its content and call deltas each in their own chunk; the
        delta's logprobs and finish go with its last chunk."""
        options = req.stream_options
        with_usage = options is not None and options.continuous_usage_stats
        logprobs = ChatLogprobsBuilder(self.served.token_text, top_logprobs(req))
        readers = [ChoiceTools(tools) for _ in plan.choices] if tools.active else None
        thinking = [plan.reasoning.choice() for _ in plan.choices] if plan.reasoning else None
        greeted = [False] * len(plan.choices)
        encode = msgspec.json.Encoder().encode

        def chunk(index: int, choice: ChatStreamChoice) -> ChatCompletionChunk:
            usage = plan.choices[index].usage() if with_usage else None
            return ChatCompletionChunk(plan.id, plan.created, plan.model, [choice], usage)

        def messages_of(index: int, delta: ChoiceDelta) -> tuple[list[DeltaMessage], str | None]:
            if thinking is not None:  # the reasoning first; the rest reads the content alone
                reasoning, delta = thinking[index].split(delta)
                messages, finish = content_of(index, delta)
                return thinking[index].deltas(reasoning, messages), finish
            return content_of(index, delta)

        def content_of(index: int, delta: ChoiceDelta) -> tuple[list[DeltaMessage], str | None]:
            if readers is None:
                content = [] if delta.is_empty else [DeltaMessage(content=delta.text)]
                return content, delta.finish_reason
            messages = tool_deltas(readers[index], delta)
            if not messages and not delta.is_empty:
                messages = [DeltaMessage()]
            return messages, tools.finish_reason(delta.finish_reason,
                                                 bool(readers[index].calls()))

        content_only = (readers is None and thinking is None and logprobs.top_k is None
                        and not with_usage)
        plain = ContentChunks(plan.id, plan.created, plan.model) if content_only else None

        def chunks_of(index: int, delta: ChoiceDelta) -> list[bytes]:
            if plain is not None and greeted[index] and delta.finish_reason is None:
                return [plain.chunk(index, delta.text)] if delta.text else []
            chunks = []
            if not greeted[index]:
                greeted[index] = True
                role = DeltaMessage(self.response_role, "")
                chunks.append(chunk(index, ChatStreamChoice(index, role)))
            messages, finish = messages_of(index, delta)
            for i, message in enumerate(messages):
                last = i == len(messages) - 1
                chunks.append(chunk(index, ChatStreamChoice(
                    index, message, logprobs.of(delta) if last else None,
                    finish if last else None, delta.stop_reason if last else None)))
            return [encode(c) for c in chunks]

        def usage_chunk(usage: Usage) -> ChatCompletionChunk:
            return ChatCompletionChunk(plan.id, plan.created, plan.model, [], usage)

        final = usage_chunk if options is not None and options.include_usage else None
        return await stream_choices(request, self.client, plan, chunks_of, final)


class ContentChunks:
    """The common chat chunk, a delta's content alone (no role, logprobs, finish or usage), from
    parts encoded once per request; exactly msgspec's encoding of the ChatCompletionChunk the
    same delta makes (the field order of protocol/chat.py)."""

    _TAIL = (b'},"logprobs":null,"finish_reason":null,"stop_reason":null}],"usage":null,'
             b'"object":"chat.completion.chunk"}')

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self._head = chunk_head(request_id, created, model)
        self._heads: dict[int, bytes] = {}
        self._encode = msgspec.json.Encoder().encode

    def chunk(self, index: int, content: str) -> bytes:
        head = self._heads.get(index)
        if head is None:
            head = self._heads[index] = self._head + str(index).encode() + b',"delta":{"content":'
        return head + self._encode(content) + self._TAIL


def tool_message(tools: ToolPlan, delta: ChoiceDelta) -> tuple[ResponseMessage, str | None]:
    """A whole choice read for tool calls: its message and finish reason."""
    reader = ChoiceTools(tools)
    content = reader.read(delta.text, final=True).content
    calls = reader.calls()
    message = ResponseMessage(content or None, tool_calls=calls or msgspec.UNSET)
    return message, tools.finish_reason(delta.finish_reason, bool(calls))


def tool_deltas(reader: ChoiceTools, delta: ChoiceDelta) -> list[DeltaMessage]:
    """A streamed delta's text read for tool calls: a content message, then one per call
    delta."""
    read = reader.read(delta.text, final=delta.finish_reason is not None)
    messages = [DeltaMessage(content=read.content)] if read.content else []
    return messages + [DeltaMessage(tool_calls=[call]) for call in read.calls]


class ChatLogprobsBuilder:
    """OpenAI's chat logprobs from the generated tokens a delta releases."""

    def __init__(self, token_text: TokenTextCache, top_k: int | None) -> None:
        self.token_text = token_text
        self.top_k = top_k  # None: logprobs were not asked

    def of(self, delta: ChoiceDelta) -> ChatLogprobs | None:
        if self.top_k is None:
            return None
        return ChatLogprobs(
            [self._entry(g, self.top_k) for g in delta.generated if has_entry(g)]
        )

    def _entry(self, token: GeneratedToken, k: int) -> TokenLogprobEntry:
        assert token.logprob is not None
        lp = token.logprob
        top = [self._top(int(i), float(v)) for i, v in zip(lp.top_ids[:k], lp.top_logprobs[:k])]
        chosen = self._top(token.token_id, float(lp.logprob))
        return TokenLogprobEntry(chosen.token, chosen.logprob, chosen.bytes, top)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.token_text.get(token_id)
        return TopLogprob(token, logprob, token_bytes(self.token_text, token_id, token))


def has_entry(token: GeneratedToken) -> bool:
    """The terminating EOS / stop token is not message content: no entry for it."""
    return not token.terminator and token.logprob is not None


def token_bytes(token_text: TokenTextCache, token_id: int, token: str) -> list[int]:
    """A token's own UTF-8 bytes; for a token that is not text alone, its raw bytes."""
    if token.startswith("bytes:"):
        raw = token_text.raw_bytes(token_id)
        if raw is not None:
            return list(raw)
    return list(token.encode("utf-8"))
