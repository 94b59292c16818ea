"""The platform's GPU choices that can be checked without a GPU: vLLM's defaults by device
size, the KV budget from a profiled step, the sampler and attention picked per device (and
the variables that fix them), and the host link on the CPU."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine_core.config import EngineConfig
from engine_core.worker.memory_profile import StepMemory, kv_budget, max_useful_blocks
from engine_core.worker.platform import (
    Platform,
    attention_backend,
    default_max_num_seqs,
    step_budget,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
GIB = 1 << 30


def test_vllm_server_defaults_by_gpu_size():
    default = EngineConfig(model="m")
    assert step_budget(default, CUDA, large_gpu=True) == (8192, None)
    assert step_budget(default, CUDA, large_gpu=False) == (2048, None)
    assert default_max_num_seqs(CUDA, True) == 1024 and default_max_num_seqs(CUDA, False) == 256
    assert default_max_num_seqs(CPU, False) == 128
    fixed = EngineConfig(model="m", max_num_batched_tokens=300)
    assert step_budget(fixed, CUDA, large_gpu=True) == (300, None)


def test_cpu_platform_keeps_its_path_and_flags_win():
    p = Platform.detect(EngineConfig(model="m", device="cpu"), environ={"TANDEM_NATIVE": "0"})
    assert p.max_num_seqs == 128 and not p.device_sampling and p.attention == "portable"
    assert not p.profiles_memory and p.gpu_memory_utilization is None
    p = Platform.detect(EngineConfig(model="m", device="cpu", max_num_seqs=7),
                        environ={"TANDEM_NATIVE": "0", "TANDEM_SAMPLER": "device"})
    assert p.max_num_seqs == 7 and p.device_sampling


def test_attention_backend_by_device_dtype_and_variable():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert attention_backend(CPU, fp32, {}) == "portable"
    assert attention_backend(CUDA, bf16, {}) == "cuda"
    assert attention_backend(CUDA, torch.float16, {}) == "cuda"
    # float32 too: SDPA for its prefill chunks, the Triton kernels for the rest
    assert attention_backend(CUDA, fp32, {}) == "cuda"
    assert attention_backend(CUDA, bf16, {"TANDEM_ATTENTION": "portable"}) == "portable"
    for dtype in (bf16, fp32):
        with pytest.raises(RuntimeError, match="TANDEM_ATTENTION=cuda"):
            attention_backend(CPU, dtype, {"TANDEM_ATTENTION": "cuda"})
    with pytest.raises(ValueError, match="TANDEM_ATTENTION"):
        attention_backend(CUDA, bf16, {"TANDEM_ATTENTION": "flash"})
    # the CPU's decodes on the compiled kernel: float32, with the kernels built
    assert attention_backend(CPU, fp32, {}, kernels=True) == "native"
    assert attention_backend(CPU, bf16, {}, kernels=True) == "portable"
    assert attention_backend(CUDA, fp32, {}, kernels=True) == "cuda"
    assert attention_backend(CPU, fp32, {"TANDEM_ATTENTION": "portable"}, kernels=True) == \
        "portable"
    for device, dtype, built in ((CPU, fp32, False), (CPU, bf16, True), (CUDA, bf16, True)):
        with pytest.raises(RuntimeError, match="TANDEM_ATTENTION=native"):
            attention_backend(device, dtype, {"TANDEM_ATTENTION": "native"}, kernels=built)


def test_kv_budget_is_what_the_utilization_leaves():
    measured = StepMemory(total=100 * GIB, weights=3 * GIB, peak=5 * GIB, outside_torch=GIB)
    assert kv_budget(0.9, measured) == int(100 * GIB * 0.9) - 9 * GIB
    with pytest.raises(ValueError, match="gpu-memory-utilization 0.05"):
        kv_budget(0.05, measured)
    assert max_useful_blocks(1024, 2048, 16) == 1024 * 128
    assert max_useful_blocks(2, 17, 16) == 4


def test_profiled_budget_needs_a_measurement():
    p = Platform.detect(EngineConfig(model="m", device="cpu"), environ={"TANDEM_NATIVE": "0"})
    gpu_like = dataclasses.replace(p, kv_cache_bytes=None, gpu_memory_utilization=0.9)
    assert gpu_like.profiles_memory
    with pytest.raises(ValueError, match="profiled"):
        gpu_like.kv_cache_budget()
    measured = StepMemory(total=10 * GIB, weights=GIB, peak=GIB, outside_torch=0)
    assert gpu_like.kv_cache_budget(measured) == int(9 * GIB) - 2 * GIB


def test_host_link_on_the_cpu_packs_uploads_and_brings_results_back():
    p = Platform.detect(EngineConfig(model="m", device="cpu"), environ={"TANDEM_NATIVE": "0"})
    link = p.host_link()
    assert not link.pinned
    a, b, c = link.upload_many([np.arange(3), np.zeros((2, 2)), np.array([], np.int64)],
                               np.int64)
    assert a.tolist() == [0, 1, 2] and b.shape == (2, 2) and b.dtype == torch.int64
    assert c.numel() == 0
    x, y = link.download([torch.arange(4), torch.ones(2, 3)])
    assert x.tolist() == [0, 1, 2, 3] and y.shape == (2, 3)
