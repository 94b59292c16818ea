"""--tensor-parallel-size 2 on the CUDA path's code (the CPU, gloo: attention with the reference
kernels, the stand-ins of the decode and piecewise graphs, tests/engine/test_cuda_graphs.py):

- both ranks capture the same graphs and replay them in lockstep, the worker as often as rank
  0 (each rank counts its own, `ModelRunner.graph_counts_of_every_rank`), and the tokens and
  logprobs are Hugging Face's;
- overlapped steps (--async-scheduling): a step whose decodes read the previous step's tokens
  on the device sends the workers those tokens (a broadcast from rank 0), and the tokens are
  Hugging Face's: a worker that filled its placeholders wrongly would write wrong K/V for its
  heads and the next tokens would differ;
- a graph capture that fails on rank 0 only leaves both ranks without those graphs.

The workers run rank 0's platform (`Platform.ship`): the CUDA path here only because rank 0
was given it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import engine_core.worker.cuda_graphs as cuda_graphs
from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from engine_core.worker.tensor_parallel import GraphCounts, StepChannel
from shared.messages import SamplingParams
from tests.engine.driver import Collected, run
from tests.engine.test_cuda_graphs import cuda_path_engine
from tests.engine.test_hf_parity import ATOL, MAX_NEW, Reference, assert_drained, make_prompts

LADDER = 5  # capture_sizes(16): 1, 2, 4, 8, 16; piecewise_sizes(40): 8, 16, 24, 32, 40


@pytest.fixture
def engines() -> Iterator[list[EngineCore]]:
    """The engines a test starts, their workers stopped after it whatever happened."""
    started: list[EngineCore] = []
    yield started
    for core in started:
        if core.runner.workers is not None:
            core.runner.workers.stop()


def tp_engine(engines: list[EngineCore], model: Any, monkeypatch: pytest.MonkeyPatch,
              **kw: Any) -> EngineCore:
    core = cuda_path_engine(model, monkeypatch, graphs=True, tensor_parallel_size=2,
                            max_num_batched_tokens=40, **kw)
    engines.append(core)
    assert core.runner.workers is not None and core.runner.kv_shape.kv_heads == 1
    return core


def staggered(core: EngineCore, prompts: list[list[int]]) -> dict[str, Collected]:
    """Greedy requests of 2 to 10 tokens (decode batches shrink through the ladder), three
    more added at the fourth step (steps with a prefill between the decodes)."""
    late = prompts[-3:]
    for i, p in enumerate(prompts[:-3]):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=2 + i % (MAX_NEW - 1),
                                                    temperature=0.0, logprobs=5))

    def add_late(engine: EngineCore, steps: int) -> None:
        if steps == 4:
            for j, p in enumerate(late):
                engine.add_request(f"r{len(prompts) - 3 + j}", p, SamplingParams(
                    max_tokens=MAX_NEW, temperature=0.0, logprobs=5))

    return run(core, on_step=add_late)


def assert_hf_prefixes(results: dict[str, Collected], prompts: list[list[int]],
                       reference: Reference) -> None:
    """Each request's tokens are the start of Hugging Face's greedy ones, their logprobs
    within the parity tolerance."""
    for i, p in enumerate(prompts):
        got = results[f"r{i}"]
        tokens, lps = reference.generate(p)
        n = len(got.token_ids)
        assert n >= 2 and got.token_ids == tokens[:n], f"prompt {i}: tokens differ from HF"
        assert got.logprobs == pytest.approx(lps[:n], abs=ATOL), f"prompt {i}: logprobs differ"


def counts(core: EngineCore) -> tuple[GraphCounts, GraphCounts]:
    rank0, worker = core.runner.graph_counts_of_every_rank()
    return rank0, worker


def test_both_ranks_replay_the_graphs_in_lockstep(tiny_llama, tokenizer, reference,
                                                  monkeypatch, engines):
    core = tp_engine(engines, tiny_llama, monkeypatch)
    prompts = make_prompts(tokenizer, n=12)
    results = staggered(core, prompts)
    assert_hf_prefixes(results, prompts, reference)
    rank0, worker = counts(core)
    assert rank0 == worker, (rank0, worker)  # the same sizes captured, as many replays
    assert rank0.decode_sizes == rank0.piecewise_sizes == LADDER, rank0
    assert rank0.decode_replays > 0 and rank0.piecewise_replays > 0, rank0
    # every step in graphs (none larger than the ladders), on both ranks
    assert rank0.decode_replays + rank0.piecewise_replays == core.counts.steps
    graphs = core.runner.graphs
    assert graphs is not None and len({s for s, n in graphs.replays.items() if n}) >= 3
    assert_drained(core)


@pytest.mark.parametrize("path", ["cuda", "cpu"])
def test_overlapped_steps_send_their_placeholders_tokens(path, tiny_llama, tokenizer, reference,
                                                         monkeypatch, engines):
    """On the CUDA path's code (decode graphs with placeholders, piecewise and eager steps
    with them), and on the CPU's own path (eager steps, its own attention and kernels)."""
    sent: list[bool] = []
    real = StepChannel.send_step

    def spy(self: StepChannel, arrays: Any, graph: int = 0, previous: Any = None) -> None:
        sent.append(previous is not None)
        real(self, arrays, graph, previous)

    monkeypatch.setattr(StepChannel, "send_step", spy)
    if path == "cuda":
        core = tp_engine(engines, tiny_llama, monkeypatch, async_scheduling=True)
    else:
        core = EngineCore(EngineConfig(model=str(tiny_llama), num_kv_blocks=64, block_size=8,
                                       max_num_batched_tokens=40, tensor_parallel_size=2,
                                       async_scheduling=True))
        engines.append(core)
        assert core.platform.attention != "cuda" and core.runner.graphs is None
    assert core.async_scheduling
    prompts = make_prompts(tokenizer, n=12)
    results = staggered(core, prompts)
    assert_hf_prefixes(results, prompts, reference)
    assert sum(sent) >= len(sent) // 2, sent  # most steps read the previous step's tokens
    rank0, worker = counts(core)
    assert rank0 == worker, (rank0, worker)
    assert (rank0.decode_replays > 0) == (path == "cuda"), rank0
    assert_drained(core)


class FailingOnRankZero(cuda_graphs.StandInGraph):
    """The `fail_at`-th capture fails after its forward ran (its collectives paired, as after
    a CUDA graph's warm-up: its capture only records them), on rank 0 alone (the workers are
    spawned processes). Rank 0 captures the decode graphs first, then the pieces."""

    made = 0
    fail_at = 0

    def __init__(self, fn: Any) -> None:
        super().__init__(fn)
        FailingOnRankZero.made += 1
        if FailingOnRankZero.made == FailingOnRankZero.fail_at:
            raise RuntimeError("capture failed on this rank only")


@pytest.mark.parametrize("kind", ["decode", "piecewise"])
def test_a_capture_that_fails_on_one_rank_leaves_every_rank_eager(
        kind, tiny_llama, tokenizer, reference, monkeypatch, engines):
    # the second decode graph, or the second piece of the first piecewise size
    FailingOnRankZero.made, FailingOnRankZero.fail_at = 0, 2 if kind == "decode" else LADDER + 2
    monkeypatch.setattr(cuda_graphs, "StandInGraph", FailingOnRankZero)
    core = tp_engine(engines, tiny_llama, monkeypatch)
    rank0, worker = counts(core)
    failed = "decode_sizes" if kind == "decode" else "piecewise_sizes"
    kept = "piecewise_sizes" if kind == "decode" else "decode_sizes"
    assert getattr(rank0, failed) == getattr(worker, failed) == 0, (rank0, worker)
    assert getattr(rank0, kept) == getattr(worker, kept) == LADDER, (rank0, worker)
    prompts = make_prompts(tokenizer, n=6)
    results = staggered(core, prompts)
    assert_hf_prefixes(results, prompts, reference)
    rank0, worker = counts(core)
    assert rank0 == worker, (rank0, worker)
    assert_drained(core)
