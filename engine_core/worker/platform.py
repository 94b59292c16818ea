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
from dataclasses import dataclass, field, replace
from typing import Literal, NamedTuple

import torch

from engine_core.config import EngineConfig
from engine_core.layers import native, triton_attention
from engine_core.layers.host_link import HostLink
from engine_core.layers.linear import transposed_is_faster
from engine_core.layers.lm_head import HeadBackend
from engine_core.layers.ops import LayerOps, NativeOps, TorchOps
from engine_core.layers.triton_ops import TritonOps
from engine_core.worker.cuda_graphs import capture_sizes
from engine_core.worker.default_model import cache_root
from engine_core.worker.memory_profile import StepMemory, kv_budget
from engine_core.worker.piecewise import piecewise_sizes
from shared.machine import available_cpus

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_CACHE_BYTES = 2 << 30
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of the whole GPU
LARGE_GPU_BYTES = 70 << 30  # vLLM's larger defaults from here (A100s excepted)
# attention.py (torch ops; with its decodes on the compiled CPU kernel) | attention_cuda.py
AttentionBackend = Literal["portable", "native", "cuda"]
# Speculative decoding's default batch bound. On the CPU a verified row costs compute: n-gram
# speculation on the 0.5B shape gave 1.43x at batch 1, 0.98x at 4, 0.91x at 8, 1.04x at 16
# (docs/benchmarks.md). On a GPU a decode step is bound by reading the weights, so rows are
# nearly free at small batch; vLLM's guidance puts its gain at low concurrency (unmeasured here).
SPEC_MAX_BATCH_CPU = 4
SPEC_MAX_BATCH_GPU = 32
CPU_HEAD_CHUNK = 8192  # vocabulary columns per LM-head task on the CPU (fits the caches)


@dataclass(frozen=True)
class Platform:
    """What the engine runs with; see the module docstring."""

    device: torch.device
    dtype: torch.dtype
    kv_cache_bytes: int | None  # None: measured on the device (`kv_cache_budget`)
    gpu_memory_utilization: float | None  # the engine's share of the whole GPU, if given
    max_num_batched_tokens: int  # tokens per step, at most
    max_num_seqs: int  # requests running at once, at most
    min_num_batched_tokens: int | None  # floor of the queue-following budget; None: fixed
    head_workers: int  # threads sharing the LM head's vocabulary chunks
    head_chunk: int | None  # vocabulary columns per LM-head task; None: the whole vocabulary
    torch_threads: int | None  # torch's intra-op threads at load; None: torch's own choice
    # the thread counts a step may run on, picked per step by measurement (threads.py);
    # empty: torch's own choice, never changed
    thread_choices: tuple[int, ...]
    transposed_linears: bool  # the decoder's linears as x @ W_t (linear.py), measured faster
    # the decoder's linears also packed in panels for decode steps (linear.py): as
    # TANDEM_PANELS=1|0 says, or None: measured on the model once it is loaded
    decoder_panels: bool | None
    # the decoder layers' small ops (RMSNorm, rotary, SiLU x up, residual adds) on the
    # compiled kernels (ops.py, NativeOps): CPU, float32, kernels built; TANDEM_FUSED=1|0
    fused_elementwise: bool
    device_sampling: bool  # sampling on the device (device_sampler.py), else on the head's scan
    attention: AttentionBackend  # the paged attention the model runs with
    # batch sizes of the decode steps' CUDA graphs (cuda_graphs.py); empty: every step eager
    cuda_graph_sizes: tuple[int, ...] = ()
    # token counts of the piecewise graphs for the other steps of a model file's forward
    # (piecewise.py); empty: those steps run eagerly (--enforce-eager, TANDEM_PIECEWISE=0)
    piecewise_sizes: tuple[int, ...] = ()
    # step N+1 scheduled and prepared while step N runs (engine.py): --async-scheduling, by
    # default on CUDA (measured faster there at every concurrency: docs/benchmarks.md)
    async_scheduling: bool = False
    triton_decode: bool = True  # the CUDA path's decodes on the Triton kernel (TANDEM_...)
    triton_kv_write: bool = True  # ... and its KV-cache write
    triton_ops: bool = True  # ... and the layers' small ops (TANDEM_TRITON_OPS=0: torch's)
    # LoRA on the shrink/expand kernels reading each token's slot on the device (graph-safe,
    # engine_core/lora/triton_lora.py): the CUDA path with Triton, unless TANDEM_TRITON_LORA=0;
    # else the plain path, which reads the step's rows on the host (steps eager)
    lora_kernels: bool = False
    # speculative decoding proposes nothing while more requests run (unless
    # disable_by_batch_size says): where verifying a row still costs less than it saves
    speculation_max_batch: int = 4
    # fp8 weights' products on torch._scaled_mm (engine_core/quant/fp8.py): a GPU of compute
    # capability 8.9+ (Ada, Hopper and later) serving bf16; elsewhere dequantized per product
    fp8_scaled_mm: bool = False
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
        it, TANDEM_PANELS=1|0 whether its decode steps run the compiled kernel (linear.py);
        TANDEM_SAMPLER=device|cpu and TANDEM_ATTENTION=cuda|native|portable fix the sampler and
        the attention instead of the device's own (to compare them, or to fall back);
        TANDEM_TRITON_DECODE=0 and TANDEM_TRITON_KV_WRITE=0 put the CUDA path's decodes into
        the varlen call and its KV write on torch ops (the device check's fallbacks);
        TANDEM_TRITON_OPS=0 runs the layers' small ops on torch's (the check's fallback);
        TANDEM_TRITON_LORA=0 runs LoRA's plain path (and, with --enable-lora, no graphs);
        TANDEM_PIECEWISE=0 runs steps with a prefill eagerly (no piecewise graphs)."""
        env = os.environ if environ is None else environ
        device = resolve_device(config.device)
        choices = thread_choices(config, device)
        threads = choices[0] if choices else None
        large = is_large_gpu(device)
        budget, floor = step_budget(config, device, large)
        dtype = resolve_dtype(config.dtype, device)
        kernels = _head_kernels(device, env)
        platform = cls(
            device=device,
            dtype=dtype,
            kv_cache_bytes=kv_cache_bytes(config, device),
            gpu_memory_utilization=config.gpu_memory_utilization or (
                GPU_MEMORY_UTILIZATION if device.type == "cuda" else None),
            max_num_batched_tokens=budget,
            min_num_batched_tokens=floor,
            max_num_seqs=config.max_num_seqs or default_max_num_seqs(device, large),
            head_workers=head_workers(device, threads or torch.get_num_threads()),
            head_chunk=CPU_HEAD_CHUNK if device.type == "cpu" else None,
            torch_threads=threads,
            thread_choices=choices,
            transposed_linears=_transposed_linears(device, dtype, threads, env),
            decoder_panels=_decoder_panels(dtype, kernels, env),
            fused_elementwise=_fused_elementwise(dtype, kernels, env),
            device_sampling=_choice(env, "TANDEM_SAMPLER", ("device", "cpu"),
                                    "device" if device.type == "cuda" else "cpu") == "device",
            attention=attention_backend(device, dtype, env, kernels is not None),
            cuda_graph_sizes=graph_sizes(config, device,
                                         config.max_num_seqs or default_max_num_seqs(device,
                                                                                     large)),
            piecewise_sizes=piecewise_graph_sizes(config, device, budget, env),
            async_scheduling=(device.type == "cuda" if config.async_scheduling is None
                              else config.async_scheduling),
            triton_decode=env.get("TANDEM_TRITON_DECODE", "1") != "0",
            triton_kv_write=env.get("TANDEM_TRITON_KV_WRITE", "1") != "0",
            triton_ops=env.get("TANDEM_TRITON_OPS", "1") != "0",
            speculation_max_batch=(SPEC_MAX_BATCH_GPU if device.type == "cuda"
                                   else SPEC_MAX_BATCH_CPU),
            fp8_scaled_mm=fp8_gemm(device, dtype),
            head_kernels=kernels,
        )
        lora_kernels = (platform.attention == "cuda" and device.type == "cuda"
                        and triton_attention.available()
                        and env.get("TANDEM_TRITON_LORA", "1") != "0")
        platform = replace(platform, lora_kernels=lora_kernels)
        if config.enable_lora and not lora_kernels:  # (the plain path reads rows on the host)
            platform = replace(platform, cuda_graph_sizes=(), piecewise_sizes=())
        return platform.split(config.tensor_parallel_size)

    def split(self, ranks: int) -> Platform:
        """Each of `ranks` tensor-parallel ranks' platform (worker/tensor_parallel.py): its
        share of the CPU's threads and the sampler on the head's scan, which gathers the
        ranks' logits (the device sampler's head is not split). CUDA graphs and overlapped
        steps stay: every rank captures the same graphs and replays what rank 0 does."""
        if ranks == 1:
            return self
        threads = max(1, (self.torch_threads or torch.get_num_threads()) // ranks)
        return replace(self, torch_threads=threads, thread_choices=(), head_workers=1,
                       head_chunk=None, device_sampling=False)

    def ship(self) -> ShippedPlatform:
        """This platform as a tensor-parallel worker is given it (pickled at its spawn), so
        that every rank runs rank 0's choices, whatever rank 0 was given."""
        return ShippedPlatform(replace(self, head_kernels=None), self.head_kernels is not None)

    def layer_ops(self) -> LayerOps:
        """The decoder layers' small ops (engine_core/layers/ops.py): the Triton kernels on
        CUDA, the compiled CPU kernels where `fused_elementwise`, else torch's own ops."""
        if (self.attention == "cuda" and self.device.type == "cuda" and self.triton_ops
                and triton_attention.available()):
            return TritonOps()
        if self.fused_elementwise and self.head_kernels is not None:
            return NativeOps(self.head_kernels)
        return TorchOps()

    @property
    def linear_workers(self) -> int | None:
        """Threads a step may share the decoder's products over (linear.py): as many as the
        LM head's on the CPU (more than one only where torch itself runs on one thread);
        None on a GPU."""
        return self.head_workers if self.device.type == "cpu" else None

    def apply(self) -> None:
        """Set what is process-wide (torch's threads); once, before the model loads."""
        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)

    @property
    def profiles_memory(self) -> bool:
        """Whether the KV cache is sized from a profiled step (`kv_cache_budget(profiled)`)."""
        return self.kv_cache_bytes is None

    def kv_cache_budget(self, profiled: StepMemory | None = None) -> int:
        """Bytes for the KV cache: the size settled at start-up, else what
        --gpu-memory-utilization leaves of the whole GPU once the weights, the `profiled`
        step's peak and the memory outside torch are counted (memory_profile.py)."""
        if self.kv_cache_bytes is not None:
            return self.kv_cache_bytes
        if profiled is None or self.gpu_memory_utilization is None:
            raise ValueError("the KV cache is sized on this device from a profiled step")
        return kv_budget(self.gpu_memory_utilization, profiled)

    def host_link(self) -> HostLink:
        """Copies between the host and the device: pinned and asynchronous on CUDA, with one
        wait on the current stream to bring results back; plain copies on the CPU."""
        aligned = self.attention == "cuda"  # the Triton kernels read the uploads
        if self.device.type != "cuda":
            return HostLink(self.device, pinned=False, synchronize=lambda: None, align=aligned)
        device = self.device
        return HostLink(device, pinned=True, align=aligned,
                        synchronize=lambda: torch.cuda.current_stream(device).synchronize())


class ShippedPlatform(NamedTuple):
    """A `Platform` on its way to a tensor-parallel worker: every choice but the compiled CPU
    kernels (a loaded library), which the worker loads itself (`load`) where rank 0 had
    them."""

    platform: Platform
    kernels: bool

    def load(self, device: torch.device, environ: Mapping[str, str] | None = None
             ) -> Platform:
        """The worker's platform: rank 0's on `device`, the kernels loaded from the build cache
        rank 0 used (the environment is rank 0's: a spawned process inherits it)."""
        env = os.environ if environ is None else environ
        kernels = _head_kernels(device, env) if self.kernels else None
        if self.kernels and kernels is None:
            raise RuntimeError("a tensor-parallel worker could not load the compiled CPU "
                               "kernels rank 0 runs with")
        return replace(self.platform, device=device, head_kernels=kernels)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but torch sees no CUDA device")
    return torch.device(name)


def fp8_gemm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this device multiplies fp8 with rowwise scales into `dtype`: cuBLASLt's fp8
    GEMM needs compute capability 8.9, and its rowwise scaling gives bf16 only."""
    return (device.type == "cuda" and dtype == torch.bfloat16
            and torch.cuda.get_device_capability(device) >= (8, 9))


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def kv_cache_bytes(config: EngineConfig, device: torch.device) -> int | None:
    """--kv-cache-memory, else 2 GiB on the CPU, else None: profiled on the GPU."""
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory
    return CPU_KV_CACHE_BYTES if device.type == "cpu" else None


def is_large_gpu(device: torch.device) -> bool:
    """A GPU with at least 70 GiB that is not an A100: vLLM's larger defaults (on an A100 a
    larger step lowered throughput, vLLM PR 17885)."""
    if device.type != "cuda":
        return False
    props = torch.cuda.get_device_properties(device)
    return props.total_memory >= LARGE_GPU_BYTES and "a100" not in props.name.lower()


def default_max_num_seqs(device: torch.device, large_gpu: bool) -> int:
    """vLLM's server defaults on a GPU (1024 on a large one, else 256); 128 on the CPU."""
    if device.type != "cuda":
        return 128
    return 1024 if large_gpu else 256


def step_budget(config: EngineConfig, device: torch.device,
                large_gpu: bool = False) -> tuple[int, int | None]:
    """(max, adaptive floor) of the tokens per step. --max-num-batched-tokens fixes the budget.
    By default a GPU gets vLLM's server budget: 8192 on a large GPU, else 2048. A CPU, where a
    prefill step costs in proportion to its tokens, gets a budget that follows the queue
    (Scheduler.step_budget): a quarter of the waiting prompt tokens, between 512 and 2048,
    which gave the best TTFT across concurrencies at the same throughput (docs/benchmarks.md)."""
    if config.max_num_batched_tokens:
        return config.max_num_batched_tokens, None
    if device.type == "cuda":
        return (8192 if large_gpu else 2048), None
    return 2048, 512


def thread_choices(config: EngineConfig, device: torch.device) -> tuple[int, ...]:
    """--num-threads N fixes N. Else, on the CPU, each step runs on every usable core or on one
    fewer (left to the frontends), whichever its size has measured faster (threads.py); on a
    GPU torch keeps its own choice."""
    if config.num_threads:
        return (config.num_threads,)
    if device.type != "cpu":
        return ()
    cpus = available_cpus()
    return (cpus - 1, cpus) if cpus > 1 else (1,)


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


def _decoder_panels(dtype: torch.dtype, kernels: native.Kernels | None,
                    env: Mapping[str, str]) -> bool | None:
    if kernels is None or dtype != torch.float32:  # the kernel is the CPU's, for float32
        return False
    choice = env.get("TANDEM_PANELS", "")
    return None if choice not in ("0", "1") else choice == "1"


def _fused_elementwise(dtype: torch.dtype, kernels: native.Kernels | None,
                       env: Mapping[str, str]) -> bool:
    """Fused wherever the CPU kernels are built and the model runs in float32 (a GPU has
    none: the fusion is the CPU's), unless TANDEM_FUSED=0; measured faster on the 0.5B shape
    and on the tiny model, prefill and decode steps alike (docs/benchmarks.md)."""
    wanted = _choice(env, "TANDEM_FUSED", ("1", "0"), "1") == "1"
    possible = kernels is not None and dtype == torch.float32
    if env.get("TANDEM_FUSED") == "1" and not possible:
        log.warning("TANDEM_FUSED=1: the fused elementwise kernels need the CPU kernels and "
                    "float32; the decoder runs torch's own ops")
    return wanted and possible


def _head_kernels(device: torch.device, env: Mapping[str, str]) -> native.Kernels | None:
    if device.type != "cpu" or env.get("TANDEM_NATIVE", "1") == "0":
        return None
    compiler = native.find_compiler(env.get("CC"))
    if compiler is None:
        log.warning("no C compiler (cc or gcc) on PATH: the LM head runs on torch ops")
        return None
    return native.load(compiler, cache_root(env))


def graph_sizes(config: EngineConfig, device: torch.device,
                max_num_seqs: int) -> tuple[int, ...]:
    """The decode graphs' ladder on CUDA (cuda_graphs.capture_sizes; --cuda-graph-sizes sets
    it), none with --enforce-eager or off CUDA."""
    if device.type != "cuda" or config.enforce_eager:
        return ()
    return capture_sizes(max_num_seqs, config.cuda_graph_sizes)


def piecewise_graph_sizes(config: EngineConfig, device: torch.device, max_tokens: int,
                          env: Mapping[str, str]) -> tuple[int, ...]:
    """The piecewise graphs' ladder of token counts on CUDA (piecewise.py), none with
    --enforce-eager, off CUDA or with TANDEM_PIECEWISE=0."""
    wanted = _choice(env, "TANDEM_PIECEWISE", ("1", "0"), "1") == "1"
    if device.type != "cuda" or config.enforce_eager or not wanted:
        return ()
    return piecewise_sizes(max_tokens)


def attention_backend(device: torch.device, dtype: torch.dtype, env: Mapping[str, str],
                      kernels: bool = False) -> AttentionBackend:
    """The CUDA kernels (attention_cuda.py) on a GPU (FlashAttention in bf16 and fp16, SDPA
    per chunk in float32; the Triton decode and KV write in all three); on the CPU in float32
    with the compiled kernels built (`kernels`), the portable path with its decode rows read
    from the paged cache in place by the C kernel ("native"); the portable torch path
    elsewhere. TANDEM_ATTENTION=cuda|native|portable fixes it."""
    cuda = device.type == "cuda"
    compiled = device.type == "cpu" and dtype == torch.float32 and kernels
    choice = _choice(env, "TANDEM_ATTENTION", ("cuda", "native", "portable"),
                     "cuda" if cuda else "native" if compiled else "portable")
    if choice == "cuda" and not cuda:
        raise RuntimeError("TANDEM_ATTENTION=cuda needs a CUDA device")
    if choice == "native" and not compiled:
        raise RuntimeError("TANDEM_ATTENTION=native needs the CPU, float32 and the compiled "
                           "CPU kernels (a C compiler, TANDEM_NATIVE not 0)")
    return choice  # type: ignore[return-value]


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    value = env.get(name, "") or default
    if value not in choices:
        raise ValueError(f"{name}={value!r}: choose {' or '.join(choices)}")
    return value
