"""A generation request planned once, top to bottom: checked, converted, one choice per sample.

Both generation APIs decode their own request type (each derives from `SamplingRequest`) and
hand the planner the shared fields plus their own (`ApiFields`: the prompt, the completion
budget, the logprobs asked, echo...). `plan_request` checks every rule the shared fields obey
against the served model, reads the stop strings and parses logit_bias once, builds the engine's
`SamplingParams` and the processor's `OutputOptions` once, then tokenizes the prompts and makes
one `ChoiceState` per choice: choice i*n + j is sample j of prompt i (OpenAI's indexing for
batched prompts), with its own budget, seed and `ChoiceProcessor`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from frontend.errors import bad_request
from frontend.openai.protocol.base import MAX_STOP_STRINGS, SamplingRequest, Usage, split_prompts
from frontend.openai.protocol.structured import Constraint, read_constraint
from frontend.openai.reasoning.outputs import ReasoningPlan
from frontend.openai.serving.served_model import ServedModel
from frontend.text.output_processor import ChoiceProcessor, OutputOptions
from shared.messages import SamplingParams

REQUEST_LOG = "tandem.requests"  # a line per request with --enable-log-requests
request_log = logging.getLogger(REQUEST_LOG)


@dataclass(frozen=True)
class ApiFields:
    """What one API adds to the shared fields, in the planner's terms."""

    prompt: str | Sequence[str | int | list[int]]  # any completions form; chat: its ids
    max_tokens: int | None  # None: what is left of the context
    logprobs: int | None  # top alternatives the engine sends per token; None: no logprobs
    echo: bool = False
    return_tokens_as_token_ids: bool = False
    # The processor writes completions-style logprob entries (token strings, top dicts, text
    # offsets); chat shapes its own from the released tokens, so it skips that work.
    logprob_entries: bool = True
    # A constraint the API derives itself (chat: from its tools); the request's own
    # response_format / structured_outputs are then refused by the API.
    constraint: Constraint | None = None
    # Chat with a reasoning parser: how the choices split into reasoning and content, and where
    # a constrained output's thinking ends for the engine (its grammar starts after it).
    reasoning: ReasoningPlan | None = None


@dataclass(frozen=True)
class SamplingPlan:
    """The shared fields, checked and converted: engine parameters that every choice shares (its
    budget and seed aside), output options, and what a budget is computed from."""

    params: SamplingParams
    options: OutputOptions
    max_tokens: int | None
    min_tokens: int
    seed: int | None
    constraint_param: str | None = None  # the field that constrains the output, if any

    def params_for(self, max_tokens: int, sample: int) -> SamplingParams:
        """Engine parameters for sample `sample` of a prompt; samples get distinct seeds."""
        seed = None if self.seed is None else self.seed + sample
        return msgspec.structs.replace(self.params, max_tokens=max_tokens, seed=seed)

    def budget(self, prompt_len: int, max_model_len: int) -> int:
        """The completion budget: max_tokens, or what is left of the context when it is omitted
        (as vLLM does). Too long a request is a 400 in vLLM's words, naming both lengths."""
        limit = max_model_len
        if self.max_tokens is None:
            if prompt_len >= limit:
                raise bad_request(
                    f"This model's maximum context length is {limit} tokens. However, your "
                    f"request has {prompt_len} input tokens. Please reduce the length of the "
                    "input messages.",
                    "prompt",
                )
            if self.min_tokens > limit - prompt_len:
                raise bad_request(
                    f"min_tokens ({self.min_tokens}) must not exceed the {limit - prompt_len} "
                    f"tokens left in the context after the prompt ({prompt_len} of {limit} "
                    "tokens).",
                    "min_tokens",
                )
            return limit - prompt_len
        if prompt_len + self.max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + self.max_tokens} tokens ({prompt_len} in the messages, "
                f"{self.max_tokens} in the completion). Please reduce the length of the "
                "messages or completion.",
                "max_tokens",
            )
        return self.max_tokens


@dataclass
class ChoiceState:
    """One choice: its engine request and the processor that turns its steps into deltas."""

    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    processor: ChoiceProcessor
    started: bool = False  # the prompt delta was taken (at the choice's first engine step)

    def usage(self) -> Usage:
        return Usage.of(len(self.prompt_ids), self.processor.num_generated_tokens)


@dataclass
class RequestPlan:
    """A planned request: its id, its prompts and one ChoiceState per choice."""

    id: str
    model: str
    prompts: list[list[int]]
    # The field that constrains the output: the engine's refusal of its grammar is a 400 on it.
    constraint_param: str | None = None
    reasoning: ReasoningPlan | None = None  # ApiFields.reasoning
    choices: list[ChoiceState] = field(default_factory=list)
    created: int = field(default_factory=lambda: int(time.time()))

    def usage(self) -> Usage:
        generated = sum(c.processor.num_generated_tokens for c in self.choices)
        return Usage.of(sum(len(p) for p in self.prompts), generated)


def plan_request(
    req: SamplingRequest, api: ApiFields, served: ServedModel, id_prefix: str
) -> RequestPlan:
    """Check, convert and tokenize `req`, and build every choice; raises a 4xx OpenAIError."""
    sampling = read_sampling(req, api, served)
    prompts = [served.prompt_ids(p) for p in split_prompts(api.prompt)]
    budgets = [sampling.budget(len(p), served.max_model_len) for p in prompts]
    plan = RequestPlan(f"{id_prefix}-{uuid.uuid4().hex}", sampling.params.lora or served.name,
                       prompts,
                       constraint_param=sampling.constraint_param, reasoning=api.reasoning)
    for i, (prompt, budget) in enumerate(zip(prompts, budgets)):
        for j in range(req.n):
            index = i * req.n + j
            params = sampling.params_for(budget, j)
            processor = ChoiceProcessor(
                served.tokenizer, prompt, sampling.options, served.token_text, served.pieces
            )
            plan.choices.append(ChoiceState(index, f"{plan.id}-{index}", prompt, params, processor))
    if request_log.isEnabledFor(logging.INFO):  # --enable-log-requests
        request_log.info("request %s: %d choice(s), prompt tokens %s, params %s", plan.id,
                         len(plan.choices), [len(p) for p in prompts], sampling.params)
    return plan


def read_sampling(req: SamplingRequest, api: ApiFields, served: ServedModel) -> SamplingPlan:
    """The shared fields checked (alone, together, against the model) and converted."""
    check_lengths(req, api)
    stop = stop_strings(req.stop)
    logit_bias = parse_logit_bias(req.logit_bias)
    lora = served.adapter_of(req.model)
    served.check_ids(list(logit_bias or ()), "logit_bias")
    stop_token_ids = list(req.stop_token_ids or [])
    served.check_ids(stop_token_ids, "stop_token_ids")
    constraint = api.constraint or read_constraint(req.response_format, req.structured_outputs)
    if constraint is not None and req.min_tokens:
        raise bad_request("min_tokens cannot be combined with structured outputs: the grammar "
                          "decides where the output may end", "min_tokens")
    params = SamplingParams(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=logit_bias,
        min_tokens=req.min_tokens,
        stop_token_ids=stop_token_ids,
        ignore_eos=req.ignore_eos,
        logprobs=api.logprobs,
        prompt_logprobs=api.logprobs if api.echo else None,
        structured=None if constraint is None else constraint.output,
        reasoning_end=list(api.reasoning.engine_end) if api.reasoning and constraint else [],
        lora=lora,
    )
    options = OutputOptions(
        echo=api.echo,
        logprobs=api.logprobs if api.logprob_entries else None,
        stop=stop,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        return_tokens_as_token_ids=api.return_tokens_as_token_ids,
        # chat's logprobs are built from the generated tokens, completions' from the entries;
        # a reasoning answer counts its thinking's tokens (the Responses API's usage)
        generated_tokens=(api.logprobs is not None and not api.logprob_entries
                          or api.reasoning is not None),
    )
    return SamplingPlan(params, options, api.max_tokens, req.min_tokens, req.seed,
                        None if constraint is None else constraint.param)


def check_lengths(req: SamplingRequest, api: ApiFields) -> None:
    """Streaming options need a stream; a prompt-only request needs echo; min within max."""
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options can only be set when stream is true", "stream_options")
    if api.max_tokens == 0 and not api.echo:
        raise bad_request(
            "max_tokens must be at least 1 (0 is only allowed with echo=true)", "max_tokens"
        )
    if api.max_tokens is not None and req.min_tokens > api.max_tokens:
        raise bad_request(
            f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({api.max_tokens})",
            "min_tokens",
        )


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    """The stop strings as a tuple, checked: at most MAX_STOP_STRINGS, none empty."""
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop strings are allowed", "stop")
    if any(s == "" for s in stops):
        raise bad_request("stop strings must not be empty", "stop")
    return stops


def parse_logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """Keys are token ids written as strings; values are clamped to [-100, 100] like OpenAI."""
    if not bias:
        return None
    parsed: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(
                f"logit_bias keys must be token ids, got {key!r}", "logit_bias"
            ) from None
        parsed[token_id] = min(100.0, max(-100.0, value))
    return parsed
