"""EngineCore: requests in, one step at a time, columnar outputs out. No I/O here.

`step()` is the pipeline: schedule -> run the model -> sample (the step's `SamplingBatch`, built
here from the requests that sample, is the sampler's only input) -> update request states (the
scheduler) -> pack outputs. The process wrapper (engine_core/process.py) feeds it from
sockets; tests and the benchmark drive it in-process.

Overlapped steps (--async-scheduling, as vLLM's): a step is queued on the device (`_launch`)
and recorded as scheduled at once, a placeholder for each token it samples (`_record`); its
outputs are taken (`_complete`) in the next call, after that call has queued its own step,
whose decodes read the placeholders' tokens on the device. So the host schedules and prepares
step N+1 while the device runs step N, and waits once a step, for step N's tokens. Everything
else is as without: a request finished or aborted in between has its extra token dropped; a
step whose next one needs its tokens on the host (a grammar's matcher, penalties over the
output, speculative decoding: a step that verifies drafts, or after which drafts may be
proposed) is completed before anything else is scheduled.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any, NamedTuple

import msgspec
import numpy as np
import torch

from engine_core.config import EngineConfig
from engine_core.lora.adapters import LoRAError
from engine_core.lora.manager import LoRAManager, LoRANotFoundError
from engine_core.outputs import StepNews
from engine_core.sample.batch_builder import build_sampling_batch
from engine_core.sample.device_sampler import DeviceSampler
from engine_core.sample.interface import PendingSample, SamplerOutput, TokenSampler
from engine_core.sample.pooling import (
    PoolChunk,
    Pooler,
    embedding_bytes,
    pool_positions,
    pooling_error,
)
from engine_core.sample.prompt_logprobs import PromptChunk, PromptLogprobsAccumulator
from engine_core.sample.sampler import Sampler
from engine_core.sample.sampling_batch import Drafts, SamplingBatch
from engine_core.sample.speculative import Accepted, accept, rewind
from engine_core.sched.block_manager import BlockManager
from engine_core.sched.request import PLACEHOLDER, Request, Status
from engine_core.sched.scheduler import Scheduler, SchedulerOutput
from engine_core.sched.stop_rules import Stop, StopRules
from engine_core.spec.depth import DraftDepth
from engine_core.spec.ngram import NgramProposer
from engine_core.structured.grammar import GrammarCompiler
from engine_core.validation import params_error, prompt_ids
from engine_core.worker.input_batch import StepRows
from engine_core.worker.model_runner import ModelRunner
from engine_core.worker.platform import Platform
from engine_core.worker.tensor_parallel import COLLECTIVE_TIMEOUT
from engine_core.worker.threads import ThreadPolicy
from shared.engine_args import LoRAModule
from shared.messages import (
    MAX_LOGPROBS,
    EngineStats,
    FinishReason,
    LoRACard,
    SamplingParams,
    StepOutputs,
)
from shared.step_outputs import Logprobs

log = logging.getLogger(__name__)

_GRAMMAR_WAIT_S = 0.005  # an idle step's wait for a compiling grammar: short, new input may come


class _Launched(NamedTuple):
    """A step queued on the device, not recorded as done yet."""

    sched: SchedulerOutput
    samplers: list[Request]
    batch: SamplingBatch  # what the sampler read, a row per request of `samplers`
    rows: StepRows  # where its requests are in the runner's block table
    sampled: PendingSample
    prompt_logprobs: dict[str, Logprobs]
    embeddings: dict[str, torch.Tensor]  # pooling prompts it completed, their vectors
    # the next step needs its tokens on the host (a grammar or penalties read them, it verified
    # drafts, or speculative decoding proposes from them): overlapped, it completes before
    # anything else is scheduled
    blocking: bool


class _Refusal(NamedTuple):
    request_id: str
    owner: bytes
    reason: FinishReason
    message: str


class EngineCore:
    def __init__(self, config: EngineConfig, platform: Platform | None = None) -> None:
        """`platform` defaults to `Platform.detect(config)`."""
        self.config = config
        self.platform = platform or Platform.detect(config)
        self.platform.apply()
        self.runner = ModelRunner(config, self.platform)
        # On a small box torch keeps one thread and a step's products are shared over the
        # linears' pool instead (linear.py): the policy then picks how many threads that uses.
        pool = self.runner.linear_pool
        set_threads = (pool.use if pool is not None and pool.workers > 1
                       else torch.set_num_threads)
        self.threads = ThreadPolicy(self.platform.thread_choices, set_threads=set_threads)
        self.facts = self.runner.facts
        self.max_model_len = self.facts.max_model_len
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size,
                                   config.enable_prefix_caching)
        stop_rules = StopRules(frozenset(self.facts.eos_token_ids), self.max_model_len)
        self.grammars = GrammarCompiler(config.tokenizer or config.model, self.facts.vocab_size,
                                        self.facts.eos_token_ids, config.trust_remote_code)
        lora = self.runner.lora
        self.loras = (None if lora is None else LoRAManager(
            config.lora_modules, lora, config.max_lora_rank,
            config.max_cpu_loras or config.max_loras, lora.num_layers, self.runner.dtype))
        self.scheduler = Scheduler(self.blocks, self.platform.max_num_seqs,
                                   self.platform.max_num_batched_tokens,
                                   min_num_batched_tokens=self.platform.min_num_batched_tokens,
                                   stop_rules=stop_rules, grammars=self.grammars,
                                   lora=None if self.loras is None else self.loras.admit)
        self.sampler: TokenSampler = (
            DeviceSampler(self.runner.head_weights, self.platform.host_link())
            if self.platform.device_sampling else Sampler(self.runner.head))
        self.generator = torch.Generator().manual_seed(config.seed)  # unseeded requests' draws
        self.prompt_logprobs = PromptLogprobsAccumulator()
        self.pooler = Pooler()
        self.async_scheduling = self.platform.async_scheduling
        self.proposer = _proposer(config)
        spec = config.speculative
        self.spec_max_batch = ((spec.disable_by_batch_size or self.platform.speculation_max_batch)
                               if spec else 0)
        self.draft_depth = DraftDepth(spec.num_speculative_tokens) if spec else None
        self._inflight: _Launched | None = None  # an overlapped step not completed yet
        self._said_blocking = False  # logged once: a step the next one must wait for
        self._refused: list[_Refusal] = []
        self._arrivals = itertools.count()
        self.counts = EngineStats()  # the engine's own counters; stats() adds the rest
        # why no step can run again (a tensor-parallel step failed: the ranks are out of step);
        # the process wrapper then stops the engine
        self.failed: str | None = None

    # -- requests in ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int] | bytes,
                    params: SamplingParams, owner: bytes = b"") -> None:
        """Queue a request, or refuse it with an error row (sent by `take_refusals`, else with
        the next step's outputs): wire input is checked here (engine_core/validation.py), never
        trusted. `prompt_token_ids` may be the int32 wire buffer itself."""
        prompt, error = prompt_ids(prompt_token_ids, self.facts.vocab_size)
        error = error or self._admission_error(request_id, prompt, params)
        reason = FinishReason.ERROR
        waiting = len(self.scheduler.waiting)
        if error is None and waiting >= self.config.max_waiting_requests:
            reason, error = FinishReason.OVERLOADED, (
                f"the server is overloaded: {waiting} requests are already waiting "
                f"(--max-waiting-requests {self.config.max_waiting_requests})")
        if error is not None:
            log.log(logging.DEBUG if reason is FinishReason.OVERLOADED else logging.INFO,
                    "refused %s: %s", request_id, error)
            self.counts.rejected[reason] = self.counts.rejected.get(reason, 0) + 1
            self._refused.append(_Refusal(request_id, owner, reason, error))
            return
        request = Request(request_id, prompt, params, owner, next(self._arrivals))
        if self.loras is not None:
            request.lora_id = self.loras.id_of(params.lora)
        self.scheduler.add(request)

    def _admission_error(self, request_id: str, prompt: list[int],
                         params: SamplingParams) -> str | None:
        if request_id in self.scheduler.requests:
            return f"request id {request_id!r} is already running"
        bad_params = params_error(params, self.facts.vocab_size,
                                  self.config.max_logprobs or MAX_LOGPROBS)
        bad_params = bad_params or pooling_error(params, self.facts.hidden_size,
                                                 self.facts.matryoshka_dimensions)
        if bad_params is not None:
            return bad_params
        if params.lora and (self.loras is None or not self.loras.knows(params.lora)):
            served = [] if self.loras is None else self.loras.served()
            return (f"The model `{params.lora}` does not exist (LoRA adapters: "
                    f"{', '.join(m.name for m in served) or 'none'})")
        if self.config.runner == "pooling" and params.pooling is None:
            return "this server serves embeddings only (--runner pooling)"
        need = len(prompt) + (1 if params.max_tokens > 0 else 0)
        if need > self.max_model_len:
            return (f"the prompt has {len(prompt)} tokens; this model's maximum context length "
                    f"is {self.max_model_len} tokens")
        longest = min(len(prompt) + params.max_tokens, self.max_model_len)
        if self.blocks.blocks_needed(longest) > self.blocks.num_blocks:
            return (f"the request needs up to {longest} tokens of KV cache but the whole cache "
                    f"holds {self.blocks.num_blocks * self.blocks.block_size}")
        return None

    # -- LoRA adapters at run time (/v1/load_lora_adapter, /v1/unload_lora_adapter) ---------
    def add_lora(self, card: LoRACard) -> None:
        """Serve one more adapter; raises LoRAError (LoRANotFoundError: no adapter there). A
        name served before leaves no cached blocks behind: the prefix cache is reset (its
        chains would start from the same root, with the old weights' KV)."""
        if self.loras is None:
            raise LoRAError("LoRA is not enabled: start the server with --enable-lora")
        module = LoRAModule(card.name, card.path, card.base_model_name)
        if self.loras.add(module):
            self.blocks.reset_prefix_cache()

    def remove_lora(self, name: str) -> None:
        """New requests may no longer name it; the requests in the engine that do finish with
        it, and its slot is freed after the last (vLLM's unload lets them finish too).
        Raises LoRANotFoundError."""
        if self.loras is None:
            raise LoRANotFoundError(f"The lora adapter '{name}' cannot be found.")
        self.loras.remove(name, self._adapters_in_use())

    def served_loras(self) -> list[LoRACard]:
        """The adapters new requests may name, in the order they were loaded."""
        modules = [] if self.loras is None else self.loras.served()
        return [LoRACard(m.name, m.path, m.base_model_name) for m in modules]

    def _adapters_in_use(self) -> set[str | None]:
        return {r.params.lora for r in self.scheduler.requests.values()}

    def abort(self, request_ids: list[str], reason: FinishReason = FinishReason.ABORT) -> None:
        """Drop these requests; `reason` "stop" when the frontend stopped them (stop string)."""
        self.scheduler.finish_requests(request_ids, reason)
        for rid in request_ids:
            self.prompt_logprobs.drop(rid)
            self.pooler.drop(rid)

    def take_refusals(self) -> dict[bytes, StepOutputs]:
        """The refusals queued since the last step, for each frontend, to send at once: a
        refused request has no step to wait for, so an overloaded server's 503 need not wait for
        the next step's forward. Refusals not taken go out with the next step's outputs."""
        refused, self._refused = self._refused, []
        news = StepNews()
        _add_refusals(news, refused)
        return self._pack(news)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._refused) or self._inflight is not None

    # -- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> dict[bytes, StepOutputs]:
        """Run one step; return the news for each frontend (by owner identity). Overlapped,
        the news is the previous step's (see the module docstring)."""
        self.counts.steps += 1
        refused, self._refused = self._refused, []
        inflight, self._inflight = self._inflight, None
        sched: SchedulerOutput | None = None
        news = StepNews()
        try:
            if inflight is not None and inflight.blocking:
                self._complete(inflight, news)  # nothing else this call: the next one schedules
                inflight = None
            else:
                sched = self.scheduler.schedule()
                self._drop_preempted(sched.preempted)
                if sched.num_drafts and self.runner.drafter is not None:
                    self._draft(sched)
                launched = self._launch(sched, inflight) if sched.requests else None
                if not self.async_scheduling and launched is not None:
                    self._record(launched, placeholders=False)
                    self._complete(launched, news)
                elif self.async_scheduling:
                    if inflight is not None:
                        self._complete(inflight, news)
                        inflight = None
                    if launched is not None:
                        self._record(launched, placeholders=True)
                        self._inflight = launched
        except Exception as exc:  # one bad step must not end the engine
            # Fail only what this step ran (everything, if scheduling itself failed): the
            # requests that caused it are gone, and the others keep running. A step in flight
            # completed before the failure keeps its news; one that was not loses its tokens.
            if sched is not None:
                victims = list(sched.requests)
            elif inflight is not None and inflight.blocking:
                victims = []  # completing it failed: only its own requests
            else:
                victims = list(self.scheduler.requests.values())
            if inflight is not None:
                news = StepNews()
                victims += [r for r in inflight.samplers if r not in victims]
            else:  # finished (or aborted) requests have had their last row
                victims = [r for r in victims if r.status is not Status.FINISHED]
            if self.runner.workers is not None:  # a rank may be mid-step: nothing can follow
                self.failed = tensor_parallel_failure(exc)
                victims = list(self.scheduler.requests.values())
            self._inflight = None
            self._fail_step(victims, exc, news, self.failed)
        _add_refusals(news, refused)
        self._structured_news(news, idle=not news and self._inflight is None)
        if self.loras is not None and self.loras.retiring:
            self.loras.retire(self._adapters_in_use())
        return self._pack(news)

    def _pack(self, news: StepNews) -> dict[bytes, StepOutputs]:
        outputs = news.pack()
        self.counts.output_messages += len(outputs)
        self.counts.output_rows += len(news)
        return outputs

    def _drop_preempted(self, preempted: list[Request]) -> None:
        for req in preempted:  # its prompt is computed, and scored (or pooled), again
            self.prompt_logprobs.drop(req.request_id)
            self.pooler.drop(req.request_id)
        self.runner.release(preempted)

    def _launch(self, sched: SchedulerOutput, previous: _Launched | None) -> _Launched:
        """Queue the step: the forward (its decodes' tokens from `previous` where they are
        placeholders), the sampling, the prompt logprobs."""
        plan = _plan_rows(sched)
        with self.threads.step(sched.num_tokens):
            hidden, rows = self.runner.execute(
                sched, plan.keep, previous.sampled.tokens if previous is not None else None)
            samplers = sched.samplers()
            batch = build_sampling_batch(samplers, self.sampler.vocab, self.facts.eos_token_ids,
                                         self.generator, _drafts(sched))
            sampled = self._sample(batch, hidden[plan.num_prompt_rows:])
            prompt_lps = (self.prompt_logprobs.score_step(self.runner.head, plan.prompts, hidden)
                          if plan.prompts else {})
            embeddings = self.pooler.pool_step(plan.pools, hidden) if plan.pools else {}
        blocking = batch.reads_outputs or bool(sched.num_drafts) or self._speculating()
        if blocking and self.async_scheduling and not self._said_blocking:
            self._said_blocking = True  # e.g. a model whose defaults set repetition_penalty
            log.info("a step with a grammar, a penalty over the output or speculative decoding: "
                     "the next step waits for its tokens (no overlap for such steps)")
        return _Launched(sched, samplers, batch, rows, sampled, prompt_lps, embeddings, blocking)

    def _speculating(self) -> bool:
        """Whether the requests that sample now may have drafts proposed after this step:
        proposals read their tokens, so overlapped steps stop while speculation is on (no
        more than `spec_max_batch` running) and resume when it is off."""
        return (self.proposer is not None
                and len(self.scheduler.running) <= self.spec_max_batch)

    def _record(self, step: _Launched, placeholders: bool) -> None:
        """The step's progress in the scheduler, its tokens as placeholders if still queued."""
        self.scheduler.advance(step.sched, placeholders)
        if placeholders:
            self.runner.note_placeholders(step.rows)

    def _complete(self, step: _Launched, news: StepNews) -> None:
        """Wait for the step's tokens, give them to their requests, and add its news; then,
        with speculative decoding, propose the next tokens of the requests it sampled."""
        sampled = step.sampled.result()
        drafts = step.batch.drafts
        verified = accept(sampled.token_ids, drafts) if len(drafts.token_ids) else None
        if verified is None:
            finished = self.scheduler.resolve(step.sched, sampled.token_ids)
            self.runner.note_sampled(step.rows, sampled.token_ids)
        else:
            rewind(step.batch.seeded_states, verified.counts)
            if step.batch.constrained:
                _adopt_forks(step.samplers, step.batch, verified)
            finished = self.scheduler.resolve(step.sched, sampled.token_ids[verified.rows],
                                              verified.counts)
            self._count_verified(drafts.counts, verified)
            last = np.cumsum(verified.counts) - 1  # each request's newest token, and where
            self.runner.note_sampled(step.rows, sampled.token_ids[verified.rows[last]],
                                     verified.counts - drafts.counts - 1)
        _add_sampled(news, step.samplers, step.batch, sampled, finished, step.sched.appended,
                     verified)
        _add_prompt_only(news, step.sched, finished, step.embeddings)
        _attach_prompt_logprobs(news, step.prompt_logprobs)
        if self.proposer is not None and (step.blocking or not self.async_scheduling):
            self._propose(step.samplers)  # (an overlapped step's successor is queued already)

    def _propose(self, samplers: list[Request]) -> None:
        """Drafts for the requests that just sampled (none while more than `spec_max_batch`
        requests run, nor for one that thinks before its grammar: the grammar checks a
        constrained one's, batch_builder.expand), as many as the positions worth verifying
        (spec/depth.py) and its output and the context leave room for: a verified draft is an
        output token, and one more follows it."""
        assert self.proposer is not None and self.draft_depth is not None
        running = len(self.scheduler.running)
        depth = self.draft_depth.depth() if running <= self.spec_max_batch else 0
        for req in samplers:
            req.drafts = []
            if (req.status is not Status.RUNNING or req.thinking or not depth
                    or req.placeholder_row >= 0):  # (a step in flight has its next token)
                continue
            room = min(req.output_limit - len(req.output_token_ids),
                       self.max_model_len - len(req.all_token_ids)) - 1
            req.drafts = self.proposer.propose(req.all_token_ids, min(room, depth))

    def _draft(self, sched: SchedulerOutput) -> None:
        """The draft model's tokens in place of the step's draft placeholders (its slots are
        allocated now: drafter.py)."""
        assert self.runner.drafter is not None
        items = [s for s in sched.special.values() if s.drafts]
        drafts = self.runner.drafter.propose([s.request for s in items],
                                             [len(s.drafts) for s in items],
                                             self.runner.draft_forward)
        for s, tokens in zip(items, drafts):
            s.drafts = tuple(tokens)
            s.request.drafts = tokens

    def _count_verified(self, drafted: np.ndarray, verified: Accepted) -> None:
        """vLLM's spec_decode counters: drafts, their tokens, accepted ones and where."""
        assert self.draft_depth is not None
        self.draft_depth.update(drafted, verified.accepted)
        counts = self.counts
        rows = drafted > 0
        accepted = verified.accepted[rows]
        counts.spec_drafts += int(rows.sum())
        counts.spec_draft_tokens += int(drafted.sum())
        counts.spec_accepted_tokens += int(accepted.sum())
        # (a request that accepted m drafts accepted one at each position below m)
        per_pos = [int((accepted > j).sum()) for j in range(int(accepted.max(initial=0)))]
        have = counts.spec_accepted_per_pos
        if len(have) < len(per_pos):
            have = have + [0] * (len(per_pos) - len(have))
        counts.spec_accepted_per_pos = [a + b for a, b in
                                        zip(have, per_pos + [0] * (len(have) - len(per_pos)))]

    def _sample(self, batch: SamplingBatch, hidden: torch.Tensor) -> PendingSample:
        if not batch.num_rows:
            return PendingSample.done(SamplerOutput(np.zeros(0, np.int64),
                                                    np.zeros(0, np.int64), None))
        return self.sampler.sample_later(hidden, batch)

    def _structured_news(self, news: StepNews, idle: bool) -> None:
        """Refuse the requests whose grammar failed to compile (the compiler says why); with
        nothing run this step, wait briefly for a grammar being compiled instead of spinning."""
        for req, message in self.scheduler.take_refused():
            self.counts.rejected[FinishReason.ERROR] = (
                self.counts.rejected.get(FinishReason.ERROR, 0) + 1)
            news.add_finish(req.request_id, req.owner, FinishReason.ERROR, message=message)
        if idle:
            self.scheduler.wait_for_grammars(_GRAMMAR_WAIT_S)

    def _fail_step(self, victims: list[Request], exc: Exception, news: StepNews,
                   message: str | None = None) -> None:
        """A step raised: finish its requests with an error row each (added to `news`; the
        clients read `message`, else a pointer to the log), count it, carry on."""
        self.counts.step_errors += 1
        log.exception("step %d failed; %d request(s) finished with an error",
                      self.counts.steps, len(victims))
        message = message or (f"the engine failed while running this request "
                              f"({type(exc).__name__}); see the engine log")
        ids = [req.request_id for req in victims]
        self.scheduler.finish_requests(ids, FinishReason.ERROR)
        for req in victims:
            self.prompt_logprobs.drop(req.request_id)
            self.pooler.drop(req.request_id)
            news.add_finish(req.request_id, req.owner, FinishReason.ERROR, message=message)

    # -- introspection ----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        progress = self.scheduler.stats
        return msgspec.structs.replace(
            self.counts,
            request_prompt_tokens=progress.request_prompt_tokens,
            prompt_tokens=progress.prompt_tokens,
            generation_tokens=progress.generation_tokens,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            num_requests=len(self.scheduler.requests),
            num_blocks=self.blocks.num_blocks,
            free_blocks=self.blocks.num_free_blocks,
            prefix_queries=self.blocks.stats.queries,
            prefix_hits=self.blocks.stats.hits,
            preemptions=self.scheduler.num_preemptions,
            chunked_prefills=self.scheduler.num_chunked_prefills,
            finished=dict(progress.finished),
            rejected=dict(self.counts.rejected),
            cache_dtype=self.config.kv_cache_dtype,
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict[str, Any]:
        """Each adapter's running and waiting requests, adapters in the order of their oldest
        request in the engine (vLLM's lora_requests_info); nothing without --enable-lora."""
        if self.loras is None:
            return {}
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for req in self.scheduler.requests.values():
            name = req.params.lora
            if name:
                running.setdefault(name, 0)
                waiting.setdefault(name, 0)
                counts = running if req.status is Status.RUNNING else waiting
                counts[name] += 1
        return {"lora_running": running, "lora_waiting": waiting, "lora_time": time.time()}


class _RowPlan(NamedTuple):
    """Which rows of the packed batch need hidden states: every prompt row first (a
    `PromptChunk` per item whose prompt is scored, a `PoolChunk` per pooling item; none when
    no prompt is scored or pooled), then one row per sampling request, in order."""

    keep: np.ndarray
    prompts: list[PromptChunk]
    num_prompt_rows: int
    pools: tuple[PoolChunk, ...] = ()


def _plan_rows(sched: SchedulerOutput) -> _RowPlan:
    _, num_new, samples = sched.columns()
    ends = np.cumsum(num_new)
    sample_rows = ends[samples] - 1
    if sched.num_drafts:  # a request verifying k drafts: its last k + 1 rows, in order
        k = sched.draft_counts()
        sample_rows = _runs(sample_rows - k, k + 1)
    if not sched.scores_prompts and not sched.pools:
        return _RowPlan(sample_rows, [], 0)
    prompt_keep: list[int] = []
    prompts = []
    pools = []
    for s, end in zip(sched.scheduled, ends.tolist()):
        req, offset = s.request, end - s.num_new
        pooling = req.params.pooling
        if pooling is not None:
            lo = len(prompt_keep)
            prompt_keep.extend(offset + p for p in pool_positions(
                pooling.kind, s.start, s.num_new, req.num_prompt_tokens))
            pools.append(PoolChunk(req.request_id, lo, len(prompt_keep), pooling,
                                   req.num_prompt_tokens, s.completes_prompt))
            continue
        if req.prompt_logprobs_done:
            continue
        lo = len(prompt_keep)
        n = max(0, min(s.start + s.num_new, req.num_prompt_tokens - 1) - s.start)
        prompt_keep.extend(range(offset, offset + n))
        # the logits at position p score prompt token p + 1
        targets = req.prompt_token_ids[s.start + 1:s.start + 1 + n]
        prompts.append(PromptChunk(req.request_id, lo, lo + n, targets,
                                   req.params.prompt_logprobs or 0, s.completes_prompt))
    keep = np.concatenate([np.asarray(prompt_keep, dtype=np.int64), sample_rows])
    return _RowPlan(keep, prompts, len(prompt_keep), tuple(pools))


def _runs(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """starts[i], starts[i] + 1, ..., starts[i] + lengths[i] - 1, for each i in turn."""
    ends = np.cumsum(lengths)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(int(ends[-1]) if len(ends)
                                                                     else 0)


def _drafts(sched: SchedulerOutput) -> Drafts | None:
    """The drafts each sampler verifies this step, or None (no speculation)."""
    if not sched.num_drafts:
        return None
    tokens = [t for s in sched.special.values() if s.drafts for t in s.drafts]
    return Drafts(sched.draft_counts(), np.asarray(tokens, dtype=np.int64))


class _DraftSlots:
    """A draft model's proposals, before it makes them: room for k tokens, placeholders the
    step fills once it is scheduled (EngineCore._draft)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        return [PLACEHOLDER] * min(self.k, limit)


def _proposer(config: EngineConfig) -> NgramProposer | _DraftSlots | None:
    spec = config.speculative
    if spec is None:
        return None
    if spec.kind == "draft_model":
        return _DraftSlots(spec.num_speculative_tokens)
    low, high = spec.ngram_sizes
    return NgramProposer(spec.num_speculative_tokens, low, high)


def _adopt_forks(samplers: list[Request], batch: SamplingBatch, verified: Accepted) -> None:
    """Each constrained request that verified drafts takes its grammar's fork of the last row
    it emitted (speculative.py)."""
    starts = batch.group_starts
    for i in np.flatnonzero(batch.drafts.counts).tolist():
        grammar = samplers[i].grammar
        fork = batch.grammars.get(int(starts[i] + verified.accepted[i]))
        if grammar is not None and fork is not None:
            grammar.adopt(fork)


def tensor_parallel_failure(exc: Exception) -> str:
    """Why a tensor-parallel engine stops after a step raised `exc`: a rank that did not answer
    within the collectives' timeout (gloo's and NCCL's errors then say "timed out" or
    "timeout"), or the error itself."""
    text = str(exc)
    if "timed out" in text.lower() or "timeout" in text.lower():
        return (f"a tensor-parallel worker did not answer within "
                f"{COLLECTIVE_TIMEOUT.total_seconds():g} s (TANDEM_TP_TIMEOUT_S): it hangs or "
                "is stopped; the engine stops")
    return f"a tensor-parallel step failed, the engine stops: {type(exc).__name__}: {text}"


def _add_refusals(news: StepNews, refused: list[_Refusal]) -> None:
    for r in refused:
        news.add_finish(r.request_id, r.owner, r.reason, message=r.message)


def _add_sampled(news: StepNews, samplers: list[Request], batch: SamplingBatch,
                 sampled: SamplerOutput, finished: dict[str, Stop], kept: np.ndarray | None,
                 verified: Accepted | None) -> None:
    """A row per token the requests that sampled kept (`kept[i]` of sampler i: none for a
    request finished before its token came, several for one that verified drafts), with its
    logprobs row (if it asked) and, on its last row, its finish."""
    if not samplers:
        return
    n = batch.num_rows
    lp_rows = np.full(n, -1, np.int64)
    lp_k = np.full(n, -1, np.int64)
    asked = sampled.logprob_rows  # the rows whose request asked for logprobs
    if len(asked):
        lp_rows[asked] = np.arange(len(asked))
        lp_k[asked] = batch.logprob_k
    tokens = sampled.token_ids
    owners = samplers
    if verified is not None or (kept is not None and not kept.all()):
        counts = np.ones(len(samplers), np.int64) if verified is None else verified.counts
        rows = np.arange(n) if verified is None else verified.rows
        assert kept is not None
        take = rows[_runs(np.cumsum(counts) - counts, kept)]  # each one's first kept rows
        owners = [samplers[i] for i in np.repeat(np.arange(len(samplers)), kept).tolist()]
        lp_rows, lp_k, tokens = lp_rows[take], lp_k[take], tokens[take]
    first = len(news)
    ids = [r.request_id for r in owners]
    news.add_sampled(ids, [r.owner for r in owners], tokens, sampled.logprobs, lp_rows, lp_k)
    if finished:
        row_of = dict(zip(ids, range(first, first + len(ids))))  # (a request's last row)
        for rid, stop in finished.items():
            row = row_of.get(rid)
            if row is not None:
                news.finish(row, stop.reason, stop.stop_token_id)


def _add_prompt_only(news: StepNews, sched: SchedulerOutput, finished: dict[str, Stop],
                     embeddings: dict[str, torch.Tensor]) -> None:
    """A finish row per prompt-only request whose prompt this step completed (with its
    vector, a pooling request's)."""
    for req in sched.prompts_done():
        rid = req.request_id
        if rid in finished:
            vector = embeddings.get(rid)
            news.add_finish(rid, req.owner, finished[rid].reason,
                            embedding=b"" if vector is None else embedding_bytes(vector))


def _attach_prompt_logprobs(news: StepNews, done: dict[str, Logprobs]) -> None:
    """Each completed prompt's logprobs go on its request's row: a prompt completes on a step
    that samples its request or finishes it."""
    if not done:
        return
    row_of = {rid: row for row, rid in enumerate(news.request_ids)}
    for rid, lps in done.items():
        if rid in row_of:
            news.set_prompt_logprobs(row_of[rid], lps)
