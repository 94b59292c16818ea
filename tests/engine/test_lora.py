"""LoRA adapters in the engine: random peft adapters built here (`init_lora_weights=False`, so
B is not zero), each request's greedy tokens and logprobs equal Hugging Face's with that
adapter merged into the weights (peft's `merge_and_unload`), with the base model and two
adapters mixed in one concurrent batch; more adapters than slots (they swap, nothing fails);
prefix-cache blocks never shared across adapters; the refusals."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from engine_core.engine import EngineCore
from engine_core.lora.adapters import LoRAError
from shared.engine_args import LoRAModule
from shared.messages import FinishReason, SamplingParams
from tests.engine.driver import run
from tests.engine.test_hf_parity import MAX_NEW, Reference, engine, make_prompts

ATOL = 2e-4  # float32; the merged weights round once more than base + delta
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (seed, rank, alpha, targets, rsLoRA)
ADAPTERS = {"alpha": (1, 8, 16, ALL, False), "beta": (2, 4, 8, ["q_proj", "v_proj",
                                                                 "down_proj"], True),
            "gamma": (3, 8, 8, ["o_proj", "gate_proj", "up_proj"], False)}


def make_adapter(base: Path, folder: Path, seed: int, rank: int, alpha: int,
                 targets: list[str], rslora: bool) -> None:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets,
                        init_lora_weights=False, use_rslora=rslora)
    peft = get_peft_model(model, config)
    for name, param in peft.named_parameters():  # peft's random B is small: make it count
        if "lora_B" in name:
            param.data.mul_(0.3 / param.data.abs().mean())
    peft.save_pretrained(str(folder))


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    folders = {}
    for name, (seed, rank, alpha, targets, rslora) in ADAPTERS.items():
        folders[name] = root / name
        make_adapter(tiny_llama, folders[name], seed, rank, alpha, targets, rslora)
    return folders


@pytest.fixture(scope="module")
def merged(tiny_llama: Path, adapters: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> dict[str | None, Reference]:
    """Hugging Face's greedy tokens and logprobs with each adapter merged (None: the base)."""
    references: dict[str | None, Reference] = {None: Reference(tiny_llama)}
    for name, folder in adapters.items():
        base = AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32)
        model = PeftModel.from_pretrained(base, str(folder)).merge_and_unload()
        out = tmp_path_factory.mktemp(f"merged-{name}")
        model.save_pretrained(str(out))
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (tiny_llama / f).exists():
                shutil.copy(tiny_llama / f, out / f)
        references[name] = Reference(out)
    return references


def _modules(adapters: dict[str, Path], names: list[str]) -> tuple[LoRAModule, ...]:
    return tuple(LoRAModule(n, str(adapters[n])) for n in names)


def _run_mixed(core: EngineCore, prompts: list[list[int]], names: list[str | None]):
    which = {}
    for i, prompt in enumerate(prompts):
        lora = names[i % len(names)]
        which[f"r{i}"] = (prompt, lora)
        core.add_request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                         logprobs=1, lora=lora))
    return which, run(core)


def _assert_equal_merged(which, results, merged) -> None:
    differ = 0
    for rid, (prompt, lora) in which.items():
        tokens, lps = merged[lora].generate(prompt)
        got = results[rid]
        assert got.token_ids == tokens, (rid, lora)
        assert got.logprobs == pytest.approx(lps, abs=ATOL), (rid, lora)
        differ += tokens != merged[None].generate(prompt)[0]
    assert differ >= len(which) // 2  # the adapters do change the outputs


def test_base_and_two_adapters_in_one_batch_equal_hf_merged(tiny_llama, tokenizer, adapters,
                                                            merged):
    core = engine(tiny_llama, num_kv_blocks=64, block_size=8, max_num_batched_tokens=64,
                  enable_lora=True, max_loras=2, max_lora_rank=8,
                  lora_modules=_modules(adapters, ["alpha", "beta"]))
    prompts = make_prompts(tokenizer, n=12)
    which, results = _run_mixed(core, prompts, [None, "alpha", "beta"])
    _assert_equal_merged(which, results, merged)
    assert core.stats().chunked_prefills > 0
    assert core.loras is not None and core.loras.loads == 2


def test_more_adapters_than_slots_wait_and_swap(tiny_llama, tokenizer, adapters, merged):
    core = engine(tiny_llama, num_kv_blocks=96, enable_lora=True, max_loras=1,
                  max_lora_rank=8, max_cpu_loras=1,
                  lora_modules=_modules(adapters, ["alpha", "beta", "gamma"]))
    prompts = make_prompts(tokenizer, n=9)
    which, results = _run_mixed(core, prompts, ["alpha", "beta", "gamma", None])
    assert all(r.finish == FinishReason.LENGTH for r in results.values())
    _assert_equal_merged(which, results, merged)
    assert core.loras is not None and core.loras.loads >= 3  # each swapped in, at least once
    assert len(core.loras.host) == 1  # --max-cpu-loras 1: the others read again when needed


def test_prefix_cache_is_never_shared_across_adapters(tiny_llama, tokenizer, adapters, merged):
    core = engine(tiny_llama, num_kv_blocks=96, block_size=8, enable_lora=True, max_loras=2,
                  max_lora_rank=8, lora_modules=_modules(adapters, ["alpha", "beta"]))
    prompt = make_prompts(tokenizer, n=40)[-1]
    assert len(prompt) > 24
    hits = []
    for i, lora in enumerate([None, "alpha", "beta", "alpha", None]):
        before = core.stats().prefix_hits
        core.add_request(f"p{i}", prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                         lora=lora))
        results = run(core)
        assert results[f"p{i}"].token_ids == merged[lora].generate(prompt)[0]
        hits.append(core.stats().prefix_hits - before)
    assert hits[:3] == [0, 0, 0]  # each first sight of (adapter, prompt): computed
    assert hits[3] > 0 and hits[4] > 0  # the same adapter (or the base) again: cached


def test_refusals(tiny_llama, adapters, tmp_path):
    core = engine(tiny_llama, num_kv_blocks=64, enable_lora=True, max_lora_rank=8,
                  lora_modules=_modules(adapters, ["alpha"]))
    core.add_request("x", [1, 2, 3], SamplingParams(max_tokens=2, lora="nope"))
    plain = engine(tiny_llama, num_kv_blocks=64)
    plain.add_request("y", [1, 2, 3], SamplingParams(max_tokens=2, lora="alpha"))
    assert "`nope` does not exist" in run(core)["x"].message
    assert "`alpha` does not exist" in run(plain)["y"].message
    with pytest.raises(LoRAError, match="above --max-lora-rank 4"):
        engine(tiny_llama, num_kv_blocks=64, enable_lora=True, max_lora_rank=4,
               lora_modules=_modules(adapters, ["alpha"]))
    broken = tmp_path / "broken"
    shutil.copytree(adapters["alpha"], broken)
    (broken / "adapter_config.json").write_text(
        (broken / "adapter_config.json").read_text().replace('"use_dora": false',
                                                              '"use_dora": true'))
    with pytest.raises(LoRAError, match="DoRA"):
        engine(tiny_llama, num_kv_blocks=64, enable_lora=True, max_lora_rank=8,
               lora_modules=(LoRAModule("broken", str(broken)),))
