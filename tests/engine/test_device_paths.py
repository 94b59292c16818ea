"""The CUDA path's device-agnostic pieces in a whole engine on the CPU: the device sampler
(greedy parity with Hugging Face, the CPU sampler's seeded draws), the CUDA attention's
metadata and wiring (reference kernels standing in for FlashAttention and the Triton decode),
and the KV cache sized from a profiled step (the step run for real, the CUDA measurement
stood in for)."""

from __future__ import annotations

import dataclasses

import pytest

import engine_core.layers.attention_cuda as attention_cuda
import engine_core.worker.model_runner as model_runner
from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from engine_core.sample.device_sampler import DeviceSampler
from engine_core.sample.sampler import Sampler
from engine_core.worker.memory_profile import StepMemory
from engine_core.worker.platform import Platform
from shared.messages import SamplingParams
from tests.engine.driver import run
from tests.engine.test_hf_parity import (
    assert_drained,
    assert_parity,
    make_prompts,
    submit_and_run,
)
from tests.unit.engine_core.layers.test_attention_cuda import loop_decode as reference_decode
from tests.unit.engine_core.layers.test_attention_cuda import reference_varlen


def engine(model, sampler: str, **kw) -> EngineCore:
    config = EngineConfig(model=str(model), **kw)
    return EngineCore(config, Platform.detect(config, environ={"TANDEM_SAMPLER": sampler}))


def test_device_sampler_greedy_parity_under_preemption(tiny_llama, tokenizer, reference):
    core = engine(tiny_llama, "device", num_kv_blocks=12, block_size=8)
    assert isinstance(core.sampler, DeviceSampler)
    prompts = make_prompts(tokenizer)
    results = submit_and_run(core, prompts, prompt_logprobs=True)
    assert core.stats().preemptions > 0
    assert_parity(results, prompts, reference)
    assert_drained(core)


def test_device_sampler_draws_what_the_cpu_sampler_draws(tiny_llama, tokenizer):
    """Seeded requests with every kind of setting: the same tokens from either sampler."""
    prompts = make_prompts(tokenizer, n=8)
    settings = [{}, {"top_p": 0.9}, {"top_k": 40}, {"min_p": 0.02},
                {"repetition_penalty": 1.3}, {"frequency_penalty": 0.5, "presence_penalty": 0.3},
                {"logit_bias": {100: 2.0}, "temperature": 0.7}, {"min_tokens": 6}]
    outputs = {}
    for kind, expected in (("cpu", Sampler), ("device", DeviceSampler)):
        core = engine(tiny_llama, kind, num_kv_blocks=256)
        assert isinstance(core.sampler, expected)
        for i, (p, extra) in enumerate(zip(prompts, settings, strict=True)):
            params = {"max_tokens": 8, "temperature": 1.0, "seed": i, "logprobs": 2, **extra}
            core.add_request(f"r{i}", p, SamplingParams(**params))  # type: ignore[arg-type]
        outputs[kind] = {rid: c.token_ids for rid, c in run(core).items()}
    assert outputs["device"] == outputs["cpu"]


@pytest.mark.parametrize("utilization", [0.5, 0.001])
def test_kv_cache_sized_from_a_profiled_step(tiny_llama, monkeypatch, utilization):
    """Where the platform profiles (CUDA by default), the runner runs a step at the largest
    budget with the costliest sampling, then sizes the cache from the measurement: what
    the utilization leaves, never more than max_num_seqs sequences of max_model_len."""
    ran = []

    def measure(device, step, scratch):  # what CUDA's allocator statistics would say
        step()
        ran.append(scratch)
        return StepMemory(total=1 << 30, weights=1 << 20, peak=2 << 20, outside_torch=3 << 20)

    monkeypatch.setattr(model_runner, "measure_step", measure)
    config = EngineConfig(model=str(tiny_llama), max_num_seqs=4, max_model_len=256,
                          max_num_batched_tokens=64)
    platform = dataclasses.replace(Platform.detect(config), kv_cache_bytes=None,
                                   gpu_memory_utilization=utilization)
    if utilization < 0.01:
        with pytest.raises(ValueError, match="gpu-memory-utilization"):
            EngineCore(config, platform)
        return
    core = EngineCore(config, platform)
    assert ran and ran[0] > 0  # the stand-in cache is left out of the weights
    per_block = core.runner.kv_shape.block_bytes(16, core.runner.dtype)
    budget = int((1 << 30) * utilization) - (6 << 20)
    assert core.runner.num_blocks == min(budget // per_block, 4 * 256 // 16)
    core.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0))
    assert run(core)["r"].finish == "length"


@pytest.mark.parametrize("paged_decode", [True, False])
def test_cuda_attention_wiring_parity(tiny_llama, tokenizer, reference, monkeypatch,
                                      paged_decode):
    """The CUDA attention path through transformers, with FlashAttention's semantics in
    reference kernels: HF's tokens and logprobs under chunked prefill, prefix hits and
    preemption (contexts gathered, decodes through their block tables or as varlen chunks)."""
    kernels = attention_cuda.Kernels(reference_varlen,
                                     reference_decode if paged_decode else None)
    monkeypatch.setattr(attention_cuda, "cuda_kernels", lambda *_: kernels)
    config = EngineConfig(model=str(tiny_llama), num_kv_blocks=40, block_size=8,
                          max_num_batched_tokens=48)
    platform = dataclasses.replace(Platform.detect(config), attention="cuda")
    core = EngineCore(config, platform)
    prefix = "You are a careful assistant. Answer briefly and exactly, in plain words. " * 2
    prompts = make_prompts(tokenizer, n=12, prefix=prefix)
    assert submit_and_run(core, prompts[:1], tag="warm")
    results = submit_and_run(core, prompts, prompt_logprobs=True)
    stats = core.stats()
    assert stats.chunked_prefills > 0 and stats.prefix_hits > 0 and stats.preemptions > 0, stats
    assert_parity(results, prompts, reference)
    assert_drained(core)
