"""The GPU step's pieces that the CPU can check, in a whole engine:

- the CUDA-graph runner through its eager stand-in (ladder, padding, dummy rows, persistent
  buffers), and the piecewise graphs' for the steps with a prefill (piecewise.py): the same
  tokens and logprobs as the eager path, Hugging Face's, every size used;
- the graph-captured decode forward and every piecewise piece issue no host sync and no
  operation whose output shape depends on the data (their ops recorded with a
  TorchDispatchMode), and a decode step launches the kernels the design says, no more;
- the Triton kernels get one specialization each, whatever the steps' shapes (Triton's own
  specialization rule, for sm_90, applied to every launch).
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoTokenizer

import engine_core.layers.attention_cuda as attention_cuda
from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from engine_core.layers import triton_attention, triton_ops
from engine_core.layers.ops import HeadShape, QKNorm, TorchOps
from engine_core.layers.rotary import RotaryTable
from engine_core.lora import triton_lora
from engine_core.worker.cuda_graphs import capture_sizes
from engine_core.worker.piecewise import piecewise_sizes
from engine_core.worker.platform import Platform
from shared.messages import SamplingParams
from tests.engine.driver import Collected, run
from tests.engine.test_hf_parity import ATOL, MAX_NEW, assert_drained, assert_parity, make_prompts

REFERENCE_KERNELS = attention_cuda.Kernels(attention_cuda.sdpa_varlen,
                                           attention_cuda.reference_decode,
                                           triton_attention.write_kv_reference)


def cuda_path_engine(model: Any, monkeypatch: pytest.MonkeyPatch, graphs: bool,
                     kernels: attention_cuda.Kernels = REFERENCE_KERNELS,
                     pieces: bool | None = None,
                     lora_kernels: triton_lora.LoRAKernels = triton_lora.REFERENCE,
                     **kw: Any) -> EngineCore:
    """An engine on the CUDA path's code on the CPU: its attention (reference kernels), the
    device sampler, with --enable-lora LoRA's kernel path (its references) and, with `graphs`,
    the stand-ins of the decode graphs and (unless `pieces` says otherwise) of the piecewise
    graphs, over token counts up to 40."""
    monkeypatch.setattr(attention_cuda, "cuda_kernels", lambda *_: kernels)
    monkeypatch.setattr(triton_lora, "device_kernels", lambda: lora_kernels)
    config = EngineConfig(model=str(model), **{"num_kv_blocks": 64, "block_size": 8,
                                               "max_num_seqs": 16, **kw})
    pieces = graphs if pieces is None else pieces
    platform = dataclasses.replace(
        Platform.detect(config, environ={**os.environ, "TANDEM_SAMPLER": "device"}),
        attention="cuda",
        cuda_graph_sizes=capture_sizes(16) if graphs else (),
        piecewise_sizes=piecewise_sizes(40) if pieces else (),
        lora_kernels=config.enable_lora)
    return EngineCore(config, platform)


def staggered(core: EngineCore, prompts: list[list[int]], logprobs: int | None = 3
              ) -> dict[str, Collected]:
    """Greedy requests ending at different steps, so that decode batches shrink through the
    ladder's sizes; a few added mid-run (prefill steps among the decodes)."""
    late = prompts[-3:]
    for i, p in enumerate(prompts[:-3]):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=3 + 2 * i, temperature=0.0,
                                                    logprobs=logprobs, ignore_eos=True))

    def add_late(engine: EngineCore, steps: int) -> None:
        if steps == 4:
            for j, p in enumerate(late):
                engine.add_request(f"late{j}", p, SamplingParams(max_tokens=6, temperature=0.0,
                                                                 logprobs=logprobs))

    return run(core, on_step=add_late)


def test_graph_stand_in_matches_the_eager_path(tiny_llama, tokenizer, monkeypatch):
    prompts = make_prompts(tokenizer, n=14)
    # a budget that chunks the prompts into steps the piecewise ladder (up to 40) holds
    eager = staggered(cuda_path_engine(tiny_llama, monkeypatch, graphs=False,
                                       max_num_batched_tokens=40), prompts)
    core = cuda_path_engine(tiny_llama, monkeypatch, graphs=True, max_num_batched_tokens=40)
    graphed = staggered(core, prompts)
    assert core.runner.graphs is not None
    replays = core.runner.graphs.replays
    assert {8, 4, 2, 1} <= {size for size, n in replays.items() if n}, replays
    pieces = core.runner.piecewise
    assert pieces is not None
    # the steps with a prefill: in pieces, of several sizes
    assert len({size for size, n in pieces.replays.items() if n}) >= 2, pieces.replays
    assert sum(replays.values()) + sum(pieces.replays.values()) == core.counts.steps
    assert graphed.keys() == eager.keys()
    for rid, want in eager.items():
        got = graphed[rid]
        assert got.token_ids == want.token_ids, rid
        # (a padded batch changes the GEMMs' row count, so their summation order: fp32 noise,
        # up to 1.5e-5 on an AVX2 CPU; the parity tolerance with Hugging Face bounds it)
        assert got.logprobs == pytest.approx(want.logprobs, abs=ATOL), rid
        assert got.finish == want.finish
    assert_drained(core)


def test_graph_stand_in_parity_with_hf_under_preemption(tiny_llama, tokenizer, reference,
                                                        monkeypatch):
    """Preempted requests lose their block-table rows and get new ones; padded rows write
    only the dummy block: Hugging Face's tokens all the same."""
    core = cuda_path_engine(tiny_llama, monkeypatch, graphs=True, num_kv_blocks=14)
    prompts = make_prompts(tokenizer, n=10)
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=MAX_NEW, temperature=0.0,
                                                    logprobs=5))
    results = run(core)
    assert core.stats().preemptions > 0
    assert sum(core.runner.graphs.replays.values()) > 0  # type: ignore[union-attr]
    assert_parity(results, prompts, reference)
    assert_drained(core)


# -- no host sync in the captured forward --------------------------------------------------
SYNCING = ("_local_scalar_dense", "nonzero", "item", "is_nonzero", "masked_select",
           "unique", "equal", "allclose", "to_list")


class OpRecorder(TorchDispatchMode):
    """Every aten op run, by name. On CUDA a host sync is a `_local_scalar_dense` (`.item()`,
    `int()`, `bool()` of a tensor), an op whose output is shaped by the data (`nonzero`,
    `masked_select`, `unique`), or a copy to the host (which the graph's forward never makes:
    it has no host tensor to copy to, and `to_list` would show)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        self.ops[func._schema.name.removeprefix("aten::")] += 1
        return func(*args, **(kwargs or {}))


def test_the_captured_decode_forward_never_syncs(tiny_llama, monkeypatch):
    core = cuda_path_engine(tiny_llama, monkeypatch, graphs=True)
    graphs = core.runner.graphs
    assert graphs is not None and graphs.graphs
    recorder = OpRecorder()
    fn = graphs._bound(8)  # what the capture of the size-8 graph runs
    with torch.inference_mode(), recorder:
        hidden = fn()
    assert hidden.shape == (8, core.runner.hf_config.hidden_size)
    syncing = {op: n for op, n in recorder.ops.items() if any(s in op for s in SYNCING)}
    assert not syncing, f"host syncs or data-shaped ops in the graph: {syncing}"
    assert "embedding" in recorder.ops and len(recorder.ops) > 20, recorder.ops


def test_no_piece_of_the_piecewise_graphs_syncs(tiny_qwen3, monkeypatch):
    core = cuda_path_engine(tiny_qwen3, monkeypatch, graphs=True)
    pieces = core.runner.piecewise
    assert pieces is not None and pieces.graphs
    for size in (8, 40):
        fns = pieces.pieces(size)
        assert len(fns) == core.runner.pieces.num_layers + 1
        for fn in fns:
            recorder = OpRecorder()
            with torch.inference_mode(), recorder:
                fn()
            syncing = {op: n for op, n in recorder.ops.items() if any(s in op for s in SYNCING)}
            assert not syncing, f"host syncs or data-shaped ops in a piece: {syncing}"


# -- the kernels a decode step launches -------------------------------------------------------
# aten ops that launch no kernel: views, aliases and allocations
NO_LAUNCH = {"view", "_unsafe_view", "reshape", "as_strided", "slice", "select", "t", "transpose",
             "unsqueeze", "squeeze", "expand", "alias", "detach", "permute", "_reshape_alias",
             "narrow", "split", "unbind", "lift_fresh", "empty", "empty_like", "new_empty",
             "empty_strided"}
# the design: per layer, two add+norms, SiLU x up, rope + KV write and the decode attention
# (one launch each, as the Triton kernels are), and four products; the embedding and the first
# norm once (docs/gpu.md)
LAUNCHES_PER_LAYER = 9
LAUNCHES_OUTSIDE_LAYERS = 2


class LaunchCounter(TorchDispatchMode):
    """The kernels a GPU would launch: every aten op but views and allocations, and each op
    of `counted` (the Triton kernels, run here by their references) as one launch, whatever
    torch ops its reference runs."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: Counter[str] = Counter()
        self.inside = 0

    def counted(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def launch(*args: Any, **kw: Any) -> Any:
            self.launches[name] += 1
            self.inside += 1
            try:
                return fn(*args, **kw)
            finally:
                self.inside -= 1
        return launch

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        name = func._schema.name.removeprefix("aten::")
        if not self.inside and name not in NO_LAUNCH:
            self.launches[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen3"])
def test_a_decode_step_launches_the_designs_kernels(family, request, monkeypatch):
    """The graph-captured decode forward, its ops recorded on the CPU with the CUDA path's
    kernels each counted as the one launch it is on the GPU: the design's count exactly, so a
    change that adds a launch to every layer fails here (docs/gpu.md)."""
    monkeypatch.setenv("TANDEM_LINEAR", "torch")  # the products as a GPU runs them: one mm
    monkeypatch.setenv("TANDEM_PANELS", "0")
    counter = LaunchCounter()
    kernels = REFERENCE_KERNELS._replace(
        decode=counter.counted("decode_attention", attention_cuda.reference_decode))
    core = cuda_path_engine(request.getfixturevalue(family), monkeypatch, graphs=True,
                            kernels=kernels)
    decoder = core.runner.decoder
    ops = TorchOps()
    counting = type("CountingOps", (), {
        name: staticmethod(counter.counted(name, getattr(ops, name)))
        for name in ("rms_norm", "add_rms_norm", "silu_mul", "rope_and_cache")})()
    for module in decoder.modules():
        if hasattr(module, "kit"):
            module.kit = module.kit._replace(ops=counting)
    assert core.runner.graphs is not None
    counter.launches.clear()  # the captures' own
    with torch.inference_mode(), counter:
        core.runner.graphs._bound(8)()
    layers = decoder.num_layers
    total = sum(counter.launches.values())
    assert total == LAUNCHES_OUTSIDE_LAYERS + LAUNCHES_PER_LAYER * layers, counter.launches
    assert counter.launches["decode_attention"] == counter.launches["rope_and_cache"] == layers


def test_a_step_with_a_host_sync_is_caught(tiny_llama, monkeypatch):
    """The recorder sees what the no-sync test forbids: a forward whose attention reads a
    length on the host."""
    def syncing_decode(q: torch.Tensor, *args: Any) -> torch.Tensor:
        int(args[2].seq_lens.max())  # what the eager metadata does once per step
        return attention_cuda.reference_decode(q, *args)

    kernels = REFERENCE_KERNELS._replace(decode=syncing_decode)
    core = cuda_path_engine(tiny_llama, monkeypatch, graphs=True, kernels=kernels)
    assert core.runner.graphs is not None
    recorder = OpRecorder()
    with torch.inference_mode(), recorder:
        core.runner.graphs._bound(4)()
    assert recorder.ops["_local_scalar_dense"] > 0 or recorder.ops["max"] > 0
    assert any(s in op for op in recorder.ops for s in SYNCING)


# -- Triton's specializations ----------------------------------------------------------------
class SpecializationRecorder:
    """Stands in for a jitted kernel: computes the cache key Triton would compile under for
    sm_90 (its own binder: dtypes, 16-byte alignment, integers equal to 1 or divisible by
    16, constexprs) for every launch, then runs `reference` for the outputs."""

    def __init__(self, name: str, reference: Callable[..., None],
                 kernels: dict[str, Any] = triton_attention.KERNELS) -> None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        triton = pytest.importorskip("triton")
        fn, fixed = kernels[name]
        jitted = triton.jit(fn, do_not_specialize=fixed)
        backend = make_backend(GPUTarget("cuda", 90, 32))
        self.binder = create_function_from_signature(jitted.signature, jitted.params, backend)
        self.keys: Counter[str] = Counter()
        self.reference = reference

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            _, specialization, _ = self.binder(*args, **kwargs)
            self.keys[str(specialization)] += 1
            self.reference(*args, **kwargs)
        return launch


def layer_ops_recorders() -> dict[str, SpecializationRecorder]:
    """Recorders of triton_ops' kernels, each computing its outputs with TorchOps."""
    ref = TorchOps()

    def norm_ref(x, res, w, out, *args: Any, HAS_RES: bool, **kw: Any) -> None:
        eps = args[4]
        out.copy_(ref.add_rms_norm(x.clone(), res, w, eps) if HAS_RES else
                  ref.rms_norm(x, w, eps))

    def silu_ref(x, out, *args: Any, **kw: Any) -> None:
        out.copy_(ref.silu_mul(x))

    def rope_ref(qkv, pos, cos, sin, kc, vc, slots, qw, kw_, scales, *args: Any,
                 **kw: Any) -> None:
        norm = QKNorm(qw, kw_, args[4]) if kw["QK_NORM"] else None
        ref.rope_and_cache(qkv, pos, RotaryTable(cos, sin),
                           HeadShape(kw["HEADS"], kw["KV_HEADS"], kw["HEAD_DIM"]), kc, vc,
                           slots, norm, scales if kw["FP8"] else None)

    return {name: SpecializationRecorder(name, fn, triton_ops.KERNELS)
            for name, fn in (("rms_norm", norm_ref), ("silu_mul", silu_ref),
                             ("rope_cache", rope_ref))}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_no_kernel_compiles_again_once_serving(tiny_qwen3, monkeypatch, kv_cache_dtype):
    """Steps of every shape (prefill chunks in piecewise graphs and eager, decode batches of
    many sizes, graphs and eager, one split and several): each kernel, the attention's and the
    layers' ops', is specialized once. With an fp8 cache too: each layer's row of scales is
    as aligned as the next (fp8_kv.SCALE_WIDTH)."""
    pytest.importorskip("triton")

    def decode_ref(out: torch.Tensor, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                   table: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, *args: Any,
                   **kw: Any) -> None:
        scales = args[2] if kw["FP8"] else None
        out.copy_(triton_attention.paged_decode_reference(q, kc, vc, table, rows, lens,
                                                          args[3], kw["BLOCK_SIZE"],
                                                          scales=scales))

    def combine_ref(out: torch.Tensor, *args: Any, **kw: Any) -> None:
        pass  # the decode reference wrote the whole result

    def write_ref(k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                  slots: torch.Tensor, scales: torch.Tensor, *args: Any, **kw: Any) -> None:
        triton_attention.write_kv_reference(k, v, kc, vc, slots, scales if kw["FP8"] else None)

    recorders = {"decode": SpecializationRecorder("decode", decode_ref),
                 "combine": SpecializationRecorder("combine", combine_ref),
                 "kv_write": SpecializationRecorder("kv_write", write_ref)}
    layer_recorders = layer_ops_recorders()
    monkeypatch.setattr(triton_attention, "_jitted", lambda name: recorders[name])
    monkeypatch.setattr(triton_ops, "_jitted", lambda name: layer_recorders[name])
    monkeypatch.setattr(triton_attention, "available", lambda: True)
    monkeypatch.setattr(Platform, "layer_ops", lambda self: triton_ops.TritonOps())
    kernels = attention_cuda.Kernels(attention_cuda.sdpa_varlen, attention_cuda.triton_decode,
                                     triton_attention.write_kv)
    # a budget that has steps with a prefill both in the piecewise graphs and past them
    core = cuda_path_engine(tiny_qwen3, monkeypatch, graphs=True, kernels=kernels,
                            max_num_batched_tokens=48, kv_cache_dtype=kv_cache_dtype)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_qwen3))
    staggered(core, make_prompts(tokenizer, n=14))
    pieces = core.runner.piecewise
    assert pieces is not None and sum(pieces.replays.values()) > 0
    assert sum(recorders["decode"].keys.values()) > 20
    assert all(sum(r.keys.values()) > 20 for r in layer_recorders.values())
    variants = {"rms_norm": 2}  # the first norm of a step alone, every other with the residual
    for name, recorder in {**recorders, **layer_recorders}.items():
        assert len(recorder.keys) <= variants.get(name, 1), (name, list(recorder.keys))


def test_verification_steps_replay_the_piecewise_graphs(tiny_llama, tokenizer, monkeypatch):
    """Speculative decoding's k + 1 rows a request (tests/engine/test_speculative.py) go
    through the piecewise graphs' stand-in, the same tokens as the plain eager engine."""
    from tests.engine.test_speculative import NGRAM, Oracle

    prompts = make_prompts(tokenizer, n=6)
    plain = cuda_path_engine(tiny_llama, monkeypatch, graphs=False)
    for i, p in enumerate(prompts):
        plain.add_request(f"r{i}", p, SamplingParams(max_tokens=12, temperature=0.0,
                                                     logprobs=2))
    want = run(plain)
    core = cuda_path_engine(tiny_llama, monkeypatch, graphs=True, speculative=NGRAM)
    core.proposer = Oracle(core, {r: c.token_ids for r, c in want.items()})  # type: ignore[assignment]
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=12, temperature=0.0,
                                                    logprobs=2))
    got = run(core)
    assert core.stats().spec_accepted_tokens > 0
    pieces = core.runner.piecewise
    assert pieces is not None and sum(pieces.replays.values()) > 0
    for rid, w in want.items():
        assert got[rid].token_ids == w.token_ids, rid
        assert got[rid].logprobs == pytest.approx(w.logprobs, abs=ATOL), rid
    assert_drained(core)
