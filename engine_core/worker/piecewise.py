"""CUDA graphs for the steps the decode graphs cannot take: every piece of the forward between two
attentions captured once per token count, the attentions run eagerly between them.

A step with a prefill chunk cannot replay a whole-forward graph: its attention depends on how
its tokens split into sequences (varlen chunks, their contexts), which the host decides per
step. Everything else in a model file's layer is a function of the token count alone (norms,
products, SiLU × up, residual adds: rows in, rows out), so, as vLLM's piecewise graphs do,
the forward is cut at each attention (engine_core/models/llama.py: `begin`, `between`, `end`)
and each piece captured per size of a ladder of token counts:

    graph(begin) -> attention 0 -> graph(between 0) -> attention 1 -> ... -> graph(end)

The pieces read and write persistent buffers (token ids, the residual stream, the QKV rows,
the attention's output), all rows of one size, so each attention reads the previous piece's
QKV rows and writes where the next piece reads. A step of T tokens replays the pieces of the
smallest size of at least T: rows past T hold whatever they held (valid token ids, stale
activations); rows are independent through every piece, and no attention reads or writes them,
so their results are dropped. Steps longer than the ladder run eagerly (their GPU time hides
the host's); `--enforce-eager` turns these graphs off with the others. A capture that fails is
logged and the steps run eagerly (on every tensor-parallel rank together, as the decode
graphs': cuda_graphs.py). Every rank replays the same size for a step: it is the step's token
count's, which every rank knows. `StandInGraph` replays by running the piece again: the CPU
checks this bookkeeping's tokens against the eager path (tests/engine/test_cuda_graphs.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import torch

from engine_core.worker.cuda_graphs import Agreement, Graph, GraphFn, capture_ladder

MAX_PIECEWISE_TOKENS = 512  # the ladder's top; longer steps are eager (docs/gpu.md)


def piecewise_sizes(max_tokens: int, top: int = MAX_PIECEWISE_TOKENS) -> tuple[int, ...]:
    """Token counts 8, 16, 24, 32, 48, 64, 96, ...: steps of at most half again, up to
    min(top, max_tokens) (which is on the ladder)."""
    top = min(top, max_tokens)
    sizes = [s for s in (8, 16, 24) if s < top]
    size = 32
    while size < top:
        sizes += [size, size * 3 // 2]
        size *= 2
    return tuple(sorted({s for s in sizes if s < top} | {top}))


class PiecewiseRunner:
    """Steps of a model file (`model`: its decoder's pieces) through captured pieces."""

    def __init__(self, sizes: Sequence[int], model: Any, device: torch.device,
                 dtype: torch.dtype, stand_in: bool) -> None:
        self.sizes = tuple(sorted(sizes))
        self.model = model
        self.stand_in = stand_in
        rows = self.sizes[-1]
        first = model.layer(0).self_attn.shape
        hidden = model.config.hidden_size
        self.ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.residual = torch.zeros(rows, hidden, dtype=dtype, device=device)
        self.qkv = torch.zeros(rows, first.qkv_width, dtype=dtype, device=device)
        self.attended = torch.zeros(rows, first.heads, first.head_dim, dtype=dtype,
                                    device=device)
        self.graphs: dict[int, list[Graph]] = {}
        self.replays: dict[int, int] = dict.fromkeys(self.sizes, 0)  # per size, for the tests

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def pieces(self, size: int) -> list[GraphFn]:
        """What each graph of `size` runs, in order: begin, between 0 .. L-2, end."""
        model, n = self.model, size
        ids, residual, qkv = self.ids[:n], self.residual[:n], self.qkv[:n]
        attended = self.attended[:n].view(n, -1)

        def between(i: int) -> GraphFn:
            return lambda: model.between(i, attended, residual, qkv)

        return ([lambda: model.begin(ids, residual, qkv)[1]]
                + [between(i) for i in range(model.num_layers - 1)]
                + [lambda: model.end(attended, residual)])

    def capture(self, agree: Agreement | None = None) -> None:
        """Every size's pieces (`capture_ladder`, one shared pool; `agree`: the
        tensor-parallel ranks', whose pieces' all-reduces pair up piece by piece)."""
        self.graphs = capture_ladder(self.sizes, self.pieces, self.stand_in,
                                     "steps with a prefill", agree)

    def size_for(self, tokens: int) -> int | None:
        """The size a step of `tokens` tokens replays, or None (eager)."""
        if not self.graphs or tokens > self.max_size:
            return None
        return self.sizes[bisect.bisect_left(self.sizes, tokens)]

    def run(self, size: int, ids: torch.Tensor, positions: torch.Tensor, meta: Any
            ) -> torch.Tensor:
        """The forward of a step's `ids` [T] at `positions` through the pieces of `size`:
        the final hidden states [T, hidden]."""
        tokens = len(ids)
        self.ids[:tokens].copy_(ids)
        graphs = self.graphs[size]
        qkv, attended = self.qkv[:tokens], self.attended[:tokens]
        graphs[0].replay()
        for i in range(self.model.num_layers):
            self.model.attention(i, qkv, positions, meta, attended)
            graphs[i + 1].replay()
        self.replays[size] += 1
        out: torch.Tensor = graphs[-1].output  # type: ignore[attr-defined]
        return out[:tokens]
