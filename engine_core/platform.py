"""The machine the engine runs on, settled once at start-up: `Platform.detect(config)`.

Every difference between devices and machines is decided here, from the `EngineConfig`, the
hardware and the environment (read here and nowhere else in engine_core); the rest of the
engine asks the `Platform` instead of testing `device.type` again. A new device path (CUDA
kernels, a faster decoder) adds its choices here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from engine_core import native
from engine_core.config import EngineConfig
from engine_core.default_model import cache_root
from engine_core.linear import transposed_is_faster
from engine_core.lm_head import HeadBackend
from shared.machine import available_cpus

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_CACHE_BYTES = 2 << 30
CUDA_KV_FREE_SHARE = 0.8  # of the memory left free once the weights are in
CPU_HEAD_CHUNK = 8192  # vocabulary columns per LM-head task on the CPU (fits the caches)


@dataclass(frozen=True)
class Platform:
    """What the engine runs with; see the module docstring."""

    device: torch.device
    dtype: torch.dtype
    kv_cache_bytes: int | None  # None: measured on the device (`kv_cache_budget`)
    gpu_memory_utilization: float | None  # the engine's share of the whole GPU, if given
    max_num_batched_tokens: int  # tokens per step, at most
    min_num_batched_tokens: int | None  # floor of the queue-following budget; None: fixed
    head_workers: int  # threads sharing the LM head's vocabulary chunks
    head_chunk: int | None  # vocabulary columns per LM-head task; None: the whole vocabulary
    torch_threads: int | None  # torch's intra-op threads; None: torch's own choice
    transposed_linears: bool  # the decoder's linears as x @ W_t (linear.py), measured faster
    # The LM head's compiled CPU kernels, loaded once; None: torch ops do the head.
    head_kernels: native.Kernels | None = field(default=None, compare=False, repr=False)

    @property
    def head_backend(self) -> HeadBackend:
        return "native" if self.head_kernels is not None else "torch"

    @classmethod
    def detect(cls, config: EngineConfig, environ: Mapping[str, str] | None = None) -> Platform:
        """The platform for `config` on this machine. `environ` defaults to the process's
        environment: TANDEM_NATIVE=0 turns the compiled LM-head kernels off, CC names the
        compiler that builds them, TANDEM_CACHE the folder they are built into;
        TANDEM_LINEAR=transposed|torch fixes the decoder's linear layout instead of measuring
        it."""
        env = os.environ if environ is None else environ
        device = resolve_device(config.device)
        threads = config.num_threads or None
        budget, floor = step_budget(config, device)
        dtype = resolve_dtype(config.dtype, device)
        return cls(
            device=device,
            dtype=dtype,
            kv_cache_bytes=kv_cache_bytes(config, device),
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_num_batched_tokens=budget,
            min_num_batched_tokens=floor,
            head_workers=head_workers(device, threads or torch.get_num_threads()),
            head_chunk=CPU_HEAD_CHUNK if device.type == "cpu" else None,
            torch_threads=threads,
            transposed_linears=_transposed_linears(device, dtype, threads, env),
            head_kernels=_head_kernels(device, env),
        )

    def apply(self) -> None:
        """Set what is process-wide (torch's threads); once, before the model loads."""
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)

    def kv_cache_budget(self) -> int:
        """Bytes for the KV cache; measured on the device when no size was settled, so call it
        once the weights are loaded."""
        if self.kv_cache_bytes is not None:
            return self.kv_cache_bytes
        free, total = torch.cuda.mem_get_info(self.device)
        if self.gpu_memory_utilization is None:
            return int(free * CUDA_KV_FREE_SHARE)
        # vLLM's meaning: the engine holds at most this share of the whole GPU, so the cache
        # gets what the share leaves once the weights (and anything else in use) are in.
        budget = int(total * self.gpu_memory_utilization) - (total - free)
        if budget <= 0:
            raise ValueError(f"--gpu-memory-utilization {self.gpu_memory_utilization} leaves "
                             "no memory for the KV cache once the model is loaded")
        return budget


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def kv_cache_bytes(config: EngineConfig, device: torch.device) -> int | None:
    """--kv-cache-memory, else 2 GiB on the CPU, else None: a share of what the GPU has free."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    return CPU_KV_CACHE_BYTES if device.type == "cpu" else None


def step_budget(config: EngineConfig, device: torch.device) -> tuple[int, int | None]:
    """(max, adaptive floor) of the tokens per step. --max-num-batched-tokens fixes the budget.
    By default a GPU gets vLLM's chunked-prefill 2048. A CPU, where a prefill step costs in
    proportion to its tokens, gets a budget that follows the queue (Scheduler.step_budget): a
    quarter of the waiting prompt tokens, between 512 and 2048, which gave the best TTFT
    across concurrencies at the same throughput (docs/benchmarks.md)."""
    if config.max_num_batched_tokens:
        return config.max_num_batched_tokens, None
    return (2048, None) if device.type == "cuda" else (2048, 512)


def head_workers(device: torch.device, torch_threads: int) -> int:
    """Threads for the LM head's vocabulary chunks: every core when torch itself runs on one
    thread (small CPU boxes, where the frontends share the cores: chunks taken on demand
    tolerate a busy core, torch's OpenMP split does not); else torch's own threads do it."""
    if device.type != "cpu" or torch_threads > 1:
        return 1
    return available_cpus()


def _transposed_linears(device: torch.device, dtype: torch.dtype, threads: int | None,
                        env: Mapping[str, str]) -> bool:
    """On the CPU, whether the decoder's linears run faster transposed: as TANDEM_LINEAR says,
    else measured once here with the engine's own thread count (linear.py)."""
    if device.type != "cpu":
        return False
    choice = env.get("TANDEM_LINEAR", "")
    if choice in ("transposed", "torch"):
        return choice == "transposed"
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        faster = transposed_is_faster(dtype)
    finally:
        torch.set_num_threads(previous)
    log.info("decoder linears: %s layout measured faster here",
             "transposed [in, out]" if faster else "torch's [out, in]")
    return faster


def _head_kernels(device: torch.device, env: Mapping[str, str]) -> native.Kernels | None:
    if device.type != "cpu" or env.get("TANDEM_NATIVE", "1") == "0":
        return None
    compiler = native.find_compiler(env.get("CC"))
    if compiler is None:
        log.warning("no C compiler (cc or gcc) on PATH: the LM head runs on torch ops")
        return None
    return native.load(compiler, cache_root(env))
