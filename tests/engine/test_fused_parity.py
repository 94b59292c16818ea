"""HF parity with the decoder layers' elementwise work fused (fused.py) and without it: the
default, where the CPU kernels are built, is fused (test_hf_parity.py runs it in every
set-up); TANDEM_FUSED fixes it either way, and both ways give HF's tokens and logprobs."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine_core.layers.fused import FusedDecoderLayer
from tests.engine.test_hf_parity import (
    Reference,
    assert_drained,
    assert_parity,
    engine,
    make_prompts,
    submit_and_run,
)


def _fused_layers(core) -> int:
    return sum(isinstance(m, FusedDecoderLayer) for m in core.runner.decoder.modules())


@pytest.mark.parametrize("fused", ["1", "0"])
def test_parity_fused_or_not(tiny_llama, tokenizer, reference, monkeypatch, fused):
    monkeypatch.setenv("TANDEM_FUSED", fused)
    core = engine(tiny_llama, num_kv_blocks=512, block_size=8, max_num_batched_tokens=32)
    on = fused == "1" and core.platform.head_kernels is not None
    assert core.platform.fused_elementwise == on
    assert _fused_layers(core) == (4 if on else 0)  # the tiny Llama's layers
    prompts = make_prompts(tokenizer, n=12)
    results = submit_and_run(core, prompts, prompt_logprobs=True)
    assert core.stats().chunked_prefills > 0
    assert_parity(results, prompts, reference)
    assert_drained(core)


def test_qwen2_parity_fused(tiny_qwen2, monkeypatch):
    monkeypatch.setenv("TANDEM_FUSED", "1")
    core = engine(tiny_qwen2, num_kv_blocks=64, max_num_batched_tokens=32)
    if core.platform.head_kernels is None:
        pytest.skip("no C compiler: no CPU kernels here")
    assert _fused_layers(core) == 2
    prompts = make_prompts(AutoTokenizer.from_pretrained(str(tiny_qwen2)), n=8)
    results = submit_and_run(core, prompts, prompt_logprobs=True)
    assert_parity(results, prompts, Reference(tiny_qwen2))
    assert_drained(core)
