"""The CUDA graphs' ladder and the flags that set it, and the graph runner's padding on the
CPU (its stand-in): what a step of B decodes writes into the persistent buffers."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np
import torch

from engine_core.config import EngineConfig
from engine_core.worker.cuda_graphs import (
    PENDING,
    GraphRunner,
    capture_ladder,
    capture_sizes,
    reserve_bytes,
)
from engine_core.worker.input_batch import StepInputs, StepRows
from engine_core.worker.platform import Platform, graph_sizes
from shared.engine_args import add_engine_args, engine_argv

CUDA = torch.device("cuda")  # only its type is read: no GPU needed


def test_the_ladder_is_vllms():
    assert capture_sizes(1024) == (1, 2, 4, 8, *range(16, 513, 8))
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)  # the largest batch is never eager
    assert capture_sizes(3) == (1, 2, 3)
    assert capture_sizes(64, [48, 1, 200, 8, 8]) == (1, 8, 48)  # --cuda-graph-sizes


def test_graphs_only_on_cuda_and_not_with_enforce_eager():
    config = EngineConfig(model="m")
    assert graph_sizes(config, CUDA, 256) == capture_sizes(256)
    assert graph_sizes(config, torch.device("cpu"), 256) == ()
    assert graph_sizes(EngineConfig(model="m", enforce_eager=True), CUDA, 256) == ()
    given = EngineConfig(model="m", cuda_graph_sizes=(4, 32))
    assert graph_sizes(given, CUDA, 256) == (4, 32)
    assert Platform.detect(EngineConfig(model="m", device="cpu"),
                           environ={"TANDEM_NATIVE": "0"}).cuda_graph_sizes == ()


def test_the_flags_reach_the_engine_process():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--cuda-graph-sizes", "1", "8", "--enforce-eager",
                              "--async-scheduling"])
    argv = engine_argv(args)
    assert argv[argv.index("--cuda-graph-sizes") + 1:][:2] == ["1", "8"]
    assert "--enforce-eager" in argv and "--async-scheduling" in argv
    assert "--async-scheduling" not in engine_argv(parser.parse_args([]))


def test_graph_memory_is_set_aside_by_the_largest_size():
    assert reserve_bytes((), 1 << 30, 2048) == 0
    assert reserve_bytes((1, 8, 512), 1 << 30, 2048) == (1 << 30) // 4 + 3 * (2 << 20)


def test_a_step_of_three_replays_the_graph_of_four_padded_with_the_dummy():
    seen: list[list[torch.Tensor]] = []

    def forward(*buffers: torch.Tensor) -> torch.Tensor:
        seen.append([b.clone() for b in buffers])
        return buffers[0][:, None].float().repeat(1, 2)

    runner = GraphRunner((1, 2, 4), forward, torch.device("cpu"), pinned=False,
                         dummy_slot=99, dummy_row=7, stand_in=True)
    runner.capture()
    assert sorted(runner.graphs) == [1, 2, 4]
    none = np.zeros(0, np.int64)
    rows = StepRows(np.array([3, 0, 5]), none, none, none, none)
    inputs = StepInputs(np.array([10, 4, 0]), np.ones(3, np.int64), np.array([11, -1, 13]),
                        np.array([1]), np.array([2]), rows)
    size = runner.size_for(inputs)
    assert size == 4
    previous = torch.tensor([50, 51, 52])  # the previous step's tokens: row 1's is its [2]
    hidden = runner.run(size, inputs, np.array([30, 40, 50]), previous)
    ids, pos, slots, table_rows, lens = seen[-1]
    assert ids.tolist() == [11, 52, 13, 0] and pos.tolist() == [10, 4, 0, 0]
    assert slots.tolist() == [30, 40, 50, 99] and table_rows.tolist() == [3, 0, 5, 7]
    assert lens.tolist() == [11, 5, 1, 1]
    assert hidden.shape == (3, 2) and hidden[:, 0].tolist() == [11, 52, 13]
    assert runner.replays[4] == 1
    assert runner.buffers[PENDING, :3].tolist() == [-1, 2, -1]
    mixed = inputs._replace(num_new=np.array([1, 2, 1]))
    assert runner.size_for(mixed) is None  # a prefill chunk: eager


def test_a_failed_capture_leaves_the_engine_eager(caplog):
    def broken(*buffers: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("operation not permitted when stream is capturing")

    runner = GraphRunner((1, 2), broken, torch.device("cpu"), pinned=False, dummy_slot=0,
                         dummy_row=0, stand_in=True)
    runner.capture()
    assert not runner.graphs and "capture failed" in caplog.text
    none = np.zeros(0, np.int64)
    inputs = StepInputs(np.zeros(1, np.int64), np.ones(1, np.int64), np.zeros(1, np.int64),
                        none, none, StepRows(none, none, none, none, none))
    assert runner.size_for(inputs) is None


def test_the_ranks_agree_after_every_graph_and_stop_together(caplog):
    """Tensor parallelism: each graph captured is followed by the ranks' agreement, and a
    failure another rank reports leaves this one without graphs, though its own captured."""
    made: list[int] = []
    said: list[bool] = []

    def pieces(size: int) -> list[Callable[[], torch.Tensor]]:
        return [lambda: (made.append(size), torch.zeros(size))[1] for _ in range(3)]

    def other_rank_fails_at_the_fifth(ok: bool) -> bool:
        said.append(ok)
        return ok and len(said) < 5

    ladder = capture_ladder((1, 2), pieces, True, "steps", other_rank_fails_at_the_fifth)
    assert ladder == {} and said == [True] * 5 and made == [2, 2, 2, 1, 1]
    assert "failed on another tensor-parallel rank" in caplog.text
    everyone_ok = capture_ladder((1, 2), pieces, True, "steps", lambda ok: ok)
    assert sorted(everyone_ok) == [1, 2] and all(len(g) == 3 for g in everyone_ok.values())
