"""The engine's host time per decode step, with the model's forward and the LM head stubbed.

    .venv/bin/python tests/bench/engine_host_overhead.py [--batches 64,256,1024] [--steps 60]
        [--repeats 3] [--async-scheduling] [--cuda-path]

What the GPU would wait for if nothing overlapped the host's work: the engine runs in-process
on the tiny default model, its decoder replaced by a stub that returns hidden states of the
right shape at no cost and its sampler's LM head by a 32-token one (the host work of sampling,
`SamplingBatch` and the rest, is kept; its arithmetic is not). Every request is prefilled
first; then decode-only steps at each batch size are timed. Each phase is timed by wrapping the
engine's own methods:

- schedule: `Scheduler.schedule`
- prepare: `ModelRunner.execute` (the step's inputs and attention metadata; the forward is
  the stub)
- sample: the step's `SamplingBatch` built, and the sampler's call (its host bookkeeping; the
  head is the stub's)
- update: the scheduler's record of the step (`advance` and `resolve`)
- pack: `StepNews.pack` (one `StepOutputs` per frontend)
- other: the rest of `EngineCore.step`

By default the engine runs the CPU's own path; `--cuda-path` runs the GPU's code instead, as
far as the CPU can (the CUDA attention's metadata, the persistent buffers and the CUDA-graph
runner's stand-in for decode batches up to 512, its forward stubbed the same way).

Figures are medians over the timed steps of the best of `--repeats` runs, in ms of wall time
(on a loaded machine, compare the thread CPU time column too). The last line is one JSON
object: {"batch_64_host_ms": ..., "batch_256_host_ms": ..., "batch_1024_host_ms": ...}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import engine_core.engine as engine_module
from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from engine_core.outputs import StepNews
from engine_core.sample.device_sampler import DeviceSampler, HeadWeights
from engine_core.worker.cuda_graphs import GraphRunner, capture_sizes
from engine_core.worker.default_model import ensure_model
from engine_core.worker.platform import Platform
from shared.messages import SamplingParams

PHASES = ("schedule", "prepare", "sample", "update", "pack")
STUB_VOCAB = 32
PROMPT_LEN = 8


class PhaseClock:
    """Wall and thread-CPU time spent in each wrapped method during the current step."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    def reset(self) -> None:
        self.wall = dict.fromkeys(PHASES, 0.0)

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        inner: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.wall[phase] += time.perf_counter() - start

        setattr(owner, name, timed)


def stub_model(core: EngineCore, cuda_path: bool = False) -> None:
    """The decoder returns zeros of the right shape; the sampler's head is a 512-token one."""
    runner = core.runner
    hidden = runner.hf_config.hidden_size
    zeros = torch.zeros(1, 16384, hidden)

    def decoder(ids: torch.Tensor, *_: Any) -> torch.Tensor:
        return zeros[0, :len(ids)]

    runner.decoder = decoder  # type: ignore[assignment]
    if cuda_path:  # the graph runner's stand-in, over the stub
        runner.graphs = GraphRunner(capture_sizes(core.platform.max_num_seqs),
                                    lambda ids, *_: zeros[0, :len(ids)], runner.device,
                                    pinned=False, dummy_slot=0,
                                    dummy_row=runner.tables.dummy_row, stand_in=True)
        runner.graphs.capture()
    head = HeadWeights(torch.randn(STUB_VOCAB, hidden) * 0.01)
    assert isinstance(core.sampler, DeviceSampler)
    core.sampler.weights = head
    core.sampler.vocab = STUB_VOCAB


def make_engine(batch: int, async_scheduling: bool, cuda_path: bool = False) -> EngineCore:
    extra: dict[str, Any] = {"async_scheduling": True} if async_scheduling else {}
    config = EngineConfig(model=str(ensure_model()), max_num_seqs=batch,
                          max_num_batched_tokens=max(2048, batch * PROMPT_LEN),
                          num_kv_blocks=batch * 8 + 64, num_threads=1, **extra)
    # the device sampler: the one a GPU runs, whose host work is what this measures
    platform = Platform.detect(config, environ={**os.environ, "TANDEM_SAMPLER": "device"})
    if cuda_path:  # the graphs come once the forward is stubbed (stub_model)
        platform = dataclasses.replace(platform, attention="cuda")
    return EngineCore(config, platform)


def instrument(core: EngineCore, clock: PhaseClock) -> None:
    clock.wrap(core.scheduler, "schedule", "schedule")
    clock.wrap(core.runner, "execute", "prepare")
    sampler = core.sampler
    clock.wrap(sampler, "sample_later" if hasattr(sampler, "sample_later") else "__call__",
               "sample")
    if not hasattr(sampler, "sample_later"):  # before overlapped steps: the engine called it
        clock.wrap(core, "sampler", "sample")
    if hasattr(engine_module, "build_sampling_batch"):  # the engine builds the sampler's input
        clock.wrap(engine_module, "build_sampling_batch", "sample")
    for name in ("update_from_output", "advance", "resolve"):
        if hasattr(core.scheduler, name):
            clock.wrap(core.scheduler, name, "update")
    clock.wrap(StepNews, "pack", "pack")


def run_batch(batch: int, steps: int, async_scheduling: bool,
              cuda_path: bool = False) -> dict[str, float]:
    core = make_engine(batch, async_scheduling, cuda_path)
    stub_model(core, cuda_path)
    params = SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"r{i}", [1000 + (i * 7 + j) % 5000 for j in range(PROMPT_LEN)],
                         params)
    while core.scheduler.waiting or any(r.num_output_tokens == 0
                                        for r in core.scheduler.running):
        core.step()
    for _ in range(3):  # warm
        core.step()
    clock = PhaseClock()
    instrument(core, clock)
    walls: list[float] = []
    cpus: list[float] = []
    per_phase: dict[str, list[float]] = {p: [] for p in PHASES}
    for _ in range(steps):
        clock.reset()
        start, cpu = time.perf_counter(), time.thread_time()
        core.step()
        walls.append(time.perf_counter() - start)
        cpus.append(time.thread_time() - cpu)
        for p in PHASES:
            per_phase[p].append(clock.wall[p])
        assert len(core.scheduler.running) == batch, "every step must decode the whole batch"
    medians = {p: 1e3 * statistics.median(v) for p, v in per_phase.items()}
    total = 1e3 * statistics.median(walls)
    medians["other"] = max(0.0, total - sum(medians.values()))
    medians["host_ms"] = total
    medians["thread_cpu_ms"] = 1e3 * statistics.median(cpus)
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="64,256,1024")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--async-scheduling", action="store_true",
                        help="overlapped steps (--async-scheduling)")
    parser.add_argument("--cuda-path", action="store_true",
                        help="the GPU's code path (CUDA attention metadata, graph stand-in)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs")
    header = ("batch", *PHASES, "other", "host_ms", "thread_cpu_ms")
    print(" ".join(f"{h:>13}" for h in header))
    summary: dict[str, float] = {}
    for batch in (int(b) for b in args.batches.split(",")):
        runs = [run_batch(batch, args.steps, args.async_scheduling,
                          getattr(args, "cuda_path", False)) for _ in range(args.repeats)]
        best = min(runs, key=lambda r: r["host_ms"])
        print(" ".join([f"{batch:>13}", *(f"{best[h]:>13.3f}" for h in header[1:])]),
              flush=True)
        summary[f"batch_{batch}_host_ms"] = round(best["host_ms"], 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
