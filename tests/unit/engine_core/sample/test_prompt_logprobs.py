"""The prompt-logprob accumulator: chunks joined in order, dropped on preemption or abort."""

from __future__ import annotations

import numpy as np
import torch

from engine_core.layers.lm_head import LMHead
from engine_core.sample.prompt_logprobs import PromptChunk, PromptLogprobsAccumulator
from engine_core.sched.block_manager import BlockManager
from engine_core.sched.request import Request
from shared.messages import SamplingParams
from shared.step_outputs import Logprobs


def chunk(*values: float, k: int = 1) -> Logprobs:
    n = len(values)
    return Logprobs(np.float32(values), np.arange(1, n + 1, dtype=np.int32),
                    np.full((n, k), 9, np.int32), np.zeros((n, k), np.float32))


def test_chunks_are_concatenated_in_order_and_forgotten():
    acc = PromptLogprobsAccumulator()
    acc.add("a", chunk(-1.0, -2.0))
    acc.add("b", chunk(-9.0))
    acc.add("a", chunk(-3.0))
    whole = acc.complete("a", 1)
    assert whole.logprobs.tolist() == [-1.0, -2.0, -3.0] and whole.ranks.tolist() == [1, 2, 1]
    assert whole.top_ids.shape == (3, 1)
    assert "a" not in acc and "b" in acc
    assert len(acc.complete("a", 2)) == 0 and acc.complete("a", 2).top_ids.shape == (0, 2)


def test_drop_forgets_partial_chunks():
    acc = PromptLogprobsAccumulator()
    acc.add("a", chunk(-1.0))
    acc.drop("a")
    acc.drop("never-seen")
    assert "a" not in acc
    acc.add("a", chunk(-5.0))  # scored again from the start after a preemption
    assert acc.complete("a", 1).logprobs.tolist() == [-5.0]


def test_score_step_scores_chunks_until_the_prompt_completes():
    """A 6-token prompt computed 3 + 3: positions 0..4 score tokens 1..5, in two chunks."""
    weight = torch.randn(50, 8)
    head = LMHead(weight)
    prompt = [3, 14, 15, 9, 26, 5]
    hidden = torch.randn(5, 8)
    acc = PromptLogprobsAccumulator()
    first = PromptChunk("a", 0, 3, prompt[1:4], k=2, completes=False)
    assert acc.score_step(head, [first], hidden[:3]) == {}
    assert "a" in acc
    done = acc.score_step(head, [PromptChunk("a", 0, 2, prompt[4:], k=2, completes=True)],
                          hidden[3:])
    ref = torch.log_softmax(hidden @ weight.T, -1)[torch.arange(5), torch.tensor(prompt[1:])]
    assert np.allclose(done["a"].logprobs, ref.numpy(), atol=1e-5)
    assert done["a"].top_ids.shape == (5, 2) and "a" not in acc


def test_preemption_drops_a_requests_chunks_through_the_engine_path():
    """What the engine does with `SchedulerOutput.preempted`: the chunks go."""
    from engine_core.sched.scheduler import Scheduler
    from engine_core.sched.stop_rules import StopRules

    s = Scheduler(BlockManager(3, 4), 8, 64, stop_rules=StopRules(frozenset(), 100))
    a = Request("a", list(range(1, 9)), SamplingParams(max_tokens=4))
    b = Request("b", list(range(1, 5)), SamplingParams(max_tokens=0, prompt_logprobs=1),
                arrival=1)
    s.max_prompt_logprob_rows = 2
    acc = PromptLogprobsAccumulator()
    s.add(a)
    s.add(b)
    out = s.schedule()  # a whole (2 blocks), b's first 2 tokens (1 block): all 3 blocks used
    assert [x.num_new for x in out.scheduled] == [8, 2]
    acc.add("b", chunk(-1.0, -2.0))
    s.update_from_output(out, [7])
    out = s.schedule()  # a's 9th token needs a block: b, the newest, is preempted
    assert out.preempted == [b]
    for req in out.preempted:
        acc.drop(req.request_id)
    assert "b" not in acc and b.num_computed_tokens == 0 and not b.prompt_logprobs_done
