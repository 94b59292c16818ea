"""--tensor-parallel-size N: the engine process is rank 0, N - 1 worker processes the others.

Every rank runs the same `ModelRunner` on its shard of the weights (engine_core/layers/
parallel.py) and holds its own heads' KV cache; the engine's scheduler and sampler run on rank
0 only; every worker runs rank 0's platform (`Platform.ship`). A step reaches the workers
once: rank 0 broadcasts one header (with the decode graph it replays) and one packed int64
buffer (the step's token ids, starts, new-token counts, rows kept for the head, the rows whose
token is still on the device, and the block table's rows of its sequences), plus, for an
overlapped step with such rows, the previous step's sampled tokens from the device; then every
rank runs the forward (the same graph, or eagerly), whose all-reduces sync the ranks twice a
layer. Each LM-head scan on rank 0 broadcasts the hidden rows it scores so the workers compute
their vocabulary columns for the all-gather. The step's tokens are rank 0's. At start-up the
ranks agree on each captured graph (`StepChannel.all_agree`, cuda_graphs.capture_ladder).

The control broadcasts run on a gloo group (host memory, like vLLM's shared-memory queue);
the model's collectives on the default group: gloo on the CPU, NCCL on CUDA. A worker that
exits takes the engine down at once (a watcher thread), so every stream ends with an error
and the launcher's rules apply; one that hangs fails rank 0's next collective after
`COLLECTIVE_TIMEOUT`.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import os
import socket
import threading
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from engine_core.config import EngineConfig
from engine_core.layers.parallel import TensorParallel
from engine_core.worker.platform import Platform, ShippedPlatform

log = logging.getLogger(__name__)
COLLECTIVE_TIMEOUT = timedelta(seconds=float(os.environ.get("TANDEM_TP_TIMEOUT_S", "60")))
_STEP, _HEAD, _STOP, _REPORT = 1, 2, 3, 4
_HEADER = 12
# a step's 1-D arrays: starts, num_new, token ids, rows kept for the head, and the rows whose
# token is still on the device with their rows in the previous step's sampled tokens
_ARRAYS = 6


class GraphCounts(NamedTuple):
    """A rank's graphs: how many sizes are captured and how often they were replayed, of the
    decode graphs and of the piecewise ones."""

    decode_sizes: int
    decode_replays: int
    piecewise_sizes: int
    piecewise_replays: int


class StepCommand(NamedTuple):
    """What a worker is told to do: a step's forward (its packed inputs; `graph`, the decode
    graph's size rank 0 replays, 0 for an eager step; `previous`, the previous step's sampled
    tokens where the step has placeholders), an LM-head scan (`hidden`, the rows rank 0
    scores), a report of its graphs' counts, or stop."""

    kind: int
    arrays: tuple[np.ndarray, ...] = ()
    hidden: torch.Tensor | None = None
    graph: int = 0
    previous: torch.Tensor | None = None

    @property
    def asks_counts(self) -> bool:
        return self.kind == _REPORT


class StepChannel:
    """Rank 0's broadcasts to the workers, and the workers' side of them."""

    def __init__(self, control: Any, device: torch.device) -> None:
        self.control, self.device = control, device

    def send_step(self, arrays: list[np.ndarray], graph: int = 0,
                  previous: torch.Tensor | None = None) -> None:
        """The step's packed inputs (1-D int64 arrays; the last may be 2-D, sent flat with
        its width), the decode graph it replays (0: none) and, where it has placeholders, the
        previous step's sampled tokens: broadcast on the default group from the device (NCCL
        on CUDA: no host sync), after the control group's two."""
        *flat, table = arrays
        assert len(flat) == _ARRAYS
        sizes = [len(a) for a in flat] + [table.shape[0], table.shape[1], graph,
                                          -1 if previous is None else len(previous)]
        header = torch.tensor([_STEP, *sizes] + [0] * (_HEADER - 1 - len(sizes)))
        payload = np.concatenate([*flat, table.ravel()]).astype(np.int64)
        dist.broadcast(header, 0, group=self.control)
        dist.broadcast(torch.from_numpy(payload), 0, group=self.control)
        if previous is not None:
            dist.broadcast(previous.to(self.device, torch.int64).contiguous(), 0)

    def send_head(self, hidden: torch.Tensor) -> None:
        header = torch.tensor([_HEAD, *hidden.shape] + [0] * (_HEADER - 3))
        dist.broadcast(header, 0, group=self.control)
        dist.broadcast(hidden.contiguous(), 0)

    def send_stop(self) -> None:
        self._send(_STOP)

    def _send(self, kind: int) -> None:
        dist.broadcast(torch.tensor([kind] + [0] * (_HEADER - 1)), 0, group=self.control)

    def ask_counts(self, own: GraphCounts) -> list[GraphCounts]:
        """Every rank's `GraphCounts`, rank 0's (`own`) first: the workers answer at once."""
        self._send(_REPORT)
        return [GraphCounts(*row) for row in self._gather(own)]

    def answer_counts(self, own: GraphCounts) -> None:
        self._gather(own)

    def _gather(self, own: GraphCounts) -> list[list[int]]:
        rows = [torch.zeros(len(own), dtype=torch.int64)
                for _ in range(dist.get_world_size(self.control))]
        dist.all_gather(rows, torch.tensor(own, dtype=torch.int64), group=self.control)
        return [r.tolist() for r in rows]

    def all_agree(self, ok: bool) -> bool:
        """Whether `ok` holds on every rank (each rank says its own; one MIN all-reduce)."""
        flag = torch.tensor([int(ok)])
        dist.all_reduce(flag, dist.ReduceOp.MIN, group=self.control)
        return bool(flag)

    def smallest(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        least = torch.tensor([value])
        dist.all_reduce(least, dist.ReduceOp.MIN, group=self.control)
        return int(least)

    def receive(self, dtype: torch.dtype) -> StepCommand:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        dist.broadcast(header, 0, group=self.control)
        kind, *sizes = header.tolist()
        if kind == _HEAD:
            hidden = torch.empty(sizes[0], sizes[1], dtype=dtype, device=self.device)
            dist.broadcast(hidden, 0)
            return StepCommand(kind, hidden=hidden)
        if kind != _STEP:
            return StepCommand(kind)
        flat, (rows, width, graph, previous_len) = sizes[:_ARRAYS], sizes[_ARRAYS:_ARRAYS + 4]
        payload = torch.empty(sum(flat) + rows * width, dtype=torch.int64)
        dist.broadcast(payload, 0, group=self.control)
        parts = np.split(payload.numpy(), np.cumsum(flat))
        previous = None
        if previous_len >= 0:
            previous = torch.empty(previous_len, dtype=torch.int64, device=self.device)
            dist.broadcast(previous, 0)
        return StepCommand(kind, (*parts[:-1], parts[-1].reshape(rows, width)), graph=graph,
                           previous=previous)


class Rank(NamedTuple):
    tp: TensorParallel
    channel: StepChannel


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join_group(rank: int, size: int, port: int, device: torch.device) -> Rank:
    """This process's place in the group: the model's collectives on NCCL (CUDA) or gloo, the
    step broadcasts on a gloo group."""
    cuda = device.type == "cuda"
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(device)
    # (on CUDA, `device_id` makes NCCL's communicator now, not at the first collective: a
    # communicator cannot be created inside a graph's capture)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=COLLECTIVE_TIMEOUT,
                            device_id=device if cuda else None)
    control = dist.new_group(backend="gloo") if backend != "gloo" else None
    return Rank(TensorParallel(rank, size), StepChannel(control, device))


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: GPU r of those the engine sees (CUDA_VISIBLE_DEVICES), or the CPU."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


class Workers:
    """Rank 0's view of the group: the worker processes, watched, and its own `Rank`."""

    def __init__(self, config: EngineConfig, platform: Platform, problem: str | None,
                 runner: Any) -> None:
        """`problem`: why the model cannot be split so (start-up error), or None; `runner`:
        the class each worker runs (the `ModelRunner`, which imports this module). Each worker
        runs rank 0's `platform` (`Platform.ship`), on its own device."""
        size = config.tensor_parallel_size
        device = platform.device
        if problem is not None:
            raise ValueError(problem)
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"--tensor-parallel-size {size} needs {size} GPUs, one per rank; "
                             f"this engine sees {torch.cuda.device_count()} "
                             "(CUDA_VISIBLE_DEVICES)")
        port = _free_port()
        ctx = mp.get_context("spawn")
        shipped = platform.ship()
        self.procs = [ctx.Process(target=worker_main,
                                  args=(runner, config, shipped, r, size, port),
                                  name=f"tandem-tp-{r}", daemon=True) for r in range(1, size)]
        for p in self.procs:
            p.start()
        self.stopping = False
        atexit.register(self.stop)  # before multiprocessing's own exit handler ends them
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()
        self.rank = join_group(0, size, port, rank_device(device, 0))
        log.info("tensor parallel: %d ranks (%s), workers pids %s", size,
                 dist.get_backend(), [p.pid for p in self.procs])

    def _watch(self) -> None:
        """Take the engine down the moment a worker exits: rank 0 may be waiting in a
        collective the worker will never join."""
        ready = wait([p.sentinel for p in self.procs])
        if self.stopping:
            return
        dead = next(p for p in self.procs if p.sentinel in ready)
        log.error("tensor-parallel worker %s (pid %s) exited with code %s: the engine stops",
                  dead.name, dead.pid, dead.exitcode)
        logging.shutdown()
        os._exit(3)

    def stop(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        try:
            self.rank.channel.send_stop()
        except Exception:  # a worker already gone: nothing to tell it
            pass
        for p in self.procs:
            p.join(timeout=5)
        if dist.is_initialized():
            dist.destroy_process_group()


def worker_main(runner: Callable[..., Any], config: EngineConfig, shipped: ShippedPlatform,
                rank: int, size: int, port: int) -> None:
    """A worker process: rank `rank` joins the group, builds its runner (`runner`, the
    `ModelRunner` class) on rank 0's platform (`shipped`, on this rank's device) and serves
    rank 0's broadcasts until told to stop (or until rank 0 is gone, which fails its next
    collective)."""
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s tp-worker{rank}[{os.getpid()}] %(levelname)s "
                               "%(name)s: %(message)s")
    platform = shipped.load(rank_device(shipped.platform.device, rank))
    platform.apply()
    joined = join_group(rank, size, port, platform.device)
    try:
        runner(config, platform, joined).serve_rank_zero()
    finally:
        dist.destroy_process_group()
