"""The bare model's loop, the anchor the engine is measured against: transformers' model with
a `StaticCache`, one batched prefill, then one forward + argmax per token, its decode step
captured once as a graph and replayed; and the check that the replays compute what the same
step computes eagerly.

Why free-running agreement alone says little in bf16: the checked model has random weights and
nearly flat logits (its top two are often within one bf16 rounding step), so any difference of
kernels between the eager loop and the captured one (cuBLAS may pick another algorithm on
another stream) flips a near-tie now and then, and from there the two sequences part for good.
On the H200 two free-running bf16 loops agreed on 32% of their tokens, although the capture's
bookkeeping is right: the same loop replayed op by op on the CPU (`TraceGraph`) gives the eager
tokens exactly. So `replay_check` also compares step by step (`lockstep`): from the same state,
the eager step, then (the state put back) the replay, their logits and their argmax. The
verdict (`replays_eager`) is taken in float32, where the replay must give the eager tokens
free running and step by step (a wrong position, a stale cache slot, a constant baked into the
capture or warm-ups left in the state show there at once); in the device's dtype the logits
must agree within its rounding, and the figures are recorded.

Where there is no GPU (the dry run), the graph is `TraceGraph`: the aten ops of one run of the
step recorded and replayed as a CUDA graph replays its kernels, with every Python value and
every tensor the step made during the capture fixed, so a loop that is wrong under capture is
wrong here too.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from transformers import StaticCache

WARMUPS = 2  # eager runs of the step before its capture (on a side stream on the GPU)
# The verdict (`replays_eager`). float32 rounds at ~1e-7, so its logits differ by ~1e-6 at most
# between two orders of summation, and a near-tie flips about once in 1e4-1e5 rows: over 64 rows
# x 127 steps maybe once, and free running that one row then parts for good (up to 1/64 of the
# tokens), hence 0.9 there; warm-ups left in the state part every row at once. A capture that
# is wrong (a position, a cache slot, a stale input) moves the logits by 1e-3 or more. bf16
# rounds at ~4e-3: a few of those through 16 layers stay under 0.1, a wrong capture is off by ~1.
EXACT_FREE_RUNNING = 0.9
EXACT_LOCKSTEP = 0.999
EXACT_REL_ERROR = 1e-4
SERVED_REL_ERROR = 0.1


class Graph(Protocol):
    output: torch.Tensor

    def replay(self) -> None: ...


class CudaGraph:
    """`step` as a torch.cuda.CUDAGraph, warmed up on a side stream; `output` is the tensor
    the capture returned, rewritten by each replay."""

    def __init__(self, step: Callable[[], torch.Tensor]) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUPS):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.output = step()

    def replay(self) -> None:
        self.graph.replay()


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, Any, Any, Any]] = []
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func._schema.name in ("aten::_local_scalar_dense", "aten::nonzero"):
            self.syncs.append(func._schema.name)
        self.ops.append((func, args, kwargs, out))  # keeps every tensor alive: ids stay unique
        return out


class TraceGraph:
    """A CUDA graph's semantics without a GPU: the warm-ups and one recorded run of `step` at
    capture; each replay runs the recorded aten ops again, with the same Python values, on the
    same outside tensors (weights, cache, inputs) and on fresh copies of the tensors the step
    itself made. A step that reads a value on the host (`.item()`, `nonzero`) fails here, as its
    capture would on the GPU."""

    def __init__(self, step: Callable[[], torch.Tensor]) -> None:
        for _ in range(WARMUPS):
            step()
        recorder = _Recorder()
        with recorder:
            result = step()
        if recorder.syncs:
            raise RuntimeError(f"the step reads the device on the host ({recorder.syncs[0]}): "
                               "it cannot be captured")
        self.ops = recorder.ops
        self._result = result
        self.output = result.clone()

    def replay(self) -> None:
        made: dict[int, torch.Tensor] = {}

        def fresh(value: Any) -> Any:
            return made.get(id(value), value) if isinstance(value, torch.Tensor) else value

        for func, args, kwargs, out in self.ops:
            new = func(*tree_map(fresh, args), **tree_map(fresh, kwargs))
            olds = out if isinstance(out, (tuple, list)) else (out,)
            news = new if isinstance(new, (tuple, list)) else (new,)
            for old, value in zip(olds, news):
                if isinstance(old, torch.Tensor):
                    made[id(old)] = value
        self.output.copy_(made[id(self._result)])


class StaticLoop:
    """Greedy decoding of `prompts` (all one length) with transformers' model and a
    StaticCache. `step()` is the decode step a graph captures: it reads the last token and the
    positions from static tensors, writes the next token and advances the positions in place,
    and returns the step's logits [batch, vocab]."""

    def __init__(self, model: Any, prompts: list[list[int]], output_len: int) -> None:
        self.model = model
        self.ids = torch.tensor(prompts, device=model.device)
        batch, length = self.ids.shape
        # room for the capture's warm-ups too: a loop that forgets to put them back must fail
        # the check, not write past the cache (on the GPU, a device-side assert)
        self.cache = StaticCache(config=model.config,
                                 max_cache_len=length + output_len + WARMUPS + 2)
        self.cache_arg = {_cache_kwarg(model): self.cache}
        self.token = torch.zeros((batch, 1), dtype=torch.long, device=model.device)
        self.positions = torch.full((batch, 1), length, dtype=torch.long, device=model.device)

    def prefill(self) -> torch.Tensor:
        logits = self.model(input_ids=self.ids, use_cache=True, logits_to_keep=1,
                            **self.cache_arg).logits[:, -1]
        self.token.copy_(logits.argmax(-1, keepdim=True))
        return logits

    def step(self) -> torch.Tensor:
        logits = self.model(input_ids=self.token, position_ids=self.positions, use_cache=True,
                            **self.cache_arg).logits[:, -1]
        self.token.copy_(logits.argmax(-1, keepdim=True))
        self.positions.add_(1)
        return logits

    def state(self) -> list[torch.Tensor]:
        """What a step advances besides the cache's contents: the token, the positions and the
        cache's lengths (on the device, `StaticLayer.cumulative_length`)."""
        lengths = [layer.cumulative_length for layer in self.cache.layers]
        return [self.token, self.positions, *lengths]


def capture(loop: StaticLoop) -> Graph:
    """The loop's step as a graph (CUDA's, or `TraceGraph` on the CPU). The warm-ups advance
    the loop's state: it is put back, so the replays go on from where the prefill left it."""
    saved = [t.clone() for t in loop.state()]
    graph: Graph = CudaGraph(loop.step) if loop.ids.is_cuda else TraceGraph(loop.step)
    for tensor, value in zip(loop.state(), saved):
        tensor.copy_(value)
    return graph


@torch.inference_mode()
def timed_loop(model: Any, prompts: list[list[int]], output_len: int,
               graphs: bool) -> tuple[dict[str, float], torch.Tensor]:
    """The loop's figures (prefill, decode, tok/s) and its greedy tokens [batch, output_len],
    the decode steps replayed from a graph when `graphs`."""
    loop = StaticLoop(model, prompts, output_len)
    sync = torch.cuda.synchronize if loop.ids.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    loop.prefill()
    sync()
    prefill_s = time.perf_counter() - start
    run: Callable[[], object] = capture(loop).replay if graphs else loop.step
    history = [loop.token.clone()]
    sync()
    start = time.perf_counter()
    for _ in range(output_len - 1):
        run()
        history.append(loop.token.clone())
    sync()
    decode_s = time.perf_counter() - start
    batch = len(prompts)
    figures = {"prefill_s": prefill_s, "decode_s": decode_s,
               "tok_s": batch * output_len / (prefill_s + decode_s),
               "decode_tok_s": batch * (output_len - 1) / decode_s if decode_s else 0.0}
    return figures, torch.cat(history, dim=1)


def replay_check(model: Any, prompts: list[list[int]], steps: int,
                 free_running: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, Any]:
    """How well the graph's replays reproduce the eager step, two ways. Free running: the
    eager loop's tokens against the replayed loop's (`free_running`: both, when already run),
    the share equal and where each row first parts. Step by step (`lockstep`): from the same
    state, the eager step, then (state put back) the replay: the share of rows whose argmax
    agrees and the largest relative difference of a row's logits."""
    if free_running is None:
        free_running = (timed_loop(model, prompts, steps + 1, graphs=False)[1],
                        timed_loop(model, prompts, steps + 1, graphs=True)[1])
    eager, replayed = free_running
    same = eager == replayed
    parted = (~same).float().argmax(-1).where(~same.all(-1), same.shape[-1])
    return {"dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "free_running_agreement": float(same.float().mean()),
            "first_parting_median": float(parted.float().median()),
            **lockstep(model, prompts, steps)}


@torch.inference_mode()
def lockstep(model: Any, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    loop = StaticLoop(model, prompts, steps + 1)
    loop.prefill()
    graph = capture(loop)
    agree = total = 0
    worst = 0.0
    disagreements: list[dict[str, Any]] = []
    for k in range(steps):
        saved = [t.clone() for t in loop.state()]
        eager = loop.step().float()
        for tensor, value in zip(loop.state(), saved):
            tensor.copy_(value)
        graph.replay()
        replayed = graph.output.float()
        want, got = eager.argmax(-1), replayed.argmax(-1)
        same = want == got
        agree += int(same.sum())
        total += same.numel()
        error = (replayed - eager).norm(dim=-1) / eager.norm(dim=-1).clamp_min(1e-30)
        worst = max(worst, float(error.max()))
        for row in (~same).nonzero().flatten().tolist()[:3 - len(disagreements)]:
            disagreements.append({
                "step": k, "row": row, "eager": int(want[row]), "replay": int(got[row]),
                "eager_logit_gap": float(eager[row, want[row]] - eager[row, got[row]])})
    return {"steps": steps, "rows": len(prompts), "lockstep_agreement": agree / max(total, 1),
            "max_rel_logit_error": worst, "disagreements": disagreements,
            "graph": "cuda" if loop.ids.is_cuda else "trace stand-in"}


def replays_eager(exact: dict[str, Any], served: dict[str, Any]) -> bool:
    """The verdict on the graph loop: in float32 (`exact`) the replays give the eager tokens,
    free running and step by step, and logits equal to float32's precision; in the device's
    dtype (`served`) logits within its rounding (a wrong capture is off by ~1, not ~1e-2)."""
    return (exact["free_running_agreement"] >= EXACT_FREE_RUNNING
            and exact["lockstep_agreement"] >= EXACT_LOCKSTEP
            and exact["max_rel_logit_error"] <= EXACT_REL_ERROR
            and served["max_rel_logit_error"] <= SERVED_REL_ERROR)


def _cache_kwarg(model: Any) -> str:
    """transformers renamed `past_key_values` to `cache` (5.17 has the old name, 5.24 the new)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else \
        "past_key_values"
