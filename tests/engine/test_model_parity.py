"""Each model family through the whole engine against Hugging Face's generate / log_softmax:
Tandem's own file for Llama (untied head), Qwen2 (QKV bias) and Qwen3 (q/k norms, a head_dim
of its own), under concurrency, chunked prefill and preemption; the CPU kernels' ops and
torch's; and the same engine on transformers' module tree (`--model-impl transformers`), the
path every other architecture takes. (test_hf_parity.py runs the tiny Llama in more set-ups.)"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine_core.layers.ops import NativeOps, TorchOps
from engine_core.models.llama import LlamaModel
from engine_core.worker.loader import HFDecoder
from tests.engine.test_hf_parity import (
    Reference,
    assert_drained,
    assert_parity,
    engine,
    make_prompts,
    submit_and_run,
)


def _check(path, core, n: int = 10) -> None:
    prompts = make_prompts(AutoTokenizer.from_pretrained(str(path)), n=n)
    results = submit_and_run(core, prompts, prompt_logprobs=True)
    assert_parity(results, prompts, Reference(path))
    assert_drained(core)


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_own_file_under_chunking_and_preemption(family, request):
    path = request.getfixturevalue(family)
    core = engine(path, num_kv_blocks=10, block_size=8, max_num_batched_tokens=24)
    assert isinstance(core.runner.decoder, LlamaModel)  # Qwen2 and Qwen3 subclass its parts
    _check(path, core)
    stats = core.stats()
    assert stats.preemptions > 0 and stats.chunked_prefills > 0, stats


@pytest.mark.parametrize("fused", ["1", "0"])
def test_cpu_kernels_or_torch_ops(tiny_qwen3, monkeypatch, fused):
    monkeypatch.setenv("TANDEM_FUSED", fused)
    core = engine(tiny_qwen3, num_kv_blocks=64, max_num_batched_tokens=32)
    ops = core.runner.decoder.kit.ops
    native = fused == "1" and core.platform.head_kernels is not None
    assert type(ops) is (NativeOps if native else TorchOps)
    _check(tiny_qwen3, core, n=8)


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen3"])
def test_transformers_module_tree(family, request):
    path = request.getfixturevalue(family)
    core = engine(path, num_kv_blocks=64, max_num_batched_tokens=32,
                  model_impl="transformers")
    assert isinstance(core.runner.decoder, HFDecoder) and core.runner.pieces is None
    _check(path, core, n=8)
