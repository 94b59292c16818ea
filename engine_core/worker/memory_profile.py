"""How much of a GPU the KV cache may take: vLLM's --gpu-memory-utilization, after one step.

The engine may hold `utilization` of the device's whole memory. The model runner loads the
weights, then runs one step at the largest budget (every batched token, every sequence
sampling the costliest way) and measures torch's peak above the weights; memory used on the
device outside torch's allocator (the CUDA context, cuBLAS workspaces, other processes) counts
too. The KV cache gets what is left:

    budget = total * utilization - weights - step peak - outside torch

and never more than `max_num_seqs` sequences of `max_model_len` tokens can use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


class StepMemory(NamedTuple):
    """What a profiled step measured, in bytes."""

    total: int  # the device's memory
    weights: int  # torch's allocations before the step
    peak: int  # torch's peak during the step, above `weights`
    outside_torch: int  # in use on the device, not by torch's allocator


def kv_budget(utilization: float, measured: StepMemory) -> int:
    """Bytes for the KV cache (see the module docstring)."""
    taken = measured.weights + measured.peak + measured.outside_torch
    budget = int(measured.total * utilization) - taken
    if budget <= 0:
        gib = 1 << 30
        raise ValueError(
            f"--gpu-memory-utilization {utilization} leaves no memory for the KV cache: of "
            f"{measured.total / gib:.1f} GiB, the weights take {measured.weights / gib:.1f}, a "
            f"step at the largest budget {measured.peak / gib:.1f} and memory outside torch "
            f"{measured.outside_torch / gib:.1f}; raise it, or lower --max-num-batched-tokens "
            "or --max-num-seqs")
    return budget


def max_useful_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """Blocks that `max_num_seqs` sequences of `max_model_len` tokens can fill at most."""
    return max_num_seqs * -(-max_model_len // block_size)


def measure_step(device: torch.device, step: Callable[[], None], scratch: int = 0) -> StepMemory:
    """Run `step` on CUDA and measure it; `scratch` bytes, allocated before the call for the
    step alone (a stand-in KV cache) and freed after it, are left out of the weights."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    free, total = torch.cuda.mem_get_info(device)
    outside = (total - free) - torch.cuda.memory_reserved(device)
    return StepMemory(total, before - scratch, peak, max(0, outside))
