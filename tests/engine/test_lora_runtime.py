"""LoRA adapters loaded and unloaded at run time (the engine's side of /v1/load_lora_adapter
and /v1/unload_lora_adapter), their KV-cache events, and n-gram speculation with an adapter:
each checked against Hugging Face with the adapter merged (test_lora's fixtures)."""

# ruff: noqa: F811  (test_lora's fixtures, imported, are the tests' arguments)
from __future__ import annotations

import pytest

from engine_core.lora.adapters import LoRAError
from engine_core.lora.manager import LoRANotFoundError
from shared.kv_events import BlockStored
from shared.messages import FinishReason, LoRACard, SamplingParams
from tests.engine.driver import absorb, run
from tests.engine.test_hf_parity import MAX_NEW, engine, make_prompts
from tests.engine.test_lora import ATOL, _modules, adapters, merged  # noqa: F401 (fixtures)
from tests.engine.test_speculative import NGRAM, Oracle


def _greedy(lora: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_NEW, temperature=0.0, lora=lora)


def test_load_serve_unload(tiny_llama, tokenizer, adapters, merged):
    core = engine(tiny_llama, num_kv_blocks=96, block_size=8, enable_lora=True, max_loras=1,
                  max_lora_rank=8, lora_modules=_modules(adapters, ["alpha"]))
    assert core.loras is not None
    prompt = make_prompts(tokenizer, n=40)[-1]
    core.add_request("early", prompt, _greedy("beta"))  # not served yet: refused
    assert "`beta` does not exist" in run(core)["early"].message
    core.add_lora(LoRACard("beta", str(adapters["beta"])))
    assert [c.name for c in core.served_loras()] == ["alpha", "beta"]
    assert core.loras.id_of("alpha") == 1 and core.loras.id_of("beta") == 2
    with pytest.raises(LoRAError, match="'beta' has already been loaded"):
        core.add_lora(LoRACard("beta", str(adapters["beta"])))
    with pytest.raises(LoRANotFoundError, match="No adapter found for /nowhere"):
        core.add_lora(LoRACard("gamma", "/nowhere"))
    core.add_request("b", prompt, _greedy("beta"))
    assert run(core)["b"].token_ids == merged["beta"].generate(prompt)[0]
    # unloaded while its request runs: that request finishes with it, new ones are refused
    core.add_request("running", prompt, _greedy("beta"))
    results: dict = {}
    for out in core.step().values():
        absorb(out, results)
    core.remove_lora("beta")
    core.add_request("late", prompt, _greedy("beta"))
    run(core, results)
    assert results["running"].token_ids == merged["beta"].generate(prompt)[0]
    assert results["running"].finish == FinishReason.LENGTH
    assert "`beta` does not exist" in results["late"].message
    assert core.loras.slot_of("beta") is None and "beta" not in core.loras.host
    with pytest.raises(LoRANotFoundError, match="'beta' cannot be found"):
        core.remove_lora("beta")
    # served again from another folder: its id is kept, no block of the old weights is hit
    core.add_lora(LoRACard("beta", str(adapters["gamma"])))
    assert core.loras.id_of("beta") == 2
    before = core.stats().prefix_hits
    core.add_request("again", prompt, _greedy("beta"))
    assert run(core)["again"].token_ids == merged["gamma"].generate(prompt)[0]
    assert core.stats().prefix_hits == before


def test_kv_events_and_stats_name_the_adapter(tiny_llama, tokenizer, adapters):
    core = engine(tiny_llama, num_kv_blocks=96, block_size=8, enable_lora=True, max_loras=1,
                  max_lora_rank=8, lora_modules=_modules(adapters, ["alpha", "beta"]))
    core.blocks.record_events()
    prompt = make_prompts(tokenizer, n=40)[-1]
    for rid, lora in (("a", "beta"), ("b", None), ("c", "alpha")):
        core.add_request(rid, prompt, _greedy(lora))
    core.step()
    stats = core.stats()  # max_loras 1: one adapter runs, the other waits for its slot
    assert stats.lora_running == {"beta": 1, "alpha": 0}
    assert stats.lora_waiting == {"beta": 0, "alpha": 1}
    assert stats.lora_time > 0
    run(core)
    stored = [e for e in core.blocks.take_events() if isinstance(e, BlockStored)]
    by_name = {e.lora_name: e for e in stored if e.parent_block_hash is None}
    assert set(by_name) == {"alpha", "beta", None}
    assert (by_name["alpha"].lora_id, by_name["beta"].lora_id, by_name[None].lora_id) == (1, 2,
                                                                                         None)
    assert by_name["beta"].extra_keys == [("beta",)] * len(by_name["beta"].block_hashes)
    assert by_name[None].extra_keys == [None] * len(by_name[None].block_hashes)
    assert len({e.block_hashes[0] for e in by_name.values()}) == 3  # a chain per adapter
    assert core.stats().lora_running == {}


def test_ngram_speculation_with_adapters_equals_hf_merged(
        tiny_llama, tokenizer, adapters, merged):
    """The n-gram path (drafts verified in one forward, rows of several adapters); a random
    model repeats no n-gram, so an oracle proposes each request's true continuation with
    some tokens wrong (test_speculative's), and the verified tokens must equal HF merged."""
    core = engine(tiny_llama, num_kv_blocks=96, block_size=8, enable_lora=True, max_loras=2,
                  max_lora_rank=8, lora_modules=_modules(adapters, ["alpha", "beta"]),
                  speculative=NGRAM)
    which = {}
    for i, prompt in enumerate(make_prompts(tokenizer, n=6)):
        lora = ["alpha", None, "beta"][i % 3]
        which[f"s{i}"] = (prompt, lora, merged[lora].generate(prompt))
        core.add_request(f"s{i}", prompt, SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                         logprobs=1, lora=lora))
    oracle = Oracle(core, {rid: want[0] for rid, (_, _, want) in which.items()}, wrong=0.3)
    core.proposer = oracle  # type: ignore[assignment]
    results = run(core)
    for rid, (_, lora, (tokens, lps)) in which.items():
        assert results[rid].token_ids == tokens, (rid, lora)
        assert results[rid].logprobs == pytest.approx(lps, abs=ATOL), (rid, lora)
    stats = core.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens  # some of each
