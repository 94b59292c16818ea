"""A chat request rendered and planned: what /v1/chat/completions and /v1/responses share below
them (the Responses API is the chat machinery with other shapes around it).

`plan_chat` checks the chat fields, renders the messages with the chat template (tools given to
it), tokenizes the result without adding special tokens again (the template writes BOS), and
plans it like any other prompt: the tool plan's constraint, and with a reasoning parser the
request's `ReasoningPlan` (read from the rendered prompt), go with it.
"""

from __future__ import annotations

import msgspec

from frontend.openai.protocol.chat import (
    ChatCompletionRequest,
    check_chat_request,
    max_completion_tokens,
    top_logprobs,
)
from frontend.openai.reasoning.outputs import ReasoningConfig
from frontend.openai.serving.plan import ApiFields, RequestPlan, plan_request
from frontend.openai.serving.served_model import ServedModel
from frontend.openai.tools.calls import ToolPlan, template_messages


def plan_chat(req: ChatCompletionRequest, tools: ToolPlan, served: ServedModel,
              reasoning: ReasoningConfig | None, id_prefix: str = "chatcmpl") -> RequestPlan:
    """Check, render and plan every choice; raises a 4xx OpenAIError."""
    check_chat_request(req)
    messages = template_messages(req.messages)
    text = served.render_chat(messages, req.add_generation_prompt, req.tools)
    if tools.mode == "auto":  # call markers may be special tokens (as in vLLM's parsers)
        req = msgspec.structs.replace(req, skip_special_tokens=False)
    fields = ApiFields(
        prompt=served.chat_prompt_ids(text),
        max_tokens=max_completion_tokens(req),
        logprobs=top_logprobs(req),
        logprob_entries=False,  # chat shapes its own, from the released tokens
        constraint=tools.constraint,
        reasoning=reasoning.for_prompt(text) if reasoning else None,
    )
    return plan_request(req, fields, served, id_prefix)
