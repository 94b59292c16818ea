"""Overlapped steps (--async-scheduling) say exactly what plain steps say: the same tokens,
logprobs, prompt logprobs and finishes, request by request, under stop tokens, max_tokens,
the context length, penalties, min_tokens, grammars, prompt logprobs, preemption and aborts;
and every block is free after. On the CPU's own path and on the CUDA path's code (device
sampler, CUDA attention with reference kernels, the CUDA-graph stand-in)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from engine_core.worker.platform import Platform
from shared.messages import SamplingParams, StructuredOutput
from tests.engine.driver import Collected, absorb
from tests.engine.test_cuda_graphs import cuda_path_engine
from tests.engine.test_hf_parity import assert_drained, make_prompts

THINK_END = 128014  # "</think>", one token of the embedded tokenizer (DeepSeek-R1-Distill's)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def workload(prompts: list[list[int]], stop_token: int) -> list[tuple[str, list[int],
                                                                        SamplingParams]]:
    """Every kind of request, greedy (a draw of a flat random model's distribution flips on
    rounding: the overlapped batches hold a few more rows, so their products round apart)."""
    kinds: list[dict[str, Any]] = [
        {"max_tokens": 9, "temperature": 0.0, "logprobs": 3},
        {"max_tokens": 12, "temperature": 0.0, "stop_token_ids": [stop_token]},
        {"max_tokens": 7, "temperature": 0.0, "seed": 5, "logprobs": 1},
        {"max_tokens": 6, "temperature": 0.0, "prompt_logprobs": 2},
        {"max_tokens": 8, "temperature": 0.0, "frequency_penalty": 0.5,
         "repetition_penalty": 1.2},
        {"max_tokens": 5, "temperature": 0.0, "min_tokens": 4, "ignore_eos": True},
        {"max_tokens": 14, "temperature": 0.0, "ignore_eos": True},
        {"max_tokens": 1, "temperature": 0.0},
        {"max_tokens": 0, "prompt_logprobs": 1, "echo": True},
        {"max_tokens": 10, "temperature": 0.0,
         "structured": StructuredOutput("json", json.dumps(SCHEMA))},
        {"max_tokens": 10, "temperature": 0.0,  # ends by its grammar in a token or two
         "structured": StructuredOutput("choice", json.dumps(["yes", "no", "maybe"]))},
        {"max_tokens": 8, "temperature": 0.0, "repetition_penalty": 3.0,
         "frequency_penalty": 2.0, "presence_penalty": 2.0},
        # thinks first: the marker (forced) ends the thinking, then the grammar masks
        {"max_tokens": 12, "temperature": 0.0, "logit_bias": {THINK_END: 100.0},
         "reasoning_end": [THINK_END],
         "structured": StructuredOutput("choice", json.dumps(["yes", "no", "maybe"]))},
    ]
    out = []
    for i, p in enumerate(prompts):
        kind = dict(kinds[i % len(kinds)])
        kind.pop("echo", None)
        out.append((f"r{i}", p, SamplingParams(**kind)))
    return out


def drive(core: EngineCore, requests: list[tuple[str, list[int], SamplingParams]],
          abort_after: int = 3) -> dict[str, Collected]:
    """Half the requests first, the rest a few steps in; r5 and r11 aborted once they have
    `abort_after` tokens, as a frontend would on a stop string."""
    results: dict[str, Collected] = {}
    half = len(requests) // 2
    for rid, prompt, params in requests[:half]:
        core.add_request(rid, prompt, params)
    steps = 0
    aborted: set[str] = set()
    while core.has_work:
        for out in core.step().values():
            absorb(out, results)
        steps += 1
        if steps == 3:
            for rid, prompt, params in requests[half:]:
                core.add_request(rid, prompt, params)
        for rid in ("r5", "r11"):
            got = results.get(rid)
            if got is not None and len(got.token_ids) >= abort_after and rid not in aborted:
                core.abort([rid])
                aborted.add(rid)
        assert steps < 2000
    return results


def assert_same(got: dict[str, Collected], want: dict[str, Collected]) -> None:
    assert got.keys() == want.keys()
    for rid, w in want.items():
        g = got[rid]
        assert g.token_ids == w.token_ids, rid
        # (batches differ by the rows an overlapped step computes in vain: float rounding)
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4), rid
        assert g.top_ids == w.top_ids, rid
        assert (g.finish, g.stop_token_id) == (w.finish, w.stop_token_id), rid
        if w.prompt_logprobs is None:
            assert g.prompt_logprobs is None, rid
        else:
            assert g.prompt_logprobs is not None
            assert g.prompt_logprobs.tolist() == pytest.approx(w.prompt_logprobs.tolist(),
                                                               abs=1e-4), rid


def cpu_engine(model: Any, overlap: bool, **kw: Any) -> EngineCore:
    config = EngineConfig(model=str(model), **{"num_kv_blocks": 30, "block_size": 8,
                                               "max_num_batched_tokens": 64, **kw})
    platform = dataclasses.replace(Platform.detect(config), async_scheduling=overlap)
    return EngineCore(config, platform)


def stop_token_of(model: Any, prompt: list[int]) -> int:
    """A token that greedy decoding of `prompt` reaches after a few steps (a stop to hit)."""
    core = cpu_engine(model, overlap=False)
    core.add_request("probe", prompt, SamplingParams(max_tokens=5, temperature=0.0))
    results: dict[str, Collected] = {}
    while core.has_work:
        for out in core.step().values():
            absorb(out, results)
    return results["probe"].token_ids[3]


@pytest.mark.parametrize("kv_blocks", [200, 30])  # roomy, and preempting
def test_overlapped_steps_say_what_plain_steps_say(tiny_llama, tokenizer, kv_blocks):
    prompts = make_prompts(tokenizer, n=24)
    requests = workload(prompts, stop_token_of(tiny_llama, prompts[1]))
    plain = cpu_engine(tiny_llama, overlap=False, num_kv_blocks=kv_blocks)
    want = drive(plain, requests)
    overlapped = cpu_engine(tiny_llama, overlap=True, num_kv_blocks=kv_blocks)
    got = drive(overlapped, requests)
    assert_same(got, want)
    finishes = {c.finish for c in want.values()}
    assert {"length", "stop", None} <= finishes, finishes  # None: aborted (no finish row)
    assert len(got["r5"].token_ids) == 3 and got["r5"].finish is None
    thought = got["r12"].token_ids  # the marker, then one of the choices (a grammar's end)
    assert thought[0] == THINK_END and got["r12"].finish == "stop", thought
    choice = tokenizer.decode(thought[1:], skip_special_tokens=True)
    assert choice in ("yes", "no", "maybe"), thought
    if kv_blocks == 30:
        assert overlapped.stats().preemptions > 0
    for core in (plain, overlapped):
        assert_drained(core)
        assert core.blocks.num_free_blocks == core.blocks.num_blocks
        assert core.stats().step_errors == 0


def test_overlapped_steps_on_the_cuda_paths_code(tiny_llama, tokenizer, monkeypatch):
    """The device sampler's deferred download and the graphs' placeholder tokens, read from
    the previous step's tokens on the device."""
    prompts = make_prompts(tokenizer, n=12)
    requests = workload(prompts, stop_token_of(tiny_llama, prompts[1]))
    want = drive(cuda_path_engine(tiny_llama, monkeypatch, graphs=True), requests)
    core = cuda_path_engine(tiny_llama, monkeypatch, graphs=True)
    core.async_scheduling = True
    got = drive(core, requests)
    assert_same(got, want)
    assert sum(core.runner.graphs.replays.values()) > 0  # type: ignore[union-attr]
    assert_drained(core)
    assert core.blocks.num_free_blocks == core.blocks.num_blocks


@pytest.mark.parametrize("fail_call", [1, 2])
def test_a_step_that_fails_while_completing_fails_only_its_own_requests(
        tiny_llama, tokenizer, monkeypatch, fail_call):
    """Overlapped: completing a step whose tokens the next one needs on the host (penalties)
    raises once. Its request ends with an error; one that waits for a seat is not touched and
    is served after, and nothing finished before the failure loses its rows."""
    prompts = make_prompts(tokenizer, n=3)
    core = cpu_engine(tiny_llama, overlap=True, num_kv_blocks=200, max_num_seqs=1)
    real, calls = core.scheduler.resolve, [0]

    def flaky(*args, **kwargs):
        calls[0] += 1
        if calls[0] == fail_call:
            raise RuntimeError("a matcher broke")
        return real(*args, **kwargs)

    monkeypatch.setattr(core.scheduler, "resolve", flaky)
    core.add_request("short", prompts[2], SamplingParams(max_tokens=1, temperature=0.0))
    core.add_request("penalized", prompts[0], SamplingParams(
        max_tokens=6, temperature=0.0, repetition_penalty=1.3))
    core.add_request("waiter", prompts[1], SamplingParams(max_tokens=5, temperature=0.0))
    results: dict[str, Collected] = {}
    steps = 0
    while core.has_work:
        for out in core.step().values():
            absorb(out, results)
        steps += 1
        assert steps < 200
    failed = "short" if fail_call == 1 else "penalized"
    assert results[failed].finish == "error", results
    assert {rid for rid, c in results.items() if c.finish == "error"} == {failed}
    assert len(results["waiter"].token_ids) == 5 and results["waiter"].finish == "length"
    if fail_call == 2:
        assert results["short"].finish == "length" and len(results["short"].token_ids) == 1
    assert core.stats().step_errors == 1
    assert_drained(core)
    assert core.blocks.num_free_blocks == core.blocks.num_blocks
