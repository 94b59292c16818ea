"""CUDA graphs for decode-only steps: the decoder's whole forward replayed in one launch.

Eagerly, transformers' module tree launches some forty kernels a layer, each from Python; a
graph captured once per batch size replays them all from one call. As vLLM and nano-vllm do:

- one graph per size of a ladder (1, 2, 4, 8, then every 8 up to --max-num-seqs, at most
  512; or --cuda-graph-sizes), captured at start-up, once the KV cache is allocated, largest
  first so that all share one memory pool;
- every graph reads persistent device buffers: input ids, positions, slot mapping, each row's
  row of the persistent block table (input_batch.py) and its context length, int32, all rows
  of one tensor; a step fills a pinned staging copy of it and makes one non-blocking copy;
- a step of B decodes replays the smallest graph of at least B rows: rows past B point at a
  reserved dummy block (their K/V written there, their context that one slot), and their
  hidden states are dropped;
- steps with a prefill chunk, or more decodes than the largest graph, run eagerly, and so does
  every step with --enforce-eager;
- a capture that fails is logged with its reason and the engine runs eagerly: start-up never
  fails because of graphs. Their memory is set aside from the KV cache's budget beforehand
  (`reserve_bytes`) and the real figure logged after the capture;
- under tensor parallelism every rank captures the same sizes in the same order (each capture
  runs the forward, its all-reduces paired across the ranks) and, after each graph, the ranks
  agree (`Agreement`): a failure on any rank leaves every rank without graphs, so that no rank
  replays a graph (whose captured collectives wait for the others) while another runs eagerly.
  A step rank 0 replays, each worker replays at the same size (model_runner.py).

`StandInGraph` replays by running the captured function again, eagerly: the CPU runs every
piece of this bookkeeping (ladder, padding, dummy rows, persistent buffers) that way, and its
tokens must equal the eager path's (tests/engine/test_cuda_graphs.py).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from engine_core.worker.input_batch import StepInputs

log = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512
GRAPH_OVERHEAD_BYTES = 2 << 20  # per graph, beyond the shared pool (measured: docs/gpu.md)
# the persistent buffer's rows; PENDING: a token still on the device, its row in the previous
# step's sampled tokens (-1: none)
IDS, POSITIONS, SLOTS, TABLE_ROWS, SEQ_LENS, PENDING = range(6)

# (input ids [b], positions [b], slot mapping [b], table rows [b], context lengths [b]) ->
# the decoder's final hidden states [b, hidden]
GraphForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                        torch.Tensor]
# this rank's "captured" -> whether every rank's was (tensor parallelism: one MIN all-reduce)
Agreement = Callable[[bool], bool]
GraphFn = Callable[[], torch.Tensor]  # what a graph captures: its output stays in place


def capture_sizes(max_num_seqs: int, given: Sequence[int] | None = None) -> tuple[int, ...]:
    """The ladder of batch sizes: `given` (--cuda-graph-sizes, each at most max_num_seqs), else
    1, 2, 4, 8 and every 8 after, up to max_num_seqs and at most MAX_CAPTURE_SIZE."""
    if given:
        sizes = tuple(sorted({int(s) for s in given if 0 < int(s) <= max_num_seqs}))
        if not sizes:
            log.warning("no --cuda-graph-sizes entry is within --max-num-seqs %d: no CUDA "
                        "graphs, every decode step runs eagerly", max_num_seqs)
        return sizes
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    ladder = [s for s in (1, 2, 4, 8) if s <= top] + list(range(16, top + 1, 8))
    if ladder[-1] < top:
        ladder.append(top)  # the largest batch is never left eager
    return tuple(ladder)


def reserve_bytes(sizes: Sequence[int], step_peak: int, step_tokens: int,
                  overhead: float = 1.0) -> int:
    """Memory set aside for the graphs before the KV cache is sized: the shared pool holds the
    largest graph's activations (the profiled step's peak, per token, at its rows) and each
    graph has some of its own (`overhead` whole-forward graphs' worth per size: the piecewise
    graphs of a size are about one more layer's)."""
    if not sizes:
        return 0
    return int(step_peak * max(sizes) / max(1, step_tokens)
               + GRAPH_OVERHEAD_BYTES * overhead * len(sizes))


class Graph(Protocol):
    def replay(self) -> None: ...


class StandInGraph:
    """Capture and replay, eagerly: the captured function run again at each replay, its output
    copied into the same tensor (as a graph's output stays where the capture put it)."""

    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self.fn = fn
        self.output = fn().clone()

    def replay(self) -> None:
        self.output.copy_(self.fn())


class CudaGraph:
    """torch.cuda.CUDAGraph of `fn`, after a warm-up run on a side stream."""

    def __init__(self, fn: Callable[[], torch.Tensor], pool: Any) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = fn()

    def replay(self) -> None:
        self.graph.replay()


def capture_ladder(sizes: Sequence[int], pieces: Callable[[int], list[GraphFn]],
                   stand_in: bool, what: str, agree: Agreement | None = None
                   ) -> dict[int, list[Graph]]:
    """A graph of each of `pieces(size)` for every size, largest first, in one memory pool
    (`StandInGraph`s with `stand_in`). A failure, here or (`agree`) on another rank, is logged
    and leaves none: `what` then runs eagerly. The ranks agree after each graph, before the
    next one's warm-up runs its collectives: a capture only records them (a failed one has
    paired them already), the warm-up runs them."""
    pool = None if stand_in else torch.cuda.graph_pool_handle()
    graphs: dict[int, list[Graph]] = {}
    for size in sorted(sizes, reverse=True):
        graphs[size] = []
        for fn in pieces(size):
            try:
                graphs[size].append(StandInGraph(fn) if stand_in else CudaGraph(fn, pool))
                ok = True
            except Exception as exc:  # never fail start-up for a graph: run eagerly instead
                log.warning("CUDA graph capture failed (%s: %s); %s run eagerly",
                            type(exc).__name__, exc, what)
                ok = False
            if agree is not None and not agree(ok) and ok:
                log.warning("CUDA graph capture failed on another tensor-parallel rank; %s "
                            "run eagerly on every rank", what)
                ok = False
            if not ok:
                return {}
    return graphs


class GraphRunner:
    """Decode-only steps through captured graphs (see the module docstring)."""

    def __init__(self, sizes: Sequence[int], forward: GraphForward, device: torch.device,
                 pinned: bool, dummy_slot: int, dummy_row: int, stand_in: bool) -> None:
        self.sizes = tuple(sorted(sizes))
        self.forward = forward
        self.stand_in = stand_in
        width = self.sizes[-1]
        self._dummy = np.array([0, 0, dummy_slot, dummy_row, 1, -1], dtype=np.int32)[:, None]
        # two staging copies, used in turn: an overlapped step fills one while the copy out of
        # the other may still be queued
        self.staging = [torch.empty((6, width), dtype=torch.int32, pin_memory=pinned)
                        for _ in range(2)]
        for stage in self.staging:
            stage.numpy()[:] = self._dummy
        self._turn = 0
        self.buffers = self.staging[0].to(device)  # allocated whole: rows 16-byte aligned
        self.graphs: dict[int, Graph] = {}
        self.replays: dict[int, int] = dict.fromkeys(self.sizes, 0)  # per size, for the tests

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def capture(self, agree: Agreement | None = None) -> None:
        """Capture every size (`capture_ladder`; `agree`: the tensor-parallel ranks')."""
        ladder = capture_ladder(self.sizes, lambda size: [self._bound(size)], self.stand_in,
                                "decode steps", agree)
        self.graphs = {size: graphs[0] for size, graphs in ladder.items()}

    def _bound(self, size: int) -> Callable[[], torch.Tensor]:
        b = self.buffers[:, :size]
        return lambda: self.forward(b[IDS], b[POSITIONS], b[SLOTS], b[TABLE_ROWS], b[SEQ_LENS])

    def size_for(self, inputs: StepInputs) -> int | None:
        """The graph a step replays: decode-only and no larger than the largest; else None."""
        batch = len(inputs.num_new)
        if not self.graphs or not inputs.decode_only or batch > self.max_size:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, batch)]

    def run(self, size: int, inputs: StepInputs, slots: np.ndarray,
            previous: torch.Tensor | None) -> torch.Tensor:
        """Replay graph `size` for a decode-only step: the buffers filled (one copy, then the
        tokens still on the device put in place), the graph replayed. Returns the real rows'
        hidden states [B, hidden]."""
        batch = len(inputs.num_new)
        staging = self.staging[self._turn]
        self._turn ^= 1
        stage = staging.numpy()
        stage[:, batch:size] = self._dummy
        stage[IDS, :batch] = np.maximum(inputs.token_ids, 0)
        stage[POSITIONS, :batch] = inputs.starts
        stage[SLOTS, :batch] = slots
        stage[TABLE_ROWS, :batch] = inputs.rows.rows
        stage[SEQ_LENS, :batch] = inputs.starts + 1
        stage[PENDING, :batch] = -1
        stage[PENDING, inputs.pending_rows] = inputs.pending_src
        self.buffers.copy_(staging, non_blocking=staging.is_pinned())
        if len(inputs.pending_rows):
            assert previous is not None, "a placeholder with no step before it"
            src = self.buffers[PENDING, :batch]
            ids = self.buffers[IDS, :batch]
            ids.copy_(torch.where(src >= 0, previous.index_select(0, src.clamp(min=0)).int(),
                                  ids))
        graph = self.graphs[size]
        graph.replay()
        self.replays[size] += 1
        out: torch.Tensor = graph.output  # type: ignore[attr-defined]
        return out[:batch]
