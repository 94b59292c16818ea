"""The platform settled at start-up: defaults per device, the flags that override them, and
the environment passed in as a mapping."""

from __future__ import annotations

import dataclasses
import pickle
import shutil

import pytest
import torch

from engine_core.config import EngineConfig
from engine_core.worker.platform import Platform, head_workers, step_budget, thread_choices
from shared.machine import available_cpus

CPU = EngineConfig(model="m", device="cpu")


def test_cpu_defaults():
    p = Platform.detect(CPU, environ={"TANDEM_NATIVE": "0"})
    assert p.device == torch.device("cpu") and p.dtype == torch.float32
    assert p.kv_cache_bytes == 2 << 30 and p.kv_cache_budget() == 2 << 30
    assert (p.max_num_batched_tokens, p.min_num_batched_tokens) == (2048, 512)
    assert p.head_chunk == 8192
    cpus = available_cpus()  # each step on all cores or one fewer, as measured (threads.py)
    assert p.thread_choices == ((cpus - 1, cpus) if cpus > 1 else (1,))
    assert p.torch_threads == p.thread_choices[0]


def test_flags_fix_what_they_name():
    config = EngineConfig(model="m", device="cpu", dtype="bfloat16", kv_cache_memory=12345,
                          max_num_batched_tokens=300, num_threads=3)
    p = Platform.detect(config, environ={"TANDEM_NATIVE": "0"})
    assert p.dtype == torch.bfloat16 and p.kv_cache_budget() == 12345
    assert (p.max_num_batched_tokens, p.min_num_batched_tokens) == (300, None)
    assert p.torch_threads == 3 and p.head_workers == 1  # torch's own threads share the head
    assert p.thread_choices == (3,)  # fixed: never measured


def test_lm_head_backend_native_with_a_compiler_torch_when_turned_off():
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here")
    assert Platform.detect(CPU, environ={}).head_backend == "native"
    assert Platform.detect(CPU, environ={"TANDEM_NATIVE": "1"}).head_backend == "native"
    off = Platform.detect(CPU, environ={"TANDEM_NATIVE": "0"})
    assert off.head_backend == "torch" and off.head_kernels is None


def test_lm_head_backend_torch_when_the_kernels_do_not_build(tmp_path):
    env = {"CC": str(tmp_path / "no-such-cc"), "TANDEM_CACHE": str(tmp_path)}
    assert Platform.detect(CPU, environ=env).head_backend == "torch"


def test_default_step_budget_by_device():
    default = EngineConfig(model="m")
    assert step_budget(default, torch.device("cuda")) == (2048, None)  # fixed, vLLM's
    assert step_budget(default, torch.device("cpu")) == (2048, 512)  # follows the queue
    fixed = EngineConfig(model="m", max_num_batched_tokens=300)
    assert step_budget(fixed, torch.device("cpu")) == (300, None)


def test_head_workers_every_core_only_when_torch_runs_on_one_thread():
    assert head_workers(torch.device("cpu"), 2) == 1
    assert head_workers(torch.device("cuda"), 1) == 1
    assert head_workers(torch.device("cpu"), 1) >= 1


def test_torch_keeps_its_own_threads_on_a_gpu():
    assert thread_choices(EngineConfig(model="m"), torch.device("cuda")) == ()
    assert thread_choices(EngineConfig(model="m", num_threads=4), torch.device("cuda")) == (4,)


def test_tensor_parallel_ranks_keep_graphs_and_overlap_but_sample_on_the_scan():
    graphs = dataclasses.replace(Platform.detect(CPU, environ={"TANDEM_NATIVE": "0"}),
                                 cuda_graph_sizes=(1, 2), piecewise_sizes=(8,),
                                 async_scheduling=True, device_sampling=True)
    rank = graphs.split(2)
    assert (rank.cuda_graph_sizes, rank.piecewise_sizes) == ((1, 2), (8,))
    assert rank.async_scheduling and not rank.device_sampling


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="no C compiler")
def test_a_worker_gets_rank_zeros_platform_and_loads_its_own_kernels():
    """What crosses to a spawned worker is picklable; the worker's platform equals rank 0's
    (whatever rank 0 was given), with the compiled kernels loaded again where it had them."""
    given = dataclasses.replace(Platform.detect(CPU), attention="cuda",
                                cuda_graph_sizes=(1, 4), async_scheduling=True)
    assert given.head_kernels is not None
    shipped = pickle.loads(pickle.dumps(given.ship()))
    worker = shipped.load(torch.device("cpu"))
    assert worker == given and worker.head_kernels is not None
    without = dataclasses.replace(given, head_kernels=None)
    assert pickle.loads(pickle.dumps(without.ship())).load(torch.device("cpu")).head_kernels \
        is None
