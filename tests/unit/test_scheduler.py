"""Scheduler decisions with request builders and no model: budget, chunking, preemption."""

from __future__ import annotations

from engine_core.block_manager import BlockManager
from engine_core.request import Request, Status
from engine_core.scheduler import Scheduler
from shared.messages import SamplingParams


def req(rid: str, prompt_len: int, max_tokens: int = 4, prompt_logprobs: int | None = None) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(
        max_tokens=max_tokens, prompt_logprobs=prompt_logprobs))


def scheduler(blocks: int = 64, block_size: int = 4, seqs: int = 8, budget: int = 32,
              caching: bool = True) -> Scheduler:
    return Scheduler(BlockManager(blocks, block_size, caching), seqs, budget)


def finish_step(s: Scheduler, out) -> None:
    """What the engine does after a forward: advance, and give samplers a token."""
    for item in out.scheduled:
        item.request.num_computed_tokens += item.num_new
        if item.request.num_computed_tokens >= item.request.num_prompt_tokens:
            item.request.prompt_logprobs_done = True
        s.publish_computed_blocks(item.request)
        if item.samples:
            item.request.append_token(7)


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
    s = Scheduler(BlockManager(512, 4, False), 64, 256, min_num_batched_tokens=8)  # no prefix hits
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
    assert Scheduler(BlockManager(8, 4), 8, 64).step_budget() == 64  # fixed without a floor


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
    s = Scheduler(BlockManager(64, 4), 8, 64, max_prompt_logprob_rows=10)
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


def test_default_step_budget_by_device():
    import torch

    from engine_core.config import EngineConfig
    from engine_core.engine import step_budget

    default = EngineConfig(model="m")
    assert step_budget(default, torch.device("cuda")) == (2048, None)  # fixed, vLLM's
    assert step_budget(default, torch.device("cpu")) == (2048, 512)  # follows the queue
    fixed = EngineConfig(model="m", max_num_batched_tokens=300)
    assert step_budget(fixed, torch.device("cpu")) == (300, None)
