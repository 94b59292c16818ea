"""When a request is done: the engine's stop rules, as one pure check after each new token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from engine_core.sched.request import Request
from shared.messages import FinishReason


class Stop(NamedTuple):
    """Why a request finished; `stop_token_id` when one of its stop_token_ids ended it."""

    reason: FinishReason
    stop_token_id: int | None = None


@dataclass(frozen=True)
class StopRules:
    """The model's EOS ids and context length, with which each request's params decide."""

    eos_token_ids: frozenset[int]
    max_model_len: int

    def check(self, req: Request, token: int) -> Stop | None:
        """Whether `req` is done now that `token`, already appended, is its newest."""
        p = req.params
        outputs = len(req.output_token_ids)
        if outputs > p.min_tokens:  # earlier stop tokens were masked out
            if token in p.stop_token_ids:
                return Stop(FinishReason.STOP, token)
            if not p.ignore_eos and token in self.eos_token_ids:
                return Stop(FinishReason.STOP)
        if outputs >= p.max_tokens or len(req.all_token_ids) >= self.max_model_len:
            return Stop(FinishReason.LENGTH)
        return None

    def watch(self, req: Request) -> None:
        """Set what `check` can stop `req` on, for a quick test before it (`req.stop_ids`,
        `req.output_limit`): every id that may stop it, and the count of outputs at which its
        length does (max_tokens, or the context's end)."""
        p = req.params
        req.stop_ids = frozenset(p.stop_token_ids).union(() if p.ignore_eos
                                                         else self.eos_token_ids)
        req.output_limit = min(p.max_tokens, self.max_model_len - len(req.prompt_token_ids))

    def at_length(self, req: Request) -> bool:
        """Whether `req` has all the tokens it may have (max_tokens, or the context)."""
        return (len(req.output_token_ids) >= req.params.max_tokens
                or len(req.all_token_ids) >= self.max_model_len)
