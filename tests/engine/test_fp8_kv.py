"""The fp8 KV cache (`--kv-cache-dtype fp8`) in a whole engine, on the CPU path and on the
CUDA path's stand-in (reference kernels, graphs and pieces in their eager stand-ins).

Two references:
- exactness: Hugging Face's forward with each layer's K and V quantized and dequantized as the
  cache stores them (fp8_kv's quantizer, itself tested against a hand-written one): the
  engine's tokens are its argmax and its logprobs equal it (fp32, 1e-4) on transformers'
  module tree, whose K/V are HF's own.
  (Tandem's own model files compute K/V with other last bits, and now and then one of them
  moves an e4m3 rounding: docs/benchmarks.md.)
- quality, teacher-forced: the engine generates greedily with its fp8 cache; full-precision HF
  re-scores prompt + generated tokens in one forward; every generated token is among HF's top
  20 at its position, and most are its argmax.
All on the default tiny Llama (the model `tandem serve` runs without one named).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from engine_core.quant import fp8_kv
from shared.messages import SamplingParams
from tests.engine.driver import Collected, run
from tests.engine.test_cuda_graphs import cuda_path_engine
from tests.engine.test_hf_parity import ATOL, Reference, assert_drained, make_prompts

NEW = 12
TOP = 20
MOST = 0.9  # the least share of tokens that must be HF's argmax (measured: 0.97-0.98)


def submit(core: EngineCore, prompts: list[list[int]], tag: str = "r") -> dict[str, Collected]:
    for i, p in enumerate(prompts):
        core.add_request(f"{tag}{i}", p, SamplingParams(max_tokens=NEW, temperature=0.0,
                                                        ignore_eos=True))
    return run(core)


@torch.inference_mode()
def teacher_forced(reference: Reference, prompts: list[list[int]],
                   results: dict[str, Collected], tag: str = "r") -> tuple[int, int]:
    """(argmax hits, tokens) of the engine's tokens under HF's full-precision logits; asserts
    that every token is within HF's top TOP."""
    hits = total = 0
    for i, p in enumerate(prompts):
        got = results[f"{tag}{i}"].token_ids
        assert len(got) == NEW
        logits = reference.model(torch.tensor([p + got])).logits[0, len(p) - 1:-1].float()
        ranks = (logits > logits.gather(1, torch.tensor(got)[:, None])).sum(1)
        assert int(ranks.max()) < TOP, f"prompt {i}: a token outside HF's top {TOP}: {ranks}"
        hits += int((ranks == 0).sum())
        total += len(got)
    return hits, total


def fp8_engine(model: Path, **kw: Any) -> EngineCore:
    return EngineCore(EngineConfig(model=str(model), kv_cache_dtype="fp8",
                                   **{"num_kv_blocks": 256, "block_size": 8, "dtype": "float32",
                                      **kw}))


@pytest.mark.parametrize("calculate", [False, True], ids=["scale-1", "calculated"])
def test_fp8_cache_is_teacher_forced_close_to_hf_on_the_cpu_path(tiny_llama, tokenizer,
                                                                 reference, calculate):
    prompts = make_prompts(tokenizer, n=12)
    core = fp8_engine(tiny_llama, calculate_kv_scales=calculate)
    assert core.runner.kv_caches[0][0].dtype == fp8_kv.FP8
    results = submit(core, prompts)
    hits, total = teacher_forced(reference, prompts, results)
    print(f"fp8 KV, CPU path, {'calculated' if calculate else '1.0'} scales: {hits}/{total} "
          "tokens HF's argmax")
    assert hits >= MOST * total, (hits, total)
    scales = core.runner.kv_scales
    assert scales is not None
    values = scales.values[:, :2]
    if calculate:  # each layer's own, from the first batch: no longer the starting 1.0
        assert bool((values != 1.0).all()) and bool((values > 0).all())
    else:
        assert bool((values == 1.0).all())
    assert_drained(core)


def test_fp8_cache_on_the_cuda_path_stand_in(tiny_llama, tokenizer, reference,
                                             monkeypatch):
    """The CUDA path's code (reference kernels in the Triton kernels' place) with the decode
    graphs' and the piecewise graphs' stand-ins, scales calculated after their capture: the
    graphs read them from the device tensor."""
    prompts = make_prompts(tokenizer, n=12)
    core = cuda_path_engine(tiny_llama, monkeypatch, graphs=True, kv_cache_dtype="fp8",
                            calculate_kv_scales=True, num_kv_blocks=256, dtype="float32",
                            max_num_batched_tokens=40)
    results = submit(core, prompts)
    assert core.runner.graphs is not None and sum(core.runner.graphs.replays.values()) > 0
    assert core.runner.piecewise is not None and sum(core.runner.piecewise.replays.values())
    hits, total = teacher_forced(reference, prompts, results)
    print(f"fp8 KV, CUDA path stand-in: {hits}/{total} tokens HF's argmax")
    assert hits >= MOST * total, (hits, total)
    assert_drained(core)


def test_prefix_cache_hits_and_preemption_with_an_fp8_cache(tiny_llama, tokenizer,
                                                            reference):
    """Requests sharing a long prefix, in a cache so small that some are preempted: their
    tokens against the same requests run without the prefix cache in a roomy cache (scales of
    1.0 both, so the same scales), and the teacher-forced rule for all. (A hit reads the
    prefix's K/V rounded to e4m3 where a fresh prefill attends to its own unrounded: a request
    may differ, so the count is printed, not asserted.)"""
    prefix = "the model serves tokens fast and exactly while many clients stream text " * 3
    prompts = make_prompts(tokenizer, n=8, prefix=prefix)
    core = fp8_engine(tiny_llama, num_kv_blocks=30)
    results = submit(core, prompts)
    stats = core.stats()
    assert stats.prefix_hits > 0 and stats.preemptions > 0, stats
    assert_drained(core)
    want = submit(fp8_engine(tiny_llama, enable_prefix_caching=False), prompts)
    same = sum(results[f"r{i}"].token_ids == want[f"r{i}"].token_ids for i in range(len(prompts)))
    print(f"prefix cache + preemption, fp8: {same}/{len(prompts)} requests token for token")
    hits, total = teacher_forced(reference, prompts, results)
    assert hits >= MOST * total, (hits, total)


def test_fp8_holds_twice_bf16s_tokens_and_says_so(tiny_llama):
    """At one --kv-cache-memory the engine counts blocks by the cache's element size: fp8
    holds twice bfloat16's blocks (four times float32's); the stats say fp8."""
    budget = 8 << 20
    blocks = {}
    for dtype, kv in (("bfloat16", "auto"), ("float32", "auto"), ("float32", "fp8")):
        core = EngineCore(EngineConfig(model=str(tiny_llama), kv_cache_memory=budget,
                                       dtype=dtype, kv_cache_dtype=kv, max_model_len=64))
        blocks[dtype, kv] = core.stats().num_blocks
        assert core.stats().cache_dtype == kv
        assert core.runner.kv_caches[0][0].dtype == (
            fp8_kv.FP8 if kv == "fp8" else getattr(torch, dtype))
    fp8 = blocks["float32", "fp8"]
    assert fp8 == 2 * blocks["bfloat16", "auto"] == 4 * blocks["float32", "auto"], blocks


# -- exactness against HF with the cache's rounding ---------------------------------------------
class QuantizedKV:
    """An HF attention function: each layer's K and V rounded as the fp8 cache stores them
    (`scales` [layers, 2+]; `rounded` False: as they are)."""

    def __init__(self) -> None:
        self.scales = torch.ones(1, 2)
        self.rounded = True

    def __call__(self, module: Any, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: torch.Tensor | None, **kw: Any
                 ) -> tuple[torch.Tensor, None]:
        if self.rounded:
            k_scale, v_scale = self.scales[module.layer_idx, :2]
            key = fp8_kv.dequantize(fp8_kv.quantize(key, k_scale), k_scale, key.dtype)
            value = fp8_kv.dequantize(fp8_kv.quantize(value, v_scale), v_scale, value.dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)


@pytest.mark.parametrize("calculate", [False, True], ids=["scale-1", "calculated"])
@torch.inference_mode()
def test_logprobs_equal_hf_with_the_caches_rounding(tiny_llama, tokenizer, calculate):
    attend = QuantizedKV()
    AttentionInterface.register("tandem_test_fp8_kv", attend)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32,
                                                 attn_implementation="tandem_test_fp8_kv")
    prompts = make_prompts(tokenizer, n=8)
    core = fp8_engine(tiny_llama, calculate_kv_scales=calculate, model_impl="transformers")
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=NEW, temperature=0.0,
                                                    ignore_eos=True, logprobs=1))
    results = run(core)
    assert core.runner.kv_scales is not None
    attend.scales = core.runner.kv_scales.values.cpu()

    def errors(rounded: bool) -> torch.Tensor:
        attend.rounded = rounded
        out = []
        for i, p in enumerate(prompts):
            got = results[f"r{i}"]
            logits = model(torch.tensor([p + got.token_ids])).logits[0, len(p) - 1:-1]
            want = torch.log_softmax(logits.float(), -1)
            if rounded:
                assert want.argmax(-1).tolist() == got.token_ids, f"prompt {i}"
            picked = want.gather(1, torch.tensor(got.token_ids)[:, None])[:, 0]
            out.append((torch.tensor(got.logprobs) - picked).abs())
        return torch.cat(out)

    exact, plain = errors(rounded=True), errors(rounded=False)
    within = float((exact < ATOL).float().mean())
    print(f"fp8 KV: {within:.2f} of the logprobs within {ATOL} of HF with the cache's rounding "
          f"(mean error {exact.mean():.1e}, largest {exact.max():.1e}); against plain HF "
          f"{float((plain < ATOL).float().mean()):.2f} (mean {plain.mean():.1e})")
    # The engine's K/V differ from HF's in their last bits, and now and then one of them falls
    # on the other side of an e4m3 rounding (with calculated scales, one request of eight, whose
    # prompt puts a layer-1 V element 5e-5 of a step from a rounding midpoint, is off by up to
    # 0.03 from there on), and which ones do depends on the CPU's kernels: measured 0.89 within
    # (mean error 1/58 of plain's) on AVX-512, 0.73 (1/129) with the AVX2 kernels; without the
    # flips 1.00 (1/5900); against plain HF 0.06-0.07 within. So: most logprobs exact, and the
    # mean error at least ten times below plain HF's (which the cache's rounding explains).
    assert within >= 0.5 and float(exact.mean()) < float(plain.mean()) / 10
    assert float(plain.max()) > 20 * ATOL  # and the reference sees what fp8 does


# -- speculative decoding and tensor parallelism ------------------------------------------------
def test_verification_steps_give_the_plain_fp8_engines_tokens(tiny_llama, tokenizer):
    """Drafts verified k + 1 rows at a time read the same fp8 cache as single-token decodes:
    the plain fp8 engine's greedy tokens, with proposals right and wrong (test_speculative's
    oracle), and the target as its own draft model (its cache in the model's dtype beside the
    target's fp8 one)."""
    from tests.engine.test_speculative import NGRAM, Oracle, draft_config

    prompts = make_prompts(tokenizer, n=6)
    want = submit(fp8_engine(tiny_llama), prompts)
    oracle_core = fp8_engine(tiny_llama, speculative=NGRAM)
    oracle_core.proposer = Oracle(  # type: ignore[assignment]
        oracle_core, {r: c.token_ids for r, c in want.items()})
    drafted = fp8_engine(tiny_llama, speculative=draft_config(tiny_llama))
    for core in (oracle_core, drafted):
        got = submit(core, prompts)
        assert core.stats().spec_accepted_tokens > 0
        for rid, w in want.items():
            assert got[rid].token_ids == w.token_ids, rid
        assert_drained(core)
    assert drafted.runner.drafter is not None
    assert drafted.runner.drafter.kv_caches[0][0].dtype == torch.float32


def test_tensor_parallel_ranks_share_the_calculated_scales(tiny_llama, tokenizer,
                                                           reference):
    """At TP = 2 each rank holds half the KV heads; the scales calculated from the first batch
    are the whole layer's (a MAX all-reduce): those of TP = 1, and the teacher-forced rule."""
    prompts = make_prompts(tokenizer, n=8)
    one = fp8_engine(tiny_llama, calculate_kv_scales=True)
    submit(one, prompts)
    core = fp8_engine(tiny_llama, calculate_kv_scales=True, tensor_parallel_size=2)
    try:
        assert core.runner.kv_shape.kv_heads == 1
        results = submit(core, prompts)
        assert core.runner.kv_scales is not None and one.runner.kv_scales is not None
        got, want = core.runner.kv_scales.values, one.runner.kv_scales.values
        # layer 0's K/V come from the embeddings alone: its scales bit for bit (the MAX over the
        # ranks' halves); deeper layers' inputs carry the sharded all-reduces' last bits, which
        # the layers amplify (measured: up to 1.4e-3 relative in layer 3's V scale)
        assert torch.equal(got[0], want[0])
        assert torch.allclose(got, want, rtol=1e-2, atol=0)
        hits, total = teacher_forced(reference, prompts, results)
        print(f"fp8 KV at TP = 2: {hits}/{total} tokens HF's argmax")
        assert hits >= MOST * total, (hits, total)
        assert_drained(core)
    finally:
        assert core.runner.workers is not None
        core.runner.workers.stop()
