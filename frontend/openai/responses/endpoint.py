"""POST /v1/responses: OpenAI's Responses API, the stateless subset Codex CLI and the
openai-agents SDK use, on the chat machinery.

A request is read once into a chat request (`input.py`: input items as messages, tools,
tool_choice, text.format as response_format) and planned as chat plans it
(`serving.chat_plan.plan_chat`: the same template, tool plan, structured outputs and reasoning
split); its choice runs on the engine and is answered through what every API uses
(`serving.choices`: `collect_choices`, and `stream_events`, the one stream lifecycle). Only the
shapes differ: the answer's deltas become output items (`output.py`), in a `response` object,
or streamed as OpenAI's named events, each with its `sequence_number`; the joined deltas equal
the non-streamed items.

tool_choice "auto" (Codex's default) never fails for want of server flags, as in vLLM's
Responses endpoint: with `--tool-call-parser` the calls in the text become function_call items;
without one the answer is text (the template still shows the model the tools).

State: none by default; `previous_response_id` is a 400 asking for the whole history, unless
`--responses-store-size N` keeps the last N conversations of this frontend
(`store.py`, where its behaviour behind several frontends is written down).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from frontend.engine.group import EngineGroup
from frontend.errors import OpenAIError, bad_request, from_validation_error
from frontend.openai.protocol.base import decode_request
from frontend.openai.protocol.chat import ChatCompletionRequest, ChatMessage
from frontend.openai.reasoning.outputs import ReasoningConfig
from frontend.openai.responses.input import (
    chat_request,
    input_messages,
    instructions_message,
    output_messages,
)
from frontend.openai.responses.output import OutputItems, new_id
from frontend.openai.responses.protocol import (
    IncompleteDetails,
    InputTokensDetails,
    OutputTokensDetails,
    ResponseError,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    StreamEvent,
)
from frontend.openai.responses.store import ResponseStore
from frontend.openai.serving.chat_plan import plan_chat
from frontend.openai.serving.choices import (
    StreamEvents,
    collect_choices,
    json_response,
    prepare,
    stream_events,
)
from frontend.openai.serving.plan import RequestPlan
from frontend.openai.serving.served_model import ServedModel
from frontend.openai.serving.sse import named_event
from frontend.openai.tools.calls import ToolPlan, read_tool_plan
from frontend.text.output_processor import ChoiceDelta, merge_deltas

# The chat fields an error may name, as the Responses API names them.
PARAMS = {"messages": "input", "prompt": "input", "response_format": "text.format",
          "max_tokens": "max_output_tokens", "min_tokens": "max_output_tokens"}
STATELESS = ("This server keeps no responses, so previous_response_id cannot be followed: send "
             "the whole conversation in input (earlier input items, and the output items of "
             "earlier responses). A server started with --responses-store-size N keeps the "
             "last N responses of each frontend.")


@dataclass
class ResponsesPlan:
    """A planned response: the request, its conversation (for the store) and the chat plan."""

    req: ResponsesRequest
    chat: ChatCompletionRequest
    conversation: list[ChatMessage]  # the history continued and the input, instructions out
    tools: ToolPlan
    plan: RequestPlan
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))


class ServingResponses:
    """The /v1/responses endpoint for one engine and one served model."""

    def __init__(self, client: EngineGroup, served: ServedModel,
                 tool_call_parser: str | None = None, reasoning: ReasoningConfig | None = None,
                 store: ResponseStore | None = None) -> None:
        self.client = client
        self.served = served
        self.tool_call_parser = tool_call_parser  # None: "auto" answers text
        self.reasoning = reasoning
        self.store = store  # None: stateless

    async def handle(self, request: web.Request) -> web.StreamResponse:
        planned = await prepare(await request.read(), self.read)
        if planned.req.stream:
            return await self._stream(request, planned)
        return await self._complete(planned)

    def read(self, body: bytes) -> ResponsesPlan:
        """Decode, check, convert and plan a request body; raises a 4xx naming its field."""
        req = decode_request(body, ResponsesRequest)
        try:
            check_stateless(req)
            conversation = [*self._history(req.previous_response_id), *input_messages(req.input)]
            chat = chat_request(req, [*instructions_message(req.instructions), *conversation],
                                self.served.sampling_defaults)
            tools = self._tool_plan(chat)
            plan = plan_chat(chat, tools, self.served, self.reasoning, "resp")
        except OpenAIError as exc:
            raise renamed(exc) from None
        except msgspec.ValidationError as exc:  # a value chat's schema bounds (seed, top_k)
            raise renamed(from_validation_error(exc)) from None
        plan.constraint_param = PARAMS.get(plan.constraint_param or "", plan.constraint_param)
        return ResponsesPlan(req, chat, conversation, tools, plan)

    def _tool_plan(self, chat: ChatCompletionRequest) -> ToolPlan:
        """As chat reads tools, but "auto" without a parser answers text."""
        if chat.tools and chat.tool_choice in (None, "auto") and self.tool_call_parser is None:
            return read_tool_plan(msgspec.structs.replace(chat, tool_choice="none"), None)
        return read_tool_plan(chat, self.tool_call_parser)

    def _history(self, previous: str | None) -> list[ChatMessage]:
        if previous is None:
            return []
        if self.store is None:
            raise bad_request(STATELESS, "previous_response_id")
        conversation = self.store.get(previous)
        if conversation is None:
            raise bad_request(
                f"No response {previous!r} is kept here: this frontend keeps its last "
                f"{self.store.size} responses in memory (each frontend process its own; behind "
                "several frontends a follow-up may reach another one). Send the whole "
                "conversation in input instead.", "previous_response_id")
        return list(conversation)

    def _items(self, rp: ResponsesPlan) -> OutputItems:
        reasoning = rp.plan.reasoning.choice() if rp.plan.reasoning else None
        return OutputItems(reasoning, rp.tools)

    async def _complete(self, rp: ResponsesPlan) -> web.Response:
        (deltas,) = await collect_choices(self.client, rp.plan)
        out = self._items(rp)
        out.feed(merge_deltas(deltas), final=True)
        return json_response(self._finished(rp, out))

    async def _stream(self, request: web.Request, rp: ResponsesPlan) -> web.StreamResponse:
        """response.created and .in_progress with the first delta (an engine refusal before it
        is a plain 400), each delta's events, then .completed or .incomplete; an engine failure
        after the start is a response.failed event. The lifecycle is every stream's
        (`stream_events`); each event is numbered as it is made, in the order it is sent."""
        out = self._items(rp)
        numbers = iter(range(1 << 62))
        encode = msgspec.json.Encoder().encode
        started = False

        def event(e: StreamEvent) -> bytes:
            e.sequence_number = next(numbers)
            return named_event(e.type, encode(e))

        def chunks_of(_: int, delta: ChoiceDelta) -> list[bytes]:
            nonlocal started
            made: list[StreamEvent] = []
            if not started:
                started = True
                made = [ResponseEvent(type=kind, response=self._response(rp, None, "in_progress"))
                        for kind in ("response.created", "response.in_progress")]
            return [event(e) for e in [*made, *out.feed(delta)]]

        def last() -> list[bytes]:
            closing = []
            if out.finish_reason is None:  # the engine said nothing more: close what is open
                closing = out.feed(ChoiceDelta(), final=True)
            response = self._finished(rp, out)
            done = ResponseEvent(type=f"response.{response.status}", response=response)
            return [event(e) for e in [*closing, done]]

        def failed(error: OpenAIError) -> bytes:
            failure = ResponseError(str(error.code), error.message)
            return event(ResponseEvent(type="response.failed", response=self._response(
                rp, out, "failed", failure)))

        return await stream_events(request, self.client, rp.plan,
                                   StreamEvents(chunks_of, last, failed, named=True))

    def _finished(self, rp: ResponsesPlan, out: OutputItems) -> ResponseObject:
        """The whole response; kept in the store when there is one and `store` is not false."""
        response = self._response(rp, out, "incomplete" if out.incomplete else "completed")
        if self.store is not None and rp.req.store is not False:
            self.store.put(response.id, rp.conversation + output_messages(
                msgspec.to_builtins(out.items)))
            response.store = True
        return response

    def _response(self, rp: ResponsesPlan, out: OutputItems | None, status: Any,
                  error: ResponseError | None = None) -> ResponseObject:
        req, chat = rp.req, rp.chat
        usage = None
        if out is not None:
            counts = rp.plan.usage()
            end = rp.plan.reasoning.config.end_ids if rp.plan.reasoning else ()
            usage = ResponseUsage(counts.prompt_tokens, counts.completion_tokens,
                                  counts.total_tokens, InputTokensDetails(),
                                  OutputTokensDetails(out.reasoning_tokens(end)))
        text_format = req.text.format if req.text and req.text.format else None
        return ResponseObject(
            id=rp.id, created_at=rp.created_at, model=rp.plan.model, status=status,
            output=[] if out is None else list(out.items), usage=usage,
            incomplete_details=IncompleteDetails() if status == "incomplete" else None,
            error=error, instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            parallel_tool_calls=req.parallel_tool_calls,
            previous_response_id=req.previous_response_id, reasoning=req.reasoning,
            temperature=chat.temperature, top_p=chat.top_p,
            text={"format": msgspec.to_builtins(text_format) if text_format else
                  {"type": "text"}},
            tool_choice=req.tool_choice or "auto", tools=req.tools or [], user=req.user,
            metadata=req.metadata or {})


def check_stateless(req: ResponsesRequest) -> None:
    """What a stateless server cannot do is a 400, not ignored."""
    if req.conversation is not None:
        raise bad_request("Conversations are not kept here: send the whole conversation in "
                          "input.", "conversation")
    if req.background:
        raise bad_request("background responses are not supported: leave background out (or "
                          "false) and wait for the answer, or stream it", "background")


def renamed(exc: OpenAIError) -> OpenAIError:
    """A chat-level error naming the field as the Responses API calls it."""
    param = PARAMS.get(exc.param or "", exc.param)
    message = exc.message.replace("response_format.json_schema.schema", "text.format.schema")
    message = message.replace("response_format", "text.format")
    return OpenAIError(exc.status, message, exc.type, param, exc.code)
