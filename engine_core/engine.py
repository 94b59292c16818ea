"""EngineCore: requests in, one step at a time, columnar outputs out. No I/O here.

`step()` is the pipeline: schedule -> run the model -> sample -> update request states.
The process wrapper (engine_core/process.py) feeds it from sockets; tests and the benchmark
drive it in-process.
"""

from __future__ import annotations

import itertools
import logging
from typing import NamedTuple

import msgspec
import numpy as np
import torch

from engine_core.block_manager import BlockManager
from engine_core.config import EngineConfig
from engine_core.model_runner import ModelRunner
from engine_core.outputs import Row, group_by_owner
from engine_core.request import Request
from engine_core.sampler import Sampler, token_logprobs
from engine_core.scheduler import Scheduled, Scheduler, SchedulerOutput
from shared.messages import (
    MAX_LOGPROBS,
    EngineStats,
    Finished,
    FinishReason,
    SamplingParams,
    StepOutputs,
)
from shared.step_outputs import Logprobs

log = logging.getLogger(__name__)
PROMPT_LOGITS_ROWS = 64  # prompt positions per LM-head scan: 1.47 ms a row at 64, 1.78 at 32


def step_budget(config: EngineConfig, device: torch.device) -> tuple[int, int | None]:
    """(max, adaptive floor) of the tokens per step. --max-num-batched-tokens fixes the budget.
    By default a GPU gets vLLM's chunked-prefill 2048. A CPU, where a prefill step costs ~60 us
    a token (tiny model, 2 cores), gets a budget that follows the queue (Scheduler): a quarter
    of the waiting prompt tokens, between 512 and 2048. Measured cold (fresh prompts), 64 x
    (128 + 64), TTFT p50: concurrency 16, fixed 2048: 129/147 ms, fixed 512: 92/84, adaptive:
    85-101 (fixed 512 in the same runs: 78-93); concurrency 64, fixed 2048: 460/416 ms, fixed
    512: 570-702, adaptive: 459-547. Throughput is within noise of either."""
    if config.max_num_batched_tokens:
        return config.max_num_batched_tokens, None
    return (2048, None) if device.type == "cuda" else (2048, 512)


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.facts = self.runner.facts
        self.max_model_len = self.facts.max_model_len
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size,
                                   config.enable_prefix_caching)
        budget, floor = step_budget(config, self.runner.device)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, budget,
                                   min_num_batched_tokens=floor)
        self.sampler = Sampler(self.facts.eos_token_ids, config.seed)
        self.requests: dict[str, Request] = {}
        self._refused: list[Row] = []
        self._arrivals = itertools.count()
        self.counts = EngineStats()  # the counters; stats() adds the gauges

    # -- requests in ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    owner: bytes = b"") -> None:
        error = self._admission_error(request_id, prompt_token_ids, params)
        reason = FinishReason.ERROR
        if error is None and len(self.scheduler.waiting) >= self.config.max_waiting_requests:
            reason, error = FinishReason.OVERLOADED, (
                f"the server is overloaded: {len(self.scheduler.waiting)} requests are already "
                f"waiting (--max-waiting-requests {self.config.max_waiting_requests})")
        if error is not None:
            log.log(logging.DEBUG if reason is FinishReason.OVERLOADED else logging.INFO,
                    "refused %s: %s", request_id, error)
            _count(self.counts.rejected, reason)
            self._refused.append(Row(request_id, owner, finish=Finished(0, reason, message=error)))
            return
        req = Request(request_id, prompt_token_ids, params, owner, next(self._arrivals))
        self.requests[request_id] = req
        self.scheduler.add(req)

    def _admission_error(self, request_id: str, prompt: list[int], params: SamplingParams) -> str | None:
        if request_id in self.requests:
            return f"request id {request_id!r} is already running"
        if not prompt:
            return "the prompt is empty"
        if any(t < 0 or t >= self.facts.vocab_size for t in prompt):
            return f"prompt token ids must be in [0, {self.facts.vocab_size})"
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                return f"{name} must be between 0 and {MAX_LOGPROBS}"
        need = len(prompt) + (1 if params.max_tokens > 0 else 0)
        if need > self.max_model_len:
            return (f"the prompt has {len(prompt)} tokens; this model's maximum context length "
                    f"is {self.max_model_len} tokens")
        longest = min(len(prompt) + params.max_tokens, self.max_model_len)
        if self.blocks.blocks_needed(longest) > self.blocks.num_blocks:
            return (f"the request needs up to {longest} tokens of KV cache but the whole cache "
                    f"holds {self.blocks.num_blocks * self.blocks.block_size}")
        return None

    def abort(self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT) -> None:
        """Drop these requests; `reason` "stop" when the frontend stopped them (stop string)."""
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is not None:
                self.scheduler.remove(req)
                _count(self.counts.finished, reason)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._refused)

    # -- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> dict[bytes, StepOutputs]:
        """Run one step; return the news for each frontend (by owner identity)."""
        rows, self._refused = self._refused, []
        self.counts.steps += 1
        sched = self.scheduler.schedule()
        if sched.scheduled:
            rows += self._execute(sched)
        outputs = group_by_owner(rows) if rows else {}
        self.counts.output_messages += len(outputs)
        self.counts.output_rows += len(rows)
        return outputs

    def _execute(self, sched: SchedulerOutput) -> list[Row]:
        plan = _plan_rows(sched.scheduled)
        hidden = self.runner.execute(sched, plan.keep)
        samplers = [s.request for s in sched.scheduled if s.samples]
        sampled = None
        if samplers:
            sampled = self.sampler(self.runner.head, hidden[plan.num_prompt_rows:], samplers)
        prompt_lps = self._prompt_logprobs(sched.scheduled, plan, hidden)
        rows: list[Row] = []
        for s in sched.scheduled:
            s.request.num_computed_tokens += s.num_new
            self.scheduler.publish_computed_blocks(s.request)
            if s.completes_prefill and s.request.num_output_tokens == 0:  # once, as vLLM counts
                self.counts.request_prompt_tokens += s.request.num_prompt_tokens
            self.counts.prompt_tokens += max(0, min(s.start + s.num_new, s.request.num_prompt_tokens) - s.start)
        if sampled is not None:
            rows += self._accept_samples(samplers, sampled.token_ids, sampled.logprob_rows, sampled.logprobs)
        for s in sched.scheduled:
            req = s.request
            if s.completes_prefill and req.prefill_only:
                rows.append(self._finish(Row(req.request_id, req.owner), req, FinishReason.LENGTH))
        rows = _merge_prompt_logprobs(rows, prompt_lps)
        return rows

    def _accept_samples(self, reqs: list[Request], tokens: np.ndarray, lp_rows: np.ndarray,
                        lps: Logprobs | None) -> list[Row]:
        lp_at = {int(r): j for j, r in enumerate(lp_rows)}
        rows = []
        for i, req in enumerate(reqs):
            token = int(tokens[i])
            req.append_token(token)
            self.counts.generation_tokens += 1
            row = Row(req.request_id, req.owner, token)
            j = lp_at.get(i)
            if j is not None and lps is not None:
                k = req.params.logprobs or 0
                row.logprobs = Logprobs(lps.logprobs[j:j + 1], lps.ranks[j:j + 1],
                                           lps.top_ids[j:j + 1, :k], lps.top_logprobs[j:j + 1, :k])
            reason, stop_token = self._stop_reason(req, token)
            if reason is not None:
                self._finish(row, req, reason, stop_token)
            rows.append(row)
        return rows

    def _stop_reason(self, req: Request, token: int) -> tuple[FinishReason | None, int | None]:
        p = req.params
        if req.num_output_tokens > p.min_tokens:  # earlier stop tokens were masked out
            if token in p.stop_token_ids:
                return FinishReason.STOP, token
            if not p.ignore_eos and token in self.facts.eos_token_ids:
                return FinishReason.STOP, None
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def _finish(self, row: Row, req: Request, reason: FinishReason,
                stop_token: int | None = None) -> Row:
        row.finish = Finished(0, reason, stop_token)
        self.scheduler.remove(req)
        self.requests.pop(req.request_id, None)
        _count(self.counts.finished, reason)
        return row

    def _prompt_logprobs(self, scheduled: list[Scheduled], plan: _RowPlan,
                         hidden: torch.Tensor) -> dict[str, Logprobs]:
        """Accumulate prompt logprobs per chunk; return the complete ones of this step.

        The LM head runs over at most PROMPT_LOGITS_ROWS positions at a time, so a long echoed
        prompt never materialises a [prompt_len, vocab] logits tensor at once.
        """
        done: dict[str, Logprobs] = {}
        for s, (lo, hi) in zip(scheduled, plan.prompt_rows):
            req = s.request
            if req.prompt_logprobs_done:
                continue
            k = req.params.prompt_logprobs or 0
            for a in range(lo, hi, PROMPT_LOGITS_ROWS):
                b = min(hi, a + PROMPT_LOGITS_ROWS)
                first = s.start + 1 + a - lo  # logits at position p score prompt token p + 1
                targets = torch.tensor(req.prompt_token_ids[first:first + b - a])
                req.prompt_logprob_chunks.append(token_logprobs(self.runner.head, hidden[a:b], targets, k))
            if s.start + s.num_new >= req.num_prompt_tokens:
                done[req.request_id] = Logprobs.concat(req.prompt_logprob_chunks, req.params.prompt_logprobs or 0)
                req.prompt_logprob_chunks = []
                req.prompt_logprobs_done = True
        return done

    # -- introspection ----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return msgspec.structs.replace(
            self.counts,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            num_requests=len(self.requests),
            num_blocks=self.blocks.num_blocks,
            free_blocks=self.blocks.num_free_blocks,
            prefix_queries=self.blocks.stats.queries,
            prefix_hits=self.blocks.stats.hits,
            preemptions=self.scheduler.num_preemptions,
            chunked_prefills=self.scheduler.num_chunked_prefills,
            finished=dict(self.counts.finished),
            rejected=dict(self.counts.rejected),
        )


def _count(counts: dict[FinishReason, int], reason: FinishReason) -> None:
    counts[reason] = counts.get(reason, 0) + 1


class _RowPlan(NamedTuple):
    """Which rows of the packed batch need hidden states: every prompt-logprob row first (per
    scheduled item, [lo, hi) in `prompt_rows`), then one row per sampling request, in order."""

    keep: np.ndarray
    prompt_rows: list[tuple[int, int]]
    num_prompt_rows: int


def _plan_rows(scheduled: list[Scheduled]) -> _RowPlan:
    prompt_keep: list[int] = []
    sample_keep: list[int] = []
    prompt_rows = []
    offset = 0
    for s in scheduled:
        req = s.request
        lo = len(prompt_keep)
        if not req.prompt_logprobs_done:
            end = min(s.start + s.num_new, req.num_prompt_tokens - 1)
            prompt_keep.extend(range(offset, offset + max(0, end - s.start)))
        prompt_rows.append((lo, len(prompt_keep)))
        if s.samples:
            sample_keep.append(offset + s.num_new - 1)
        offset += s.num_new
    keep = np.asarray(prompt_keep + sample_keep, dtype=np.int64)
    return _RowPlan(keep, prompt_rows, len(prompt_keep))


def _merge_prompt_logprobs(rows: list[Row], done: dict[str, Logprobs]) -> list[Row]:
    if not done:
        return rows
    by_id = {r.request_id: r for r in rows}
    for rid, lps in done.items():
        row = by_id.get(rid)
        if row is None:
            continue  # cannot happen: a prompt completes on a step that samples or finishes it
        row.prompt_logprobs = lps
    return rows
