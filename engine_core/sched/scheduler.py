"""Continuous batching under a token budget, with chunked prefill and preemption.

Each step: running requests first (oldest first: decodes and unfinished prefill chunks), then
waiting ones while budget and `max_num_seqs` allow. A prompt longer than the remaining budget
is split into chunks across steps, so one long prompt never stalls running decodes. When KV
blocks run out, the newest running request is preempted: its blocks are freed and it goes
back to the front of the queue, to be recomputed (prompt + outputs so far) later.

The engine records a step in two halves: `advance` once it is queued (computed tokens, blocks
for the prefix cache, with overlapped steps a placeholder for each token it samples), then
`resolve` once its sampled tokens are on the host (each appended, the stop rules of
stop_rules.py applied, finished requests ended). `update_from_output` runs both at once: the
tests' shorthand for a step.

Constrained requests (structured outputs): `add` starts compiling the request's grammar
(engine_core/structured/grammar.py, on a worker thread); the request waits, and others pass it,
until the grammar is ready. A grammar that fails refuses its request (`take_refused`). The sampler
advances the request's matcher with each token; a request whose grammar ended stops ("stop")
whatever its stop tokens say. A request that thinks first (`SamplingParams.reasoning_end`, sent
by a frontend with a reasoning parser) is not masked until its output ends with the end of its
thinking (`Request.masked`); its grammar starts at the token after it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from engine_core.sched.block_manager import BlockManager, chain_hashes
from engine_core.sched.request import Request, Status
from engine_core.sched.stop_rules import Stop, StopRules
from engine_core.structured.grammar import GrammarCompiler
from shared.messages import FinishReason

# (a request's adapter name or None, the slots running requests hold) -> its slot, or None
LoRAAdmit = Callable[[str | None, list[int]], int | None]

log = logging.getLogger(__name__)

PROMPT_LOGPROB_ROWS = 256  # default budget of prompt positions scored per step (see Scheduler)


class Scheduled:
    """One request's share of a step. What the step does for it is settled when it is
    scheduled (the request's tokens may grow before the step's outputs are recorded)."""

    __slots__ = ("request", "start", "num_new", "completes_prefill", "samples",
                 "completes_prompt", "drafts")

    def __init__(self, request: Request, start: int, num_new: int,
                 drafts: tuple[int, ...] = ()) -> None:
        self.request = request
        self.start = start  # first position computed this step
        self.num_new = num_new  # tokens computed this step (its drafts' among them)
        # draft tokens verified after the request's last token (speculative decoding): the
        # step computes that token and them, and samples one token more than it accepts
        self.drafts = drafts
        end = start + num_new - len(drafts)
        # it computes the request's last known token / samples one / completes the prompt
        self.completes_prefill = end == len(request.all_token_ids)
        self.samples = self.completes_prefill and request.params.max_tokens > 0
        self.completes_prompt = end >= len(request.prompt_token_ids)

    @classmethod
    def decode(cls, request: Request, start: int) -> Scheduled:
        """A plain decode's share (see SchedulerOutput)."""
        s = cls.__new__(cls)
        s.request, s.start, s.num_new, s.drafts = request, start, 1, ()
        s.completes_prefill = s.samples = s.completes_prompt = True
        return s

    def __repr__(self) -> str:
        return (f"Scheduled({self.request.request_id!r}, {self.start}, {self.num_new}"
                + (f", drafts={self.drafts})" if self.drafts else ")"))


class SchedulerOutput:
    """A step's schedule, in columns: item i computes `num_new[i]` tokens of `requests[i]`
    from position `starts[i]`, in this order.

    At a large batch nearly every item is a plain decode: the request's one token past its
    prompt (its prompt done and scored, if asked), whose token the step samples. Nothing
    about it needs more than these columns. Every other item (a prefill chunk, a recomputed
    request, a prompt scored or prompt-only) is also in `special`, by index, as the
    `Scheduled` that settles its flags; `scheduled` gives every item as one."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.starts: list[int] = []
        self.num_new: list[int] = []
        self.special: dict[int, Scheduled] = {}
        self.preempted: list[Request] = []
        self.num_tokens = 0  # tokens computed by the step, all scheduled requests together
        self.num_drafts = 0  # draft tokens among them (speculative decoding)
        # tokens each sampler appended (`Scheduler.resolve` sets it; 0 for a finished one)
        self.appended: np.ndarray | None = None
        self._samplers: list[Request] | None = None
        self._columns: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    @staticmethod
    def of(scheduled: Sequence[Scheduled]) -> SchedulerOutput:
        """A schedule of these items (each kept as special: correct for any item)."""
        out = SchedulerOutput()
        for s in scheduled:
            out.add(s)
        out.num_tokens = sum(s.num_new for s in scheduled)
        return out

    def add(self, s: Scheduled) -> None:
        self.special[len(self.requests)] = s
        self.requests.append(s.request)
        self.starts.append(s.start)
        self.num_new.append(s.num_new)

    @property
    def scheduled(self) -> list[Scheduled]:
        special = self.special
        return [special.get(i) or Scheduled.decode(r, start)
                for i, (r, start) in enumerate(zip(self.requests, self.starts))]

    def samplers(self) -> list[Request]:
        """The requests that sample a token this step, in order (one row each for the
        sampler)."""
        if self._samplers is None:
            special = self.special
            self._samplers = (list(self.requests) if not special else
                              [r for i, r in enumerate(self.requests)
                               if i not in special or special[i].samples])
        return self._samplers

    def columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`starts` and `num_new` as int64 arrays, and which items sample (bool)."""
        if self._columns is None:
            samples = np.ones(len(self.requests), dtype=bool)
            for i, s in self.special.items():
                samples[i] = s.samples
            self._columns = (np.array(self.starts, dtype=np.int64),
                             np.array(self.num_new, dtype=np.int64), samples)
        return self._columns

    def draft_counts(self) -> np.ndarray:
        """Each sampler's draft tokens (int64, zeros without speculation)."""
        counts = np.zeros(len(self.samplers()), dtype=np.int64)
        if self.num_drafts:
            row = 0
            for i, req in enumerate(self.requests):
                s = self.special.get(i)
                if s is None or s.samples:
                    if s is not None and s.drafts:
                        counts[row] = len(s.drafts)
                    row += 1
        return counts

    @property
    def scores_prompts(self) -> bool:
        """Whether an item's prompt positions are scored (prompt logprobs) this step."""
        return any(not s.request.prompt_logprobs_done for s in self.special.values())

    @property
    def pools(self) -> bool:
        """Whether an item is a pooling request's prompt chunk (engine_core/sample/pooling.py)."""
        return any(s.request.params.pooling is not None for s in self.special.values())

    def prompts_done(self) -> list[Request]:
        """The prompt-only requests whose prompt this step completes."""
        return [s.request for s in self.special.values()
                if s.completes_prefill and s.request.prefill_only]


@dataclass
class SchedulerStats:
    """Counters of request progress since start-up (EngineStats' fields of the same names)."""

    request_prompt_tokens: int = 0  # prompt tokens of requests whose prefill completed
    prompt_tokens: int = 0  # prompt tokens computed (recomputation after preemption included)
    generation_tokens: int = 0  # tokens sampled
    finished: dict[FinishReason, int] = field(default_factory=dict)  # requests, by reason

    def count_finished(self, reason: FinishReason) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_prompt_logprob_rows: int | None = None,
                 min_num_batched_tokens: int | None = None, *, stop_rules: StopRules,
                 grammars: GrammarCompiler | None = None,
                 lora: LoRAAdmit | None = None) -> None:
        """With `min_num_batched_tokens` the step budget adapts: a quarter of the prompt tokens
        waiting to be computed, between that floor and `max_num_batched_tokens`. A burst of
        prompts is then cleared in about four steps (its median request has its first token
        after about two), while a trickle of arrivals gets small, quick steps. `stop_rules`
        decide when a request that sampled a token is done; `grammars` compiles the constraints
        of structured outputs (without it, a constrained request is refused). `lora` gives a
        request about to start the device slot of its adapter, or None when every slot is
        held by running requests' adapters: the request then waits and the ones behind it
        may start (engine_core/lora/manager.py)."""
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.min_num_batched_tokens = min_num_batched_tokens
        self.stop_rules = stop_rules
        self.grammars = grammars
        self.lora = lora
        self.compiling: list[Request] = []  # waiting requests whose grammar is not ready yet
        self.refused: list[tuple[Request, str]] = []  # taken by take_refused(), with the reason
        # Prompt positions that need logprobs each cost a full-vocabulary LM-head row (orders
        # of magnitude more than a decoder row on a small model), so they get a budget of their
        # own: prefills that score their prompt are spread over steps instead of stalling
        # everyone at once. How 256 was chosen: docs/benchmarks.md.
        self.max_prompt_logprob_rows = max_prompt_logprob_rows or max(
            1, min(PROMPT_LOGPROB_ROWS, max_num_batched_tokens // 2))
        self._rows_left = 0
        self.requests: dict[str, Request] = {}  # waiting and running, by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self.num_preemptions = 0
        self.num_chunked_prefills = 0  # steps that computed a prompt only in part

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.refused)

    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.stop_rules.watch(req)
        self.waiting.append(req)
        constraint = req.params.structured
        if constraint is not None:
            if self.grammars is None:
                self._refuse(req, "structured outputs are not available on this engine")
                return
            req.grammar = self.grammars.grammar_for(constraint)
            if not req.grammar.ready:
                self.compiling.append(req)
            elif req.grammar.error is not None:
                self._refuse(req, req.grammar.error)

    def take_refused(self) -> list[tuple[Request, str]]:
        """Requests refused since the last call (their grammar failed), with the reason."""
        refused, self.refused = self.refused, []
        return refused

    def wait_for_grammars(self, timeout_s: float) -> None:
        """With nothing to run, wait (up to `timeout_s`) for a grammar being compiled, rather
        than spin through empty steps."""
        grammar = self.compiling[0].grammar if self.compiling and not self.running else None
        if grammar is not None:
            grammar.wait(timeout_s)

    def _refuse(self, req: Request, reason: str) -> None:
        self.remove(req)
        self.refused.append((req, reason))

    def finish_requests(self, request_ids: Sequence[str], reason: FinishReason) -> None:
        """Finish these requests from outside (aborted, or stopped by the frontend); ids no
        longer here are ignored."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                self._finish(req, reason)

    def remove(self, req: Request) -> None:
        """Take a request out (finished or aborted) and free its blocks."""
        self.requests.pop(req.request_id, None)
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self.blocks.free(req.block_ids)
        req.block_ids = []
        req.status = Status.FINISHED
        req.grammar = None  # its matcher goes with it
        if req in self.compiling:
            self.compiling.remove(req)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self.remove(req)
        self.stats.count_finished(reason)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.compiling:
            self._take_compiled()
        self._rows_left = self.max_prompt_logprob_rows
        budget = self._schedule_running(out, self.step_budget())
        if not out.preempted:
            self._schedule_waiting(out, budget)
        self.num_chunked_prefills += sum(
            1 for s in out.special.values() if s.num_new > 1 and not s.completes_prefill)
        return out

    def step_budget(self) -> int:
        if self.min_num_batched_tokens is None:
            return self.max_num_batched_tokens
        backlog = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        backlog += sum(len(r.all_token_ids) - r.num_computed_tokens for r in self.running
                       if r.num_computed_tokens < len(r.prompt_token_ids))
        return max(self.min_num_batched_tokens, min(self.max_num_batched_tokens, backlog // 4))

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        block_size = self.blocks.block_size
        add_req, add_start, add_new = out.requests.append, out.starts.append, out.num_new.append
        special = out.special
        given = budget
        # (preemption takes requests off the end of the list only, never one before `req`)
        for req in self.running:
            if budget <= 0:
                break
            start = req.num_computed_tokens
            num_new = len(req.all_token_ids) - start
            # a plain decode (SchedulerOutput): its one token past a prompt done and scored
            plain = num_new == 1 and start >= len(req.prompt_token_ids) and \
                req.prompt_logprobs_done
            drafts: tuple[int, ...] = ()
            if plain and req.drafts:  # its drafts verified with its token, as budget allows
                drafts = tuple(req.drafts[:budget - 1])
                plain, num_new = not drafts, 1 + len(drafts)
            elif not plain:
                num_new = min(num_new, budget)
                if not req.prompt_logprobs_done:
                    num_new = min(num_new, self._rows_left)
            if num_new == 0 or (req.placeholder_row >= 0 and self.stop_rules.at_length(req)):
                continue  # nothing to compute, or a token in flight that ends it by length
            # (most decode steps fit in the blocks the request has: nothing to allocate)
            if start + num_new > len(req.block_ids) * block_size and \
                    not self._grow_or_preempt(req, num_new, out):
                break  # req itself was preempted: it was the newest, nothing after it
            if not plain:
                special[len(out.requests)] = Scheduled(req, start, num_new, drafts)
                out.num_drafts += len(drafts)
                if not req.prompt_logprobs_done:
                    self._rows_left -= num_new
            add_req(req)
            add_start(start)
            add_new(num_new)
            budget -= num_new
        out.num_tokens += given - budget
        return budget

    def _grow_or_preempt(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self._grow(req, req.num_computed_tokens + num_new):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _grow(self, req: Request, num_tokens: int) -> bool:
        need = self.blocks.blocks_needed(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        new = self.blocks.allocate(need)
        if new is None:
            return False
        req.block_ids.extend(new)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free(req.block_ids)
        req.reset_for_recompute()
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _take_compiled(self) -> None:
        """Requests whose grammar is ready may be scheduled now; failed ones are refused."""
        for req in [r for r in self.compiling if r.grammar is None or r.grammar.ready]:
            self.compiling.remove(req)
            error = req.grammar.error if req.grammar is not None else None
            if error is not None:
                self._refuse(req, error)

    def _next_waiting(self, passed: set[int]) -> Request | None:
        """The oldest waiting request that can run: one still compiling its grammar is passed,
        and so is one in `passed` (ids: its adapter has no slot this step)."""
        if not self.compiling and not passed:
            return self.waiting[0] if self.waiting else None
        return next((r for r in self.waiting
                     if r not in self.compiling and id(r) not in passed), None)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        passed: set[int] = set()
        while budget > 0 and len(self.running) < self.max_num_seqs:
            req = self._next_waiting(passed)
            if req is None:
                break
            if self.lora is not None:
                slot = self.lora(req.params.lora, [r.lora_slot for r in self.running])
                if slot is None:
                    passed.add(id(req))
                    continue
                req.lora_slot = slot
            hits = self._prefix_hits(req)
            num_computed = len(hits) * self.blocks.block_size
            num_new = self._cap_rows(req, min(req.num_tokens - num_computed, budget))
            if num_new == 0:
                break
            self.blocks.acquire(hits)
            need = self.blocks.blocks_needed(num_computed + num_new) - len(hits)
            fresh = self.blocks.allocate(need)
            if fresh is None:
                self.blocks.free(hits)
                break
            self.waiting.remove(req)
            self.blocks.stats.queries += req.num_tokens
            self.blocks.stats.hits += num_computed
            req.block_ids = hits + fresh
            req.num_computed_tokens = num_computed
            req.num_published_blocks = len(hits)
            req.status = Status.RUNNING
            self.running.append(req)
            out.add(Scheduled(req, num_computed, num_new))
            out.num_tokens += num_new
            self._take_rows(req, num_new)
            budget -= num_new

    def _cap_rows(self, req: Request, num_new: int) -> int:
        return num_new if req.prompt_logprobs_done else min(num_new, self._rows_left)

    def _take_rows(self, req: Request, num_new: int) -> None:
        if not req.prompt_logprobs_done:
            self._rows_left -= num_new

    def _prefix_hits(self, req: Request) -> list[int]:
        # Prompt logprobs need logits at every prompt position, so such prompts are computed
        # whole; so are those pooled over every position.
        if (not self.blocks.enable_prefix_caching or not req.prompt_logprobs_done
                or req.pools_every_position):
            return []
        req.block_hashes = chain_hashes(req.all_token_ids, self.blocks.block_size,
                                        req.block_hashes, req.hash_root)
        return self.blocks.lookup_prefix(req.all_token_ids, req.block_hashes, req.hash_root)

    # -- after the step ---------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput,
                           sampled_token_ids: np.ndarray | Sequence[int]) -> dict[str, Stop]:
        """Record what the step computed (`advance` then `resolve`, as tests drive a step):
        `out` as `schedule()` returned it, and one sampled token per request of
        `out.samplers()`, in that order. Returns the requests finished by it, by id: those that
        sampled, in order, then prompt-only ones ("length")."""
        self.advance(out)
        return self.resolve(out, sampled_token_ids)

    # Overlapped steps (--async-scheduling) record a step in two halves: `advance` as soon as
    # it is queued, with a placeholder for each token it samples (so the next step can be
    # scheduled while it runs), and `resolve` once its tokens are on the host. A request
    # finished or aborted in between is left alone by both.
    def advance(self, out: SchedulerOutput, placeholders: bool = False) -> None:
        """The step's progress: computed tokens, published prefix blocks; with
        `placeholders`, a placeholder token (its row in the step's samples) for each sampler."""
        finished, block_size, stats = Status.FINISHED, self.blocks.block_size, self.stats
        caching, special = self.blocks.enable_prefix_caching, out.special
        rows = None  # each item's row in the step's samples, where not simply its index
        if placeholders and special:
            samples = out.columns()[2]
            rows = (np.cumsum(samples) - 1).tolist()
        for i, req in enumerate(out.requests):
            if req.status is finished:
                continue
            s = special.get(i) if special else None
            if s is None:  # a plain decode
                req.num_computed_tokens += 1
                if caching and req.num_computed_tokens // block_size > req.num_published_blocks:
                    self.publish_computed_blocks(req)  # a block was filled
                if placeholders:
                    req.append_placeholder(i if rows is None else rows[i])
                continue
            if s.drafts:  # what it computed is known once its drafts are accepted: `resolve`
                continue
            req.num_computed_tokens += s.num_new
            if caching and req.num_computed_tokens // block_size > req.num_published_blocks:
                self.publish_computed_blocks(req)
            if s.completes_prompt:
                req.prompt_logprobs_done = True  # scored by the engine on this step, if asked
            prompt_len = len(req.prompt_token_ids)
            if s.completes_prefill and not req.output_token_ids:  # once, as vLLM counts
                stats.request_prompt_tokens += prompt_len
            if s.start < prompt_len:
                stats.prompt_tokens += min(s.start + s.num_new, prompt_len) - s.start
            if placeholders and s.samples:
                assert rows is not None
                req.append_placeholder(rows[i])

    def resolve(self, out: SchedulerOutput, sampled_token_ids: np.ndarray | Sequence[int],
                counts: np.ndarray | None = None) -> dict[str, Stop]:
        """The step's sampled tokens (one per `out.samplers()`, or `counts[i]` for sampler i:
        a request that verified drafts emits its accepted ones and one more) appended, or put
        in their placeholders, and the stop rules applied after each; see
        `update_from_output`. `out.appended` says how many each sampler kept."""
        if counts is not None and bool((counts != 1).any()):
            return self._resolve_runs(out, sampled_token_ids, counts)
        finished: dict[str, Stop] = {}
        tokens = np.asarray(sampled_token_ids).tolist()  # Python ints, once
        samplers = out.samplers()
        if len(samplers) != len(tokens):
            raise ValueError(f"{len(tokens)} sampled tokens for {len(samplers)} sampling requests")
        appended = 0
        done = Status.FINISHED
        kept = np.ones(len(samplers), dtype=np.int64)
        for i, (req, token) in enumerate(zip(samplers, tokens)):
            if req.status is done:
                kept[i] = 0
                continue  # finished or aborted while its token was in flight
            appended += 1
            if req.grammar is not None:  # (and any request that thinks first)
                stop = self._append(req, token)
            else:  # Request.append_token / resolve_placeholder, then the stop rules
                outputs = req.output_token_ids
                if req.placeholder_row >= 0:
                    outputs[-1] = req.all_token_ids[-1] = token
                    req.placeholder_row = -1
                else:
                    outputs.append(token)
                    req.all_token_ids.append(token)
                if token not in req.stop_ids and len(outputs) < req.output_limit:
                    continue  # (StopRules.watch: nothing else can stop it now)
                stop = self.stop_rules.check(req, token)
                if stop is not None:
                    self._finish(req, stop.reason)
            if stop is not None:
                finished[req.request_id] = stop
        self.stats.generation_tokens += appended
        out.appended = kept
        self._finish_prompts(out, finished)
        return finished

    def _resolve_runs(self, out: SchedulerOutput, sampled_token_ids: np.ndarray | Sequence[int],
                      counts: np.ndarray) -> dict[str, Stop]:
        """`resolve` of a step that verified drafts: sampler i's `counts[i]` tokens appended in
        turn until one stops it (nothing after it is kept); a request that verified drafts
        has computed every token it now has but its newest one (its accepted drafts' KV is
        the step's), and its newly full blocks go to the prefix cache."""
        finished: dict[str, Stop] = {}
        tokens = np.asarray(sampled_token_ids).tolist()
        samplers = out.samplers()
        drafted = out.draft_counts() > 0
        if len(samplers) != len(counts) or int(counts.sum()) != len(tokens):
            raise ValueError(f"{len(tokens)} sampled tokens in {len(counts)} runs for "
                             f"{len(samplers)} sampling requests")
        kept = np.zeros(len(samplers), dtype=np.int64)
        at = 0
        for i, (req, count) in enumerate(zip(samplers, counts.tolist())):
            run, at = tokens[at:at + count], at + count
            if req.status is Status.FINISHED:
                continue
            for j, token in enumerate(run):
                kept[i] += 1
                # a grammar (its fork of the run's last row, engine.py) has seen the whole run
                stop = self._append(req, token, grammar_stops=j == count - 1)
                if stop is not None:
                    finished[req.request_id] = stop
                    break
            if drafted[i] and req.status is not Status.FINISHED:
                req.num_computed_tokens = len(req.all_token_ids) - 1
                if self.blocks.enable_prefix_caching:
                    self.publish_computed_blocks(req)
        self.stats.generation_tokens += int(kept.sum())
        out.appended = kept
        self._finish_prompts(out, finished)
        return finished

    def _finish_prompts(self, out: SchedulerOutput, finished: dict[str, Stop]) -> None:
        """Prompt-only requests whose prompt the step completed end ("length")."""
        for req in out.prompts_done():
            if req.status is not Status.FINISHED:
                finished[req.request_id] = Stop(FinishReason.LENGTH)
                self._finish(req, FinishReason.LENGTH)

    def _append(self, req: Request, token: int, grammar_stops: bool = True) -> Stop | None:
        """Append a sampled token and apply the stop rules; and the grammar's, unless
        `grammar_stops` is False (a token inside a run of accepted drafts)."""
        masked = req.masked  # the grammar chose this token (a thinking request's did not)
        if req.placeholder_row >= 0:
            req.resolve_placeholder(token)
        else:
            req.append_token(token)
        stop = self.stop_rules.check(req, token)
        if masked and grammar_stops:
            stop = _grammar_stop(req, token, stop)
        if stop is not None:
            self._finish(req, stop.reason)
        return stop

    def publish_computed_blocks(self, req: Request) -> None:
        """Put the request's newly full, computed blocks into the prefix cache (its hash
        chain extended as far)."""
        if not self.blocks.enable_prefix_caching:
            return
        req.num_published_blocks = self.blocks.cache_full_blocks(
            req.block_ids, req.all_token_ids, req.block_hashes, req.num_computed_tokens,
            req.num_published_blocks, req.hash_root,
            None if req.lora_id is None else (req.lora_id, req.params.lora or ""))


def _grammar_stop(req: Request, token: int, stop: Stop | None) -> Stop | None:
    """The grammar's end is a stop (its matcher, advanced by the sampler, has seen `token`);
    a request whose sampler found no token the grammar accepts ends rather than go on
    outside its grammar."""
    assert req.grammar is not None
    if req.grammar.lost:
        log.error("request %s: token %d is outside its grammar", req.request_id, token)
        return Stop(FinishReason.ABORT)
    if req.grammar.terminated and (stop is None or stop.reason is not FinishReason.STOP):
        return Stop(FinishReason.STOP)
    return stop
