"""--tensor-parallel-size 2 on the CPU (gloo): the engine is rank 0 and starts one worker
process; greedy tokens equal Hugging Face's and logprobs (sampled, top-5, prompt) are within
the parity tolerance, with chunked prefill and preemption, for the tiny Llama (4 heads, 2 KV
heads), the tiny Qwen2 (q/k/v biases) and a Llama with one KV head (replicated on both
ranks; the unit test's model, with biases, a tied head and an uneven vocabulary split). A
model that does not split is refused before any worker starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from engine_core.engine import EngineCore
from tests.engine.test_hf_parity import (
    Reference,
    assert_drained,
    assert_parity,
    engine,
    make_prompts,
    submit_and_run,
)
from tests.unit.engine_core.models.test_tensor_parallel import few_kv_heads


def _tp_engine(path: Path, **kw) -> EngineCore:
    return engine(path, tensor_parallel_size=2, **kw)


def _close(core: EngineCore) -> None:
    assert core.runner.workers is not None
    core.runner.workers.stop()


def test_tiny_llama_chunked_and_preempted(tiny_llama, tokenizer, reference):
    core = _tp_engine(tiny_llama, num_kv_blocks=14, block_size=8, max_num_batched_tokens=32)
    try:
        assert core.runner.kv_shape.kv_heads == 1  # this rank's half of the 2 KV heads
        prompts = make_prompts(tokenizer, n=12)
        results = submit_and_run(core, prompts, prompt_logprobs=True)
        stats = core.stats()
        assert stats.chunked_prefills > 0 and stats.preemptions > 0, stats
        assert_parity(results, prompts, reference)
        assert sum(r.prompt_logprobs is not None for r in results.values()) == 6
        one = engine(tiny_llama, num_kv_blocks=512)  # the top-5 ids as at one rank
        alone = submit_and_run(one, prompts)
        for key, got in results.items():
            assert got.top_ids == alone[key].top_ids and got.ranks == alone[key].ranks
        assert_drained(core)
    finally:
        _close(core)


def test_qwen2_biases_follow_their_heads(tiny_qwen2):
    tok = AutoTokenizer.from_pretrained(str(tiny_qwen2))
    core = _tp_engine(tiny_qwen2, num_kv_blocks=64, max_num_batched_tokens=32)
    try:
        prompts = make_prompts(tok, n=6)
        results = submit_and_run(core, prompts, prompt_logprobs=True)
        assert_parity(results, prompts, Reference(tiny_qwen2))
        assert_drained(core)
    finally:
        _close(core)


def test_kv_heads_fewer_than_ranks_are_replicated(tmp_path):
    folder = few_kv_heads(tmp_path / "kv1")
    core = _tp_engine(folder, num_kv_blocks=64, max_num_batched_tokens=16)
    try:
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(1, 301, (n,), generator=gen).tolist() for n in (5, 23, 40)]
        results = submit_and_run(core, prompts, prompt_logprobs=True)
        assert_parity(results, prompts, Reference(folder))
        assert_drained(core)
    finally:
        _close(core)


def test_heads_that_do_not_divide_are_a_start_up_error(tmp_path):
    config = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=3)
    config.architectures = ["LlamaForCausalLM"]
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="3 attention heads do not divide"):
        _tp_engine(tmp_path)
