"""What the engine keeps after requests end: nothing per request, and a prefix cache no larger
than the KV cache (the soak's RSS creep, docs/reliability.md "Soak").

A mixed run on the tiny model with a small cache (preemption, prefix-cache eviction), prompt
logprobs scored over several steps, and aborts and stops mid-prefill and mid-decode: afterwards
no request, queue entry, refusal or prompt-logprob chunk is left, every block is free, and the
prefix cache holds at most one key per block, however many requests went through.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from shared.messages import FinishReason, SamplingParams
from shared.step_outputs import unpack_step

NUM_BLOCKS = 24


@pytest.fixture(scope="module")
def core(tiny_llama: Path) -> EngineCore:
    return EngineCore(EngineConfig(model=str(tiny_llama), num_kv_blocks=NUM_BLOCKS,
                                   max_model_len=256, max_num_batched_tokens=64, seed=0))


def _round(core: EngineCore, rng: random.Random, tag: str) -> list[str]:
    # A prompt scored over several steps (32 prompt rows a step), aborted while half scored.
    core.add_request(f"{tag}-long", [128000] + [rng.randrange(1000, 2000) for _ in range(200)],
                     SamplingParams(max_tokens=4, prompt_logprobs=1))
    ids, abort_at = [f"{tag}-long"], {f"{tag}-long": 2}
    for i in range(12):
        rid = f"{tag}-{i}"
        prompt = [128000] + [rng.randrange(1000, 2000) for _ in range(rng.randint(1, 90))]
        lp = rng.choice([None, 0, 2])
        core.add_request(rid, prompt, SamplingParams(
            max_tokens=rng.randint(0, 24), temperature=rng.choice([0.0, 0.8]), logprobs=lp,
            prompt_logprobs=lp, ignore_eos=True))
        ids.append(rid)
        if rng.random() < 0.4:
            abort_at[rid] = rng.randint(1, 4)  # mid-prefill (prompt chunks pending) or decode
    finished: set[str] = set()
    step = 0
    while core.has_work:
        step += 1
        due = [r for r, s in abort_at.items() if s == step and r not in finished]
        if tag.endswith(("0", "2")):
            core.abort(due[::2])
            core.abort(due[1::2], reason=FinishReason.STOP)
        else:
            core.abort(due[1::2])
            core.abort(due[::2], reason=FinishReason.STOP)
        finished.update(due)
        for out in core.step().values():
            finished.update(r.request_id for r in unpack_step(out) if r.finish is not None)
        assert step < 2_000
    assert finished == set(ids)
    return ids


def test_nothing_per_request_is_kept_and_the_prefix_cache_is_bounded(core: EngineCore) -> None:
    rng = random.Random(0)
    for r in range(4):
        ids = _round(core, rng, f"r{r}")
        s = core.scheduler
        assert not (s.requests or s.waiting or s.running or s.compiling or s.refused)
        assert not core._refused
        assert not any(rid in core.prompt_logprobs for rid in ids)
        assert core.blocks.num_free_blocks == NUM_BLOCKS
        assert len(core.blocks._cached) == len(core.blocks._key_of) <= NUM_BLOCKS
    stats = core.stats()
    assert stats.num_requests == 0 and stats.step_errors == 0
    assert stats.finished.get(FinishReason.ABORT, 0) > 0 and stats.preemptions > 0
