"""POST /v1/chat/completions: render the chat template, then sample as completions do.

The messages are rendered with the tokenizer's chat template and tokenized without adding
special tokens again (the template writes BOS itself). The rendered prompt is planned and run by
the completions machinery (same validation, ChoiceProcessor, engine loop, abort handling); this
module only shapes the answer: messages, role/content deltas, and OpenAI's chat logprobs, built
from token ids so that every token carries its real bytes. The token that ended a choice (EOS or
a stop_token_ids token) is not message content and gets no logprobs entry unless
include_stop_str_in_output put its text in the message.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

import jinja2
import msgspec
from aiohttp import web

from frontend.engine_client import EngineDeadError, StepItem
from frontend.errors import bad_request
from frontend.output_processor import ChoiceDelta, OutputOptions, TokenTextCache, merge_deltas
from frontend.protocol import CompletionRequest, Usage
from frontend.protocol_chat import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
    ResponseMessage,
    TokenLogprobEntry,
    TopLogprob,
    check_chat_request,
    decode_chat_request,
    template_messages,
    to_completion_request,
)
from frontend.serving_common import EngineRequestError, SSEWriter, engine_error, run_choices
from frontend.serving_completions import CompletionPlan, ServingCompletions, output_options


def render_chat(
    tokenizer: Any,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """`messages` rendered with the tokenizer's chat template (BOS included); raises a 400."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise bad_request("This model has no chat template: use /v1/completions.", "messages")
    dicts = template_messages(messages, has_developer_role="developer" in str(template))
    try:
        text = tokenizer.apply_chat_template(
            dicts, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )
    except (jinja2.TemplateError, TypeError, ValueError) as exc:
        message = f"The chat template could not render these messages: {exc}"
        raise bad_request(message, "messages") from None
    return str(text)


def chat_prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """The rendered chat's token ids: special tokens are not added again."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def token_bytes(token_text: TokenTextCache, token_id: int, token: str) -> list[int]:
    """A token's own UTF-8 bytes; for a token that is not text alone, its raw bytes."""
    if token.startswith("bytes:"):
        raw = token_text.raw_bytes(token_id)
        if raw is not None:
            return list(raw)
    return list(token.encode("utf-8"))


@dataclass
class ChatPlan:
    """A chat request and the completion plan that samples its answer."""

    request: ChatCompletionRequest
    plan: CompletionPlan

    @property
    def top_k(self) -> int | None:
        """Top alternatives per token, or None when logprobs were not asked."""
        return self.plan.request.logprobs

    def is_terminator(self, step: StepItem) -> bool:
        """The EOS / stop-token that ended the choice, whose text is not in the message."""
        return step.finish_reason == "stop" and not self.request.include_stop_str_in_output


class ServingChat:
    """The /v1/chat/completions logic, on top of one ServingCompletions."""

    def __init__(self, completions: ServingCompletions) -> None:
        self.completions = completions
        self.tokenizer = completions.tokenizer
        self.token_text = completions.token_text
        self.model_name = completions.model_name

    async def handle(self, request: web.Request) -> web.StreamResponse:
        chat = self.plan(decode_chat_request(await request.read()))
        if chat.request.stream:
            return await self._stream(request, chat)
        return await self._complete(chat)

    def plan(self, req: ChatCompletionRequest) -> ChatPlan:
        """Validate, render and plan every choice; raises a 4xx OpenAIError."""
        check_chat_request(req)
        text = render_chat(self.tokenizer, req.messages, req.add_generation_prompt, req.tools)
        prompt = chat_prompt_ids(self.tokenizer, text)
        completion = to_completion_request(req, prompt)
        options = chat_output_options(completion)
        return ChatPlan(req, self.completions.plan(completion, options, id_prefix="chatcmpl"))

    async def _complete(self, chat: ChatPlan) -> web.Response:
        plan = chat.plan
        deltas: list[list[ChoiceDelta]] = [[] for _ in plan.choices]
        steps: list[list[StepItem]] = [[] for _ in plan.choices]
        try:
            async with aclosing(run_choices(self.completions.client, plan.choices)) as outputs:
                async for index, delta, released in outputs:
                    deltas[index].append(delta)
                    steps[index] += released
        except (EngineRequestError, EngineDeadError) as exc:
            raise engine_error(exc) from None
        choices = [self._choice(chat, i, merge_deltas(d), steps[i]) for i, d in enumerate(deltas)]
        body = ChatCompletionResponse(plan.id, plan.created, self.model_name, choices, plan.usage())
        return web.Response(body=msgspec.json.encode(body), content_type="application/json")

    def _choice(
        self, chat: ChatPlan, index: int, d: ChoiceDelta, steps: list[StepItem]
    ) -> ChatChoice:
        message = ResponseMessage(d.text)
        logprobs = self._logprobs(chat, steps)
        return ChatChoice(index, message, logprobs, d.finish_reason, d.stop_reason)

    async def _stream(self, request: web.Request, chat: ChatPlan) -> web.StreamResponse:
        sse = SSEWriter(request)
        greeted = [False] * len(chat.plan.choices)
        try:
            async with aclosing(run_choices(self.completions.client, chat.plan.choices)) as outs:
                async for index, delta, released in outs:
                    if not greeted[index]:  # the role comes first, once per choice
                        greeted[index] = True
                        await sse.send(self._chunk(chat, index, DeltaMessage("assistant", "")))
                    choice = self._stream_choice(chat, index, delta, released)
                    if choice is not None:
                        await sse.send(self._chunk(chat, index, choice))
        except (EngineRequestError, EngineDeadError) as exc:
            if not sse.started:
                raise engine_error(exc) from None
            return await sse.fail(engine_error(exc).to_json())
        options = chat.request.stream_options
        if options is not None and options.include_usage:
            plan = chat.plan
            await sse.send(
                ChatCompletionChunk(plan.id, plan.created, self.model_name, [], plan.usage())
            )
        return await sse.done()

    def _stream_choice(
        self, chat: ChatPlan, index: int, delta: ChoiceDelta, steps: list[StepItem]
    ) -> ChatStreamChoice | None:
        """The chunk choice for one delta, or None when it adds nothing."""
        logprobs = self._logprobs(chat, steps)
        has_entries = logprobs is not None and bool(logprobs.content)
        if not delta.text and not has_entries and delta.finish_reason is None:
            return None
        content = DeltaMessage(content=delta.text)
        return ChatStreamChoice(index, content, logprobs, delta.finish_reason, delta.stop_reason)

    def _chunk(
        self, chat: ChatPlan, index: int, part: ChatStreamChoice | DeltaMessage
    ) -> ChatCompletionChunk:
        choice = part if isinstance(part, ChatStreamChoice) else ChatStreamChoice(index, part)
        usage = None
        options = chat.request.stream_options
        if options is not None and options.continuous_usage_stats:
            state = chat.plan.choices[index]
            usage = Usage.of(len(state.prompt_ids), state.processor.num_generated_tokens)
        plan = chat.plan
        return ChatCompletionChunk(plan.id, plan.created, self.model_name, [choice], usage)

    def _logprobs(self, chat: ChatPlan, steps: Sequence[StepItem]) -> ChatLogprobs | None:
        if chat.top_k is None:
            return None
        entries = [
            self._entry(step, chat.top_k)
            for step in steps
            if not chat.is_terminator(step) and step.logprob is not None
        ]
        return ChatLogprobs(entries)

    def _entry(self, step: StepItem, k: int) -> TokenLogprobEntry:
        assert step.token_id is not None and step.logprob is not None
        lp = step.logprob
        top = [self._top(int(i), float(v)) for i, v in zip(lp.top_ids[:k], lp.top_logprobs[:k])]
        chosen = self._top(step.token_id, float(lp.logprob))
        return TokenLogprobEntry(chosen.token, chosen.logprob, chosen.bytes, top)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        token = self.token_text.get(token_id)
        return TopLogprob(token, logprob, token_bytes(self.token_text, token_id, token))


def chat_output_options(completion: CompletionRequest) -> OutputOptions:
    """The completions output options without logprob strings: chat shapes its own logprobs
    from token ids (the engine still sends them: the sampling parameters ask for them)."""
    return replace(output_options(completion), logprobs=None)
