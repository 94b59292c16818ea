"""Greedy tokens and logprobs of the engine against Hugging Face generate / log_softmax.

24 prompts of mixed lengths go in together, in four set-ups: a roomy cache, a cache so small
that requests are preempted, a token budget so small that prefills are chunked, and shared
prefixes that hit the prefix cache. Each set-up asserts the mechanism really happened.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from engine_core.layers.linear import DecoderLinear
from shared.messages import SamplingParams
from tests.engine.driver import Collected, run

MAX_NEW = 10
ATOL = 1e-4
WORDS = ["the", "model", "serves", "tokens", "fast", "and", "exactly", "while", "many", "clients",
         "stream", "text", "你好", "世界", "über", "café", "naïve", "🎉", "rockets", "fly"]


def make_prompts(tokenizer, n: int = 24, prefix: str = "") -> list[list[int]]:
    prompts = []
    for i in range(n):
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(2 + (i * 11) % 45)]
        prompts.append(tokenizer(prefix + " ".join(words)).input_ids)
    return prompts


class Reference:
    def __init__(self, path: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        self._generate = lru_cache(maxsize=None)(self._generate_uncached)

    def generate(self, prompt: list[int]) -> tuple[list[int], list[float]]:
        return self._generate(tuple(prompt))

    @torch.inference_mode()
    def _generate_uncached(self, prompt: tuple[int, ...]) -> tuple[list[int], list[float]]:
        out = self.model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                                  output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompt):].tolist()
        lps = [float(torch.log_softmax(step[0].float(), -1)[t])
               for step, t in zip(out.logits, tokens)]
        return tokens, lps

    @torch.inference_mode()
    def prompt_logprobs(self, prompt: list[int]) -> list[float]:
        lp = torch.log_softmax(self.model(torch.tensor([prompt])).logits[0].float(), -1)
        return [float(lp[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]


def submit_and_run(core: EngineCore, prompts: list[list[int]], prompt_logprobs: bool = False,
                   tag: str = "r") -> dict[str, Collected]:
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logprobs=5,
                                prompt_logprobs=1 if prompt_logprobs and i % 2 == 0 else None)
        core.add_request(f"{tag}{i}", p, params)
    return run(core)


def assert_parity(results: dict[str, Collected], prompts: list[list[int]], reference: Reference,
                  tag: str = "r") -> None:
    for i, p in enumerate(prompts):
        got = results[f"{tag}{i}"]
        tokens, lps = reference.generate(p)
        assert got.token_ids == tokens, f"prompt {i}: tokens differ from HF generate"
        assert got.logprobs == pytest.approx(lps, abs=ATOL), f"prompt {i}: logprobs differ"
        assert all(r >= 1 for r in got.ranks)
        assert got.finish in ("length", "stop")
        if got.prompt_logprobs is not None:
            expected = reference.prompt_logprobs(p)
            assert got.prompt_logprobs.tolist() == pytest.approx(expected, abs=ATOL)


def assert_drained(core: EngineCore) -> None:
    stats = core.stats()
    assert stats.num_requests == 0 and stats.running == 0 and stats.waiting == 0
    assert stats.free_blocks == stats.num_blocks


def engine(path: Path, **kw) -> EngineCore:
    return EngineCore(EngineConfig(model=str(path), **kw))


def test_roomy_cache(tiny_llama, tokenizer, reference):
    core = engine(tiny_llama, num_kv_blocks=512)
    prompts = make_prompts(tokenizer)
    assert len({len(p) for p in prompts}) > 10
    results = submit_and_run(core, prompts, prompt_logprobs=True)
    assert_parity(results, prompts, reference)
    assert sum(r.prompt_logprobs is not None for r in results.values()) == 12
    assert_drained(core)


def test_preemption(tiny_llama, tokenizer, reference):
    core = engine(tiny_llama, num_kv_blocks=12, block_size=8)
    prompts = make_prompts(tokenizer)
    results = submit_and_run(core, prompts, prompt_logprobs=True)
    assert core.stats().preemptions > 0
    assert_parity(results, prompts, reference)
    assert_drained(core)


def test_chunked_prefill(tiny_llama, tokenizer, reference):
    core = engine(tiny_llama, num_kv_blocks=512, max_num_batched_tokens=16)
    prompts = make_prompts(tokenizer)
    results = submit_and_run(core, prompts, prompt_logprobs=True)
    assert core.stats().chunked_prefills > 0
    assert_parity(results, prompts, reference)
    assert_drained(core)


def test_prefix_cache_hits(tiny_llama, tokenizer, reference):
    core = engine(tiny_llama, num_kv_blocks=512, block_size=8)
    prefix = "You are a careful assistant. Answer briefly and exactly, in plain words. " * 3
    prompts = make_prompts(tokenizer, prefix=prefix)
    warm = submit_and_run(core, prompts[:2], tag="warm")
    assert core.stats().prefix_hits == 0 and warm
    results = submit_and_run(core, prompts, prompt_logprobs=True)
    stats = core.stats()
    assert stats.prefix_hits >= 11 * 8 * 3, stats  # the shared prefix, for the cacheable half
    assert_parity(results, prompts, reference)
    assert_drained(core)


def test_abort_half_mid_flight(tiny_llama, tokenizer):
    core = engine(tiny_llama, num_kv_blocks=64, block_size=8, max_num_batched_tokens=64)
    prompts = make_prompts(tokenizer)
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=MAX_NEW, temperature=0.0))

    def abort_some(core: EngineCore, step: int) -> None:
        if step == 3:
            core.abort([f"r{i}" for i in range(0, 24, 2)])

    results = run(core, on_step=abort_some)
    assert all(results[f"r{i}"].finish == "length" for i in range(1, 24, 2))
    assert all(results.get(f"r{i}") is None or results[f"r{i}"].finish is None
               for i in range(0, 24, 2))
    assert_drained(core)


def test_qwen2_parity(tiny_qwen2):
    tok = AutoTokenizer.from_pretrained(str(tiny_qwen2))
    ref = Reference(tiny_qwen2)
    core = engine(tiny_qwen2, num_kv_blocks=64, max_num_batched_tokens=32)
    prompts = make_prompts(tok, n=8)
    results = submit_and_run(core, prompts, prompt_logprobs=True)
    assert_parity(results, prompts, ref)
    assert_drained(core)


@pytest.mark.parametrize(("layout", "panels"), [("transposed", "1"), ("torch", "0")])
def test_parity_with_either_linear_layout(tiny_llama, tokenizer, reference, monkeypatch, layout,
                                          panels):
    """The platform measures which layout of the decoder's linears is faster here, and whether
    decode steps run the compiled kernel on packed panels; every way must give HF's tokens and
    logprobs, whichever this machine picks."""
    monkeypatch.setenv("TANDEM_LINEAR", layout)
    monkeypatch.setenv("TANDEM_PANELS", panels)
    core = engine(tiny_llama, num_kv_blocks=512, max_num_batched_tokens=32)
    assert core.platform.transposed_linears == (layout == "transposed")
    packed = any(isinstance(m, DecoderLinear) and m.panels is not None
                 for m in core.runner.decoder.modules())
    assert packed == (panels == "1" and core.platform.head_kernels is not None)
    prompts = make_prompts(tokenizer, n=12)
    results = submit_and_run(core, prompts, prompt_logprobs=True)
    assert_parity(results, prompts, reference)
    assert_drained(core)
