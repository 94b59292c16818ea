"""Speculative decoding on the device (issue 41): n-gram proposals against the same engine
without them, in-process, on a model whose output repeats its prompt.

A random-weight model never copies its prompt, so the stage builds one that does from the
checked model's own weights (tests/bench/spec_copy.py: every layer computed, its outputs
zeroed, an LM head that walks cycles of tokens) and checks that its greedy output continues
each prompt's cycle. Two engines of that model, plain and with `--speculative-config` n-gram
(k = 4, lookup 2..4, the platform's own batch bound), then run:

- batch 1 (`Sizes.spec_prompts` requests one after another, each a prompt that walks a whole
  cycle): time per output token, speculative over plain (target <= 0.5 on the GPU);
- batch `Sizes.spec_batch` at once, random prompts: output tokens/s, speculative over plain
  (target >= 0.95): above the bound nothing is proposed, so this is what speculation being on
  costs a batch (the random prompts' outputs walk cycles too, but only after them).

Both engines are the platform's default (on the GPU: bf16, CUDA graphs, overlapped steps).
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from shared.messages import SamplingParams
from shared.speculative import parse_speculative_config
from tests.bench.spec_copy import chain_model, chain_prompt
from tests.device.context import Context, check_run
from tests.device.targets import all_met, target
from tests.engine.driver import Collected, run

K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}


def spec(ctx: Context) -> dict[str, Any]:
    ctx.release()
    s = ctx.sizes
    judged = ctx.device == "cuda"
    prompt_len = s.spec_cycle + 16
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "chain"
        cycles = chain_model(Path(ctx.model), model, s.spec_cycle)
        random.Random(3).shuffle(cycles)
        fresh = iter(cycles)
        longest = max(prompt_len + s.spec_output_len,
                      s.spec_batch_input_len + s.spec_batch_output_len) + 8
        engines = {name: _engine(ctx, model, longest, NGRAM if name == "ngram" else None)
                   for name in ("plain", "ngram")}
        follows = _follows_chain(engines["plain"], next(fresh), prompt_len)
        for name, core in engines.items():  # warm-up (first shapes, kernels), not timed
            _timed(core, [chain_prompt(next(fresh), 0, prompt_len)], 8, f"warm-{name}")
        c1: dict[str, float] = {}
        for name, core in engines.items():
            prompts = [[chain_prompt(next(fresh), 0, prompt_len)] for _ in range(s.spec_prompts)]
            seconds = sum(_timed(core, p, s.spec_output_len, f"c1-{name}-{i}")
                          for i, p in enumerate(prompts))
            c1[name] = 1000 * seconds / (s.spec_prompts * s.spec_output_len)
        rng = random.Random(4)
        vocab = engines["plain"].facts.vocab_size
        batch = [[rng.randrange(1000, vocab - 1000) for _ in range(s.spec_batch_input_len)]
                 for _ in range(s.spec_batch)]
        cb: dict[str, float] = {}
        for name, core in engines.items():
            seconds = _timed(core, batch, s.spec_batch_output_len, f"cb-{name}")
            cb[name] = s.spec_batch * s.spec_batch_output_len / seconds
        stats = engines["ngram"].stats()
        engines.clear()
    tpot_ratio = c1["ngram"] / c1["plain"]
    batch_ratio = cb["ngram"] / cb["plain"]
    targets = [
        target("batch 1, repeating: time per token, n-gram / plain", round(tpot_ratio, 3),
               "<=", 0.5, "x", judged),
        target(f"batch {s.spec_batch}, random: output tok/s, n-gram / plain",
               round(batch_ratio, 3), ">=", 0.95, "x", judged)]
    return {"chain_tokens_followed": follows,
            "batch1_ms_per_token": {k: round(v, 3) for k, v in c1.items()},
            "batch_tok_s": {k: round(v, 1) for k, v in cb.items()},
            "spec_draft_tokens": stats.spec_draft_tokens,
            "spec_accepted_tokens": stats.spec_accepted_tokens,
            "acceptance_length": round(1 + stats.spec_accepted_tokens
                                       / max(stats.spec_drafts, 1), 2),
            "targets": targets, "passed": all_met(targets)}


def _engine(ctx: Context, model: Path, max_model_len: int,
            speculative: dict[str, Any] | None) -> EngineCore:
    config = EngineConfig(
        model=str(model), device=ctx.device, kv_cache_memory=ctx.sizes.kv_cache_bytes,
        num_threads=ctx.sizes.threads, max_model_len=max_model_len,
        speculative=None if speculative is None else parse_speculative_config(
            json.dumps(speculative)))
    return EngineCore(config)


def _follows_chain(core: EngineCore, cycle: list[int], prompt_len: int) -> str:
    """How many of 32 greedy tokens continue the prompt's cycle (the model copies: below half,
    the stage fails, as its figures would mean nothing)."""
    results = _run(core, [chain_prompt(cycle, 0, prompt_len)], 32, "chain")
    want = chain_prompt(cycle, prompt_len, 32)
    same = sum(a == b for a, b in zip(results["chain0"].token_ids, want))
    if same < 16:
        raise AssertionError(f"the copying model followed its chain for {same} of 32 tokens")
    return f"{same}/32"


def _run(core: EngineCore, prompts: list[list[int]], output_len: int,
         tag: str) -> dict[str, Collected]:
    errors = core.stats().step_errors
    for i, p in enumerate(prompts):
        core.add_request(f"{tag}{i}", p, SamplingParams(max_tokens=output_len, temperature=0.0,
                                                        ignore_eos=True))
    results = run(core)
    check_run(core, results, {f"{tag}{i}": output_len for i in range(len(prompts))}, errors)
    return results


def _timed(core: EngineCore, prompts: list[list[int]], output_len: int, tag: str) -> float:
    start = time.perf_counter()
    _run(core, prompts, output_len, tag)
    return time.perf_counter() - start
