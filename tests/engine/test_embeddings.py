"""Pooling requests (embeddings) in the engine: each vector equals Hugging Face's final hidden
states pooled the same way (last, mean, cls; normalized or not; cut to a Matryoshka width),
under chunked prefill, preemption and the prefix cache, in batches that also generate; and
the requests an embedding server refuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from shared.messages import FinishReason, Pooling, SamplingParams
from tests.engine.driver import Collected, run
from tests.engine.test_hf_parity import assert_drained, engine, make_prompts

ATOL = 1e-4  # float32 on both sides (the bar, 2e-3, is for any dtype)


class HFPooler:
    """Hugging Face's final hidden states (after the last norm), pooled as the engine's
    `Pooling` says: the reference every vector is compared with."""

    def __init__(self, path: Path) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    @torch.inference_mode()
    def __call__(self, prompt: list[int], pooling: Pooling) -> np.ndarray:
        states = self.model.model(torch.tensor([prompt])).last_hidden_state[0].float()
        vector = {"last": states[-1], "cls": states[0], "mean": states.mean(0)}[pooling.kind]
        if pooling.dimensions:
            vector = vector[:pooling.dimensions]
        if pooling.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.numpy()


@pytest.fixture(scope="module")
def hf(tiny_llama: Path) -> HFPooler:
    return HFPooler(tiny_llama)


POOLINGS = [Pooling("last"), Pooling("mean"), Pooling("cls"), Pooling("last", normalize=False),
            Pooling("mean", normalize=False)]


def _submit_mixed(core: EngineCore, prompts: list[list[int]]) -> dict[str, Pooling]:
    """Every prompt as a pooling request (the kinds in turn) and every third also as a
    generating one, in one queue."""
    pooled = {}
    for i, p in enumerate(prompts):
        pooling = POOLINGS[i % len(POOLINGS)]
        core.add_request(f"e{i}", p, SamplingParams(max_tokens=0, pooling=pooling))
        pooled[f"e{i}"] = pooling
        if i % 3 == 0:
            core.add_request(f"g{i}", p, SamplingParams(max_tokens=8, temperature=0.0))
    return pooled


def _assert_vectors(results: dict[str, Collected], prompts: list[list[int]],
                    pooled: dict[str, Pooling], hf: HFPooler) -> None:
    for rid, pooling in pooled.items():
        got = results[rid]
        assert got.finish == FinishReason.LENGTH and got.token_ids == [], (rid, got)
        assert got.embedding is not None, rid
        want = hf(prompts[int(rid[1:])], pooling)
        assert got.embedding.shape == want.shape
        np.testing.assert_allclose(got.embedding, want, atol=ATOL, err_msg=f"{rid} {pooling}")
        if pooling.normalize:
            assert abs(float(np.linalg.norm(got.embedding)) - 1) < 1e-5


def test_pooled_vectors_equal_hf_chunked_and_preempted(tiny_llama, tokenizer, hf):
    core = engine(tiny_llama, num_kv_blocks=14, block_size=8, max_num_batched_tokens=24)
    prompts = make_prompts(tokenizer, n=15)
    assert max(len(p) for p in prompts) > 24  # some prompts take several chunks
    pooled = _submit_mixed(core, prompts)
    results = run(core)
    stats = core.stats()
    assert stats.chunked_prefills > 0 and stats.preemptions > 0, stats
    _assert_vectors(results, prompts, pooled, hf)
    generated = [r for rid, r in results.items() if rid.startswith("g")]
    assert generated and all(len(r.token_ids) == 8 for r in generated)
    assert not core.pooler._partial  # nothing left behind by the preempted ones
    assert_drained(core)


def test_prefix_cache_serves_last_pooling_only(tiny_llama, tokenizer, hf):
    core = engine(tiny_llama, num_kv_blocks=256, block_size=8)
    prompt = make_prompts(tokenizer, n=40)[-1]
    assert len(prompt) > 24
    for rid, pooling in (("warm", Pooling("last")), ("last", Pooling("last")),
                         ("mean", Pooling("mean")), ("cls", Pooling("cls"))):
        before = core.stats().prefix_hits
        core.add_request(rid, prompt, SamplingParams(max_tokens=0, pooling=pooling))
        results = run(core)
        hits = core.stats().prefix_hits - before
        np.testing.assert_allclose(results[rid].embedding, hf(prompt, pooling), atol=ATOL)
        if rid == "last":  # all but the last block's tokens come from the cache
            assert hits >= (len(prompt) - 1) // 8 * 8 > 0
        elif rid != "warm":  # every position read: computed whole
            assert hits == 0, (rid, hits)


def test_refusals(tiny_llama):
    core = engine(tiny_llama, num_kv_blocks=64)
    bad = {
        "dims": SamplingParams(max_tokens=0, pooling=Pooling("last", dimensions=16)),
        "kind": SamplingParams(max_tokens=0, pooling=Pooling("max")),
        "generates": SamplingParams(max_tokens=4, pooling=Pooling("last")),
    }
    for rid, params in bad.items():
        core.add_request(rid, [1, 2, 3], params)
    results = run(core)
    assert "Matryoshka" in results["dims"].message
    assert "max" in results["kind"].message
    assert "generates nothing" in results["generates"].message
    assert all(r.finish == FinishReason.ERROR for r in results.values())


def test_pooling_runner_embeds_only(tiny_llama, tokenizer, hf):
    core = EngineCore(EngineConfig(model=str(tiny_llama), num_kv_blocks=64, runner="pooling"))
    prompt = make_prompts(tokenizer, n=3)[-1]
    core.add_request("gen", prompt, SamplingParams(max_tokens=4))
    core.add_request("emb", prompt, SamplingParams(max_tokens=0, pooling=Pooling()))
    results = run(core)
    assert results["gen"].finish == FinishReason.ERROR
    assert "embeddings only" in results["gen"].message
    np.testing.assert_allclose(results["emb"].embedding, hf(prompt, Pooling()), atol=ATOL)


def test_matryoshka_widths(tiny_llama, tokenizer, hf, tmp_path):
    """A model whose config names Matryoshka widths (as sentence-transformers' do): a vector
    cut to an allowed width, then normalized, equals HF's cut the same way; another width is
    refused."""
    folder = tmp_path / "matryoshka"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [32, 64]}))
    core = engine(folder, num_kv_blocks=64)
    assert core.facts.matryoshka_dimensions == (32, 64)
    prompt = make_prompts(tokenizer, n=5)[-1]
    core.add_request("cut", prompt, SamplingParams(max_tokens=0, pooling=Pooling(dimensions=32)))
    core.add_request("odd", prompt, SamplingParams(max_tokens=0, pooling=Pooling(dimensions=48)))
    results = run(core)
    np.testing.assert_allclose(results["cut"].embedding, hf(prompt, Pooling(dimensions=32)),
                               atol=ATOL)
    assert results["cut"].embedding.shape == (32,)
    assert "32, 64" in results["odd"].message
