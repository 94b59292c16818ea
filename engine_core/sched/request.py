"""The engine's view of one request: token ids, progress, blocks, sampling state."""

from __future__ import annotations

import enum

from engine_core.sample.batch_builder import RequestSampling
from engine_core.structured.grammar import RequestGrammar
from shared.block_hash import root_parent
from shared.messages import SamplingParams

PLACEHOLDER = -1  # the id of a token not known yet (Request.placeholder_row)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """Invariant: tokens [0, num_computed_tokens) have their KV in `block_ids`."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 owner: bytes = b"", arrival: int = 0) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.owner = owner
        self.arrival = arrival
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # hash chain over the full blocks of all_token_ids
        self.num_published_blocks = 0  # leading blocks already in the prefix cache
        self.status = Status.WAITING
        self.prompt_logprobs_done = params.prompt_logprobs is None  # (or scored already)
        # how it samples, read once from its params (the sampling batch's builder reads it)
        self.sampling = RequestSampling(params)
        self.grammar: RequestGrammar | None = None  # set by the scheduler when constrained
        # A constrained request that thinks first: its grammar masks nothing until the output
        # ends with params.reasoning_end (decided here, on token ids, as each token is appended).
        self.thinking = bool(params.reasoning_end) and params.structured is not None
        # >= 0 while the newest token is a placeholder (PLACEHOLDER): sampled by a step still
        # in flight (overlapped steps), at this row of that step's samples
        self.placeholder_row = -1
        # Read once here, so that a step's per-request work is a few attribute loads: what may
        # end it at a token (widened by the scheduler with the model's EOS ids and context,
        # `StopRules.watch`): a token among `stop_ids`, or `output_limit` outputs.
        self.stop_ids = frozenset(params.stop_token_ids)
        self.output_limit = params.max_tokens
        # speculative decoding: tokens proposed to follow its last one, verified with it by the
        # next step that schedules it (engine_core/spec/)
        self.drafts: list[int] = []
        # a draft model's K/V is in place below this position (engine_core/worker/drafter.py)
        self.draft_computed = 0
        # the device slot its LoRA adapter holds while it runs (-1: the base model), set when
        # the scheduler starts it (engine_core/lora/manager.py)
        self.lora_slot = -1
        self.hash_root = root_parent(params.lora)  # its prefix-cache chain's seed
        self.lora_id: int | None = None  # its adapter's stable id (KV events' lora_id)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def prefill_only(self) -> bool:
        return self.params.max_tokens == 0

    @property
    def pools_every_position(self) -> bool:
        """A pooling request that reads every prompt position ("mean", "cls"): computed
        whole, never from the prefix cache (engine_core/sample/pooling.py)."""
        pooling = self.params.pooling
        return pooling is not None and pooling.kind != "last"

    @property
    def masked(self) -> bool:
        """A grammar masks this request's next token: it is constrained and done thinking."""
        return self.grammar is not None and not self.thinking

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.thinking:
            self._check_thinking()

    def append_placeholder(self, row: int) -> None:
        """A token sampled by a step in flight, its value not on the host yet (the thinking
        gate waits for it: `resolve_placeholder`)."""
        self.output_token_ids.append(PLACEHOLDER)
        self.all_token_ids.append(PLACEHOLDER)
        self.placeholder_row = row

    def resolve_placeholder(self, token_id: int) -> None:
        self.output_token_ids[-1] = self.all_token_ids[-1] = token_id
        self.placeholder_row = -1
        if self.thinking:
            self._check_thinking()

    def _check_thinking(self) -> None:
        end = self.params.reasoning_end
        self.thinking = self.output_token_ids[-len(end):] != end

    def reset_for_recompute(self) -> None:
        """After preemption: KV is gone; prompt + outputs are recomputed as one prompt (the
        engine drops prompt logprobs scored in part, engine_core/sample/prompt_logprobs.py)."""
        self.num_computed_tokens = 0
        self.block_ids = []
        self.num_published_blocks = 0
        self.drafts = []
        self.draft_computed = 0
        self.status = Status.WAITING
