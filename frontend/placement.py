"""Where each engine of a data-parallel `tandem serve` runs: its address, its GPU, its CPU cores.

Settled once, by the launcher, before any engine starts (the launcher imports no torch, so the
GPUs are counted from `CUDA_VISIBLE_DEVICES` or the NVIDIA driver's own listing):
- rank K listens on the engine address with its port plus K (tcp://) or a `_dpK` suffix
  (ipc://), the rule vLLM applies to its KV-event ports;
- on CUDA, rank K sees one GPU, the K-th visible one (`CUDA_VISIBLE_DEVICES`), or with
  --tensor-parallel-size T the K-th run of T adjacent ones; asking for more GPUs than are
  visible is a start-up error that names D x T;
- the CPU cores this process may use are split into N contiguous shares, one per engine (each
  engine then sizes its torch threads to its share); with fewer cores than engines, engines
  share cores round the list. Frontends are not pinned.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from shared.kv_events import rank_endpoint

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


class PlacementError(ValueError):
    """The engines cannot be placed as asked; the message says why."""


@dataclass(frozen=True)
class EnginePlace:
    rank: int
    address: str
    cpus: tuple[int, ...]  # the cores it is pinned to (empty: not pinned)
    cuda_device: str | None  # its CUDA_VISIBLE_DEVICES, or None to leave it as it is


def engine_address(base: str, rank: int) -> str:
    return rank_endpoint(base, rank)


def visible_gpus(env: Mapping[str, str], driver: Path = NVIDIA_GPUS) -> list[str]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES when set, else those the NVIDIA
    driver lists (none on a machine without one)."""
    listed = env.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip() and d.strip() != "-1"]
    try:
        return [str(i) for i in range(len(list(driver.iterdir())))]
    except OSError:
        return []


def split_cpus(cpus: Sequence[int], n: int) -> list[tuple[int, ...]]:
    """N contiguous shares of `cpus` as even as they go; with fewer cores than N, one each,
    round the list."""
    cores = sorted(cpus)
    if not cores:
        return [() for _ in range(n)]
    if len(cores) < n:
        return [(cores[k % len(cores)],) for k in range(n)]
    return [tuple(cores[k * len(cores) // n:(k + 1) * len(cores) // n]) for k in range(n)]


def plan(size: int, base_address: str, device: str, env: Mapping[str, str] | None = None,
         cpus: Sequence[int] | None = None, driver: Path = NVIDIA_GPUS,
         tensor_parallel: int = 1) -> list[EnginePlace]:
    """Every rank's place; one engine is left as it is (no pinning, its GPUs untouched). With
    --tensor-parallel-size T each engine sees T adjacent GPUs, its workers' (D x T in all)."""
    if size < 1:
        raise PlacementError(f"--data-parallel-size {size}: at least 1")
    env = os.environ if env is None else env
    gpus = [] if device == "cpu" else visible_gpus(env, driver)
    need = size * tensor_parallel
    if tensor_parallel > 1 and gpus and len(gpus) < need:
        raise PlacementError(f"--data-parallel-size {size} x --tensor-parallel-size "
                             f"{tensor_parallel} needs {need} GPUs; {len(gpus)} visible "
                             f"(CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', 'unset')})"
                             "; pass --device cpu to serve on the CPU instead")
    if size == 1:
        return [EnginePlace(0, base_address, (), None)]
    if device == "cuda" and len(gpus) < need:
        raise PlacementError(f"--data-parallel-size {size} on CUDA needs {size} GPUs, one per "
                             f"engine; {len(gpus)} visible (CUDA_VISIBLE_DEVICES="
                             f"{env.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    if gpus and len(gpus) < size:  # device "auto": a GPU machine serves on its GPUs
        raise PlacementError(f"--data-parallel-size {size}: {len(gpus)} GPU(s) visible, one "
                             "engine per GPU; pass --device cpu to serve on the CPU instead")
    cores = cpus if cpus is not None else sorted(os.sched_getaffinity(0))
    shares = split_cpus(cores, size)
    t = tensor_parallel
    return [EnginePlace(k, engine_address(base_address, k), shares[k],
                        ",".join(gpus[k * t:(k + 1) * t]) if gpus else None)
            for k in range(size)]
