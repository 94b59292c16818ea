"""LoRA on the CUDA path's code, checked on the CPU (test_cuda_graphs.py's `cuda_path_engine`:
reference attention kernels, the graphs' stand-ins, LoRA's kernel path with the kernels'
torch references, triton_lora.py): each token's adapter read from the persistent slot buffer,
so the captured decode graphs and piecewise graphs replay any mix of adapters.

- base + two adapters in one batch: Hugging Face's tokens and logprobs with each adapter
  merged, the graphs replayed;
- more adapters than slots: adapters swapped into the one slot between replays of the same
  graphs, still Hugging Face's;
- the captured decode forward with LoRA on issues no host sync.
"""

from __future__ import annotations

import torch

from engine_core.lora import triton_lora
from tests.engine import test_lora
from tests.engine.test_cuda_graphs import SYNCING, OpRecorder, cuda_path_engine
from tests.engine.test_hf_parity import assert_drained, make_prompts
from tests.engine.test_lora import _assert_equal_merged, _modules, _run_mixed

adapters, merged = test_lora.adapters, test_lora.merged  # the fixtures, shared


def lora_engine(model, monkeypatch, adapters, names, **kw):
    return cuda_path_engine(model, monkeypatch, graphs=True, max_num_batched_tokens=40,
                            enable_lora=True, max_lora_rank=8,
                            lora_modules=_modules(adapters, names), **kw)


def replays(core) -> tuple[int, int]:
    """(decode graph replays, piecewise replays) so far."""
    runner = core.runner
    return sum(runner.graphs.replays.values()), sum(runner.piecewise.replays.values())


def test_graphs_replay_base_and_two_adapters_as_hf_merged(tiny_llama, tokenizer, adapters,
                                                          merged, monkeypatch):
    core = lora_engine(tiny_llama, monkeypatch, adapters, ["alpha", "beta"], max_loras=2)
    assert core.runner.lora is not None and core.runner.lora.context.kernels is not None
    which, results = _run_mixed(core, make_prompts(tokenizer, n=12), [None, "alpha", "beta"])
    _assert_equal_merged(which, results, merged)
    decodes, pieces = replays(core)
    assert decodes > 0 and pieces > 0
    assert decodes + pieces == core.counts.steps  # no step ran eagerly
    assert_drained(core)


def test_an_adapter_swapped_between_replays_is_still_right(tiny_llama, tokenizer, adapters,
                                                           merged, monkeypatch):
    """One slot, three adapters: each swaps in (copied into the same buffers the captured
    graphs read) while the graphs keep replaying."""
    core = lora_engine(tiny_llama, monkeypatch, adapters, ["alpha", "beta", "gamma"],
                       max_loras=1, max_cpu_loras=1)
    loads, seen = [], []
    prompts = make_prompts(tokenizer, n=9)
    which, results = _run_mixed(core, prompts, ["alpha", "beta", "gamma", None])
    _assert_equal_merged(which, results, merged)
    assert core.loras is not None and core.loras.loads >= 3
    loads.append(core.loras.loads)
    seen.append(replays(core)[0])
    # again, after the captures and the swaps above: the same graphs, other adapters
    which, results = _run_mixed(core, prompts[:4], ["gamma", "alpha"])
    _assert_equal_merged(which, results, merged)
    assert core.loras.loads > loads[0] and replays(core)[0] > seen[0]
    assert_drained(core)


def test_the_captured_decode_forward_with_lora_never_syncs(tiny_llama, adapters, monkeypatch):
    core = lora_engine(tiny_llama, monkeypatch, adapters, ["alpha", "beta"], max_loras=2)
    graphs, lora = core.runner.graphs, core.runner.lora
    assert graphs is not None and graphs.graphs and lora is not None
    for name, slot in (("alpha", 0), ("beta", 1)):
        lora.load(slot, core.loras._read(name))  # type: ignore[union-attr]
    lora.context.set(torch.tensor([0, 1, -1, 0, 1]).numpy())
    recorder = OpRecorder()
    with torch.inference_mode(), recorder:
        hidden = graphs._bound(8)()
    assert hidden.shape == (8, core.runner.hf_config.hidden_size)
    syncing = {op: n for op, n in recorder.ops.items() if any(s in op for s in SYNCING)}
    assert not syncing, f"host syncs or data-shaped ops in the graph: {syncing}"
    # the LoRA products ran: a shrink and an expand per product, each one bmm
    layers = core.runner.decoder.num_layers
    assert recorder.ops["bmm"] == 2 * 4 * layers, recorder.ops
    assert triton_lora.device_kernels() is triton_lora.REFERENCE
