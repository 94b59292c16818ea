"""Scheduler decisions with request builders and no model: budget, chunking, preemption, and
what a step's output does to the requests (progress, stop rules, finishes)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from engine_core.sched.block_manager import BlockManager
from engine_core.sched.request import Request, Status
from engine_core.sched.scheduler import Scheduler, SchedulerOutput
from engine_core.sched.stop_rules import Stop, StopRules
from engine_core.structured.grammar import RequestGrammar
from shared.messages import FinishReason, SamplingParams, StructuredOutput

EOS = 2
RULES = StopRules(frozenset({EOS}), max_model_len=1000)


def req(rid: str, prompt_len: int, max_tokens: int = 4,
        prompt_logprobs: int | None = None, **params) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(
        max_tokens=max_tokens, prompt_logprobs=prompt_logprobs, **params))


def scheduler(blocks: int = 64, block_size: int = 4, seqs: int = 8, budget: int = 32,
              caching: bool = True, rules: StopRules = RULES) -> Scheduler:
    return Scheduler(BlockManager(blocks, block_size, caching), seqs, budget, stop_rules=rules)


def finish_step(s: Scheduler, out: SchedulerOutput, token: int = 7) -> dict[str, Stop]:
    """What the engine does after a forward: every sampler gets `token`."""
    return s.update_from_output(out, [token] * len(out.samplers()))


def test_budget_chunks_a_long_prompt_and_decodes_go_first():
    s = scheduler(budget=10)
    a, b = req("a", 6), req("b", 25)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [(x.request.request_id, x.num_new) for x in out.scheduled] == [("a", 6), ("b", 4)]
    assert out.scheduled[0].samples and not out.scheduled[1].samples
    finish_step(s, out)
    out = s.schedule()
    assert [(x.request.request_id, x.num_new) for x in out.scheduled] == [("a", 1), ("b", 9)]
    assert s.num_chunked_prefills == 2


def test_adaptive_budget_is_a_quarter_of_the_queued_prompt_tokens():
    s = Scheduler(BlockManager(512, 4, False), 64, 256, min_num_batched_tokens=8,
                  stop_rules=RULES)  # no prefix hits
    assert s.step_budget() == 8  # nothing queued: the floor
    for i in range(4):
        s.add(req(f"r{i}", 30))
    assert s.step_budget() == 30  # 120 queued
    out = s.schedule()
    assert [(x.request.request_id, x.num_new) for x in out.scheduled] == [("r0", 30)]
    finish_step(s, out)
    for i in range(4, 20):
        s.add(req(f"r{i}", 30))
    assert s.step_budget() == 570 // 4
    out = s.schedule()
    assert [(x.request.request_id, x.num_new) for x in out.scheduled] == [
        ("r0", 1), ("r1", 30), ("r2", 30), ("r3", 30), ("r4", 30), ("r5", 21)]
    finish_step(s, out)  # what r5 has left counts as queued, r0's decode does not
    assert s.step_budget() == (9 + 14 * 30) // 4
    for i in range(20, 60):
        s.add(req(f"r{i}", 30))
    assert s.step_budget() == 256  # the cap
    fixed = Scheduler(BlockManager(8, 4), 8, 64, stop_rules=RULES)
    assert fixed.step_budget() == 64  # fixed without a floor


def test_max_num_seqs_limits_admission():
    s = scheduler(seqs=2)
    for i in range(3):
        s.add(req(f"r{i}", 3))
    out = s.schedule()
    assert len(out.scheduled) == 2 and len(s.waiting) == 1


def test_preempts_the_newest_when_blocks_run_out():
    s = scheduler(blocks=4, block_size=4, budget=64)
    a, b = req("a", 8), req("b", 8)
    s.add(a)
    s.add(b)
    finish_step(s, s.schedule())  # both prefilled: 2 blocks each, all 4 used
    assert s.blocks.num_free_blocks == 0
    out = s.schedule()  # a's 9th token needs a new block: b (newest) is preempted
    assert out.preempted == [b] and b.status is Status.WAITING and b.num_computed_tokens == 0
    assert [x.request for x in out.scheduled] == [a]
    assert s.waiting[0] is b and s.num_preemptions == 1


def test_preempting_itself_when_alone_in_trouble():
    s = scheduler(blocks=2, block_size=4, budget=64)
    a, b = req("a", 4), req("b", 4)
    s.add(a)
    s.add(b)
    finish_step(s, s.schedule())
    out = s.schedule()  # a needs a block: b goes; then b is gone and a fits
    assert out.preempted == [b] and [x.request for x in out.scheduled] == [a]


def test_no_admission_on_a_step_that_preempted():
    s = scheduler(blocks=4, block_size=4, budget=64)
    a, b = req("a", 8), req("b", 8)
    s.add(a)
    s.add(b)
    finish_step(s, s.schedule())
    s.add(req("c", 2))
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["a"]


def test_prefix_hit_skips_computed_tokens():
    s = scheduler(block_size=4)
    a = req("a", 12)
    s.add(a)
    finish_step(s, s.schedule())
    s.remove(a)
    b = req("b", 12)
    s.add(b)
    out = s.schedule()
    assert out.scheduled[0].start == 8 and out.scheduled[0].num_new == 4
    assert s.blocks.stats.hits == 8


def test_prompt_logprobs_request_recomputes_the_whole_prompt():
    s = scheduler(block_size=4)
    a = req("a", 12)
    s.add(a)
    finish_step(s, s.schedule())
    s.add(req("b", 12, prompt_logprobs=1))
    out = s.schedule()
    assert [(x.request.request_id, x.start) for x in out.scheduled] == [("a", 12), ("b", 0)]


def test_remove_frees_blocks():
    s = scheduler()
    a = req("a", 9)
    s.add(a)
    s.schedule()
    s.remove(a)
    assert s.blocks.num_free_blocks == 64 and not s.has_work


def test_prompt_logprob_prefills_get_their_own_smaller_budget():
    s = Scheduler(BlockManager(64, 4), 8, 64, max_prompt_logprob_rows=10, stop_rules=RULES)
    a, b, c = req("a", 8, prompt_logprobs=1), req("b", 8, prompt_logprobs=1), req("c", 8)
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    assert [(x.request.request_id, x.num_new) for x in out.scheduled] == [
        ("a", 8), ("b", 2), ("c", 8)]  # c scores nothing, so the row budget does not hold it
    finish_step(s, out)
    out = s.schedule()
    assert [(x.request.request_id, x.num_new) for x in out.scheduled] == [
        ("a", 1), ("b", 6), ("c", 1)]


def run_to_end(s: Scheduler, r: Request, tokens: list[int]) -> tuple[list[int], Stop]:
    """Step `r` alone, sampling `tokens` in turn, until it finishes: its tokens and why."""
    s.add(r)
    for token in tokens:
        finished = finish_step(s, s.schedule(), token)
        if r.request_id in finished:
            assert r.status is Status.FINISHED and r.request_id not in s.requests
            return r.output_token_ids, finished[r.request_id]
    raise AssertionError("the request did not finish")


def test_update_advances_progress_and_publishes_blocks():
    s = scheduler(block_size=4, budget=6)
    a = req("a", 10)
    s.add(a)
    assert finish_step(s, s.schedule()) == {}  # a chunk: no token, no finish
    assert a.num_computed_tokens == 6 and a.output_token_ids == []
    assert a.num_published_blocks == 1
    finish_step(s, s.schedule())
    assert a.num_computed_tokens == 10 and a.output_token_ids == [7]
    assert a.num_published_blocks == 2
    stats = s.stats
    counted = (stats.prompt_tokens, stats.request_prompt_tokens, stats.generation_tokens)
    assert counted == (10, 10, 1)


def test_stop_token_ends_a_request_and_is_named():
    tokens, stop = run_to_end(scheduler(), req("a", 3, max_tokens=9, stop_token_ids=[5]),
                              [7, 5, 7])
    assert tokens == [7, 5] and stop == Stop(FinishReason.STOP, 5)


def test_eos_stops_unless_ignore_eos():
    tokens, stop = run_to_end(scheduler(), req("a", 3, max_tokens=9), [7, EOS, 7])
    assert tokens == [7, EOS] and stop == Stop(FinishReason.STOP)
    tokens, stop = run_to_end(scheduler(), req("b", 3, max_tokens=3, ignore_eos=True), [EOS] * 9)
    assert tokens == [EOS] * 3 and stop == Stop(FinishReason.LENGTH)


def test_min_tokens_holds_stop_tokens_and_eos_back():
    r = req("a", 3, max_tokens=9, min_tokens=2, stop_token_ids=[5])
    tokens, stop = run_to_end(scheduler(), r, [5, EOS, 5])
    assert tokens == [5, EOS, 5] and stop == Stop(FinishReason.STOP, 5)


def test_max_tokens_and_max_model_len_finish_with_length():
    tokens, stop = run_to_end(scheduler(), req("a", 3, max_tokens=4), [7] * 9)
    assert tokens == [7] * 4 and stop.reason is FinishReason.LENGTH
    short = scheduler(rules=StopRules(frozenset({EOS}), max_model_len=5))
    tokens, stop = run_to_end(short, req("b", 3, max_tokens=9), [7] * 9)
    assert tokens == [7] * 2 and stop.reason is FinishReason.LENGTH


def test_prompt_only_request_finishes_with_length_when_its_prompt_is_computed():
    s = scheduler(budget=8)  # 4 prompt-logprob rows a step
    a = req("a", 6, max_tokens=0, prompt_logprobs=1)
    s.add(a)
    out = s.schedule()
    assert not out.samplers() and finish_step(s, out) == {}
    assert not a.prompt_logprobs_done
    finished = finish_step(s, s.schedule())
    assert finished == {"a": Stop(FinishReason.LENGTH)} and a.prompt_logprobs_done
    assert a.output_token_ids == [] and s.stats.generation_tokens == 0
    assert s.stats.finished == {FinishReason.LENGTH: 1} and not s.has_work
    assert s.blocks.num_free_blocks == 64


def test_finish_requests_counts_by_reason_and_ignores_unknown_ids():
    s = scheduler()
    for rid in ("a", "b"):
        s.add(req(rid, 3))
    s.schedule()
    s.finish_requests(["a", "gone"], FinishReason.ABORT)
    s.finish_requests(["b"], FinishReason.STOP)
    assert s.stats.finished == {FinishReason.ABORT: 1, FinishReason.STOP: 1}
    assert not s.has_work and not s.requests and s.blocks.num_free_blocks == 64



def test_a_thinking_request_is_masked_from_the_token_after_its_end_marker():
    """`reasoning_end` [8, 9]: no mask until the output ends with 8, 9 (a lone 8 or 9 is not
    the marker), then masked for good; without a constraint the marker means nothing."""
    compiled: Future[Any] = Future()
    compiled.set_result(None)
    thinking = req("a", 3, max_tokens=9, reasoning_end=[8, 9],
                   structured=StructuredOutput("json_object"))
    thinking.grammar = RequestGrammar(compiled)
    masked = []
    for token in (9, 8, 7, 8, 9, 7, 8):
        masked.append(thinking.masked)
        thinking.append_token(token)
    assert masked == [False] * 5 + [True] * 2
    plain = req("b", 3, reasoning_end=[8, 9])
    assert not plain.thinking and not plain.masked
    at_once = req("c", 3, structured=StructuredOutput("json_object"))
    at_once.grammar = RequestGrammar(compiled)
    assert at_once.masked


def test_plain_decodes_are_columns_and_every_other_item_is_special():
    """A schedule keeps a `Scheduled` only for items other than plain decodes; `scheduled`
    gives every item with the flags it had when scheduled, and the columns agree."""
    s = scheduler(budget=12)
    a, b, c = req("a", 5, max_tokens=6), req("b", 3, prompt_logprobs=1), req("c", 20)
    for r in (a, b, c):
        s.add(r)
    first = s.schedule()  # a and b whole, c's first chunk
    assert sorted(first.special) == [0, 1, 2]
    finish_step(s, first)
    out = s.schedule()  # a and b decode (b scored its prompt already), c's next chunk
    assert [(x.request.request_id, x.start, x.num_new) for x in out.scheduled] == [
        ("a", 5, 1), ("b", 3, 1), ("c", 4, 10)]
    assert sorted(out.special) == [2]  # only the chunk
    plain = out.scheduled[0]
    assert plain.completes_prefill and plain.samples and plain.completes_prompt
    assert not out.scheduled[2].samples
    starts, num_new, samples = out.columns()
    assert starts.tolist() == [5, 3, 4] and num_new.tolist() == [1, 1, 10]
    assert samples.tolist() == [True, True, False]
    assert [r.request_id for r in out.samplers()] == ["a", "b"]
    assert not out.scores_prompts and out.prompts_done() == []
    before = (a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens)
    finish_step(s, out)
    assert (a.num_computed_tokens, b.num_computed_tokens, c.num_computed_tokens) == (
        before[0] + 1, before[1] + 1, before[2] + 10)
    assert a.output_token_ids == [7, 7] and c.output_token_ids == []


def test_the_quick_stop_filter_never_misses_a_stop():
    """`StopRules.watch` widens a request's stop ids and output limit so that the scheduler's
    quick test (a token among the ids, or the limit reached) holds whenever `check` stops it:
    stop tokens, EOS, ignore_eos, min_tokens, max_tokens and the context's end."""
    rules = StopRules(frozenset({EOS, 3}), max_model_len=12)
    cases = [dict(max_tokens=20), dict(max_tokens=4), dict(stop_token_ids=[9], max_tokens=20),
             dict(ignore_eos=True, max_tokens=20), dict(min_tokens=3, max_tokens=20),
             dict(ignore_eos=True, stop_token_ids=[9], min_tokens=2, max_tokens=6)]
    for params in cases:
        for token in (EOS, 3, 9, 7):
            r = req("r", 5, **params)
            rules.watch(r)
            for _ in range(10):
                r.append_token(token)
                if rules.check(r, token) is not None:
                    assert token in r.stop_ids or len(r.output_token_ids) >= r.output_limit
                    break
            else:
                raise AssertionError(f"{params}, {token}: the context's end never stopped it")


def test_prompt_only_and_scored_prompts_are_special():
    s = scheduler()
    p, q = req("p", 4, max_tokens=0), req("q", 3, prompt_logprobs=2)
    s.add(p)
    s.add(q)
    out = s.schedule()
    assert out.scores_prompts and [r.request_id for r in out.prompts_done()] == ["p"]
    assert [r.request_id for r in out.samplers()] == ["q"]
    finished = finish_step(s, out)
    assert finished["p"] == Stop(FinishReason.LENGTH) and p.status is Status.FINISHED
