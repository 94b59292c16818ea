"""Engine configuration: one frozen dataclass built once from the command line."""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine_args import KV_CACHE_DTYPES, LoRAModule
from shared.messages import Pooling
from shared.speculative import SpeculativeConfig


@dataclass(frozen=True)
class EngineConfig:
    model: str  # local folder or hub id
    served_model_name: str | None = None
    tokenizer: str | None = None  # defaults to the model
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    max_num_seqs: int | None = None  # None => 128 on CPU; 1024 or 256 on CUDA, by memory
    max_num_batched_tokens: int | None = None  # None => 8192 or 2048 on CUDA, by memory;
    # 512-2048 by queue on CPU
    max_waiting_requests: int = 1024  # beyond this many queued, new requests are refused (503)
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None => a default for the device
    num_kv_blocks: int | None = None  # exact block count; wins over kv_cache_memory
    gpu_memory_utilization: float | None = None  # the engine's share of the GPU; None => 0.9
    max_logprobs: int | None = None  # most logprobs a request may ask; None => MAX_LOGPROBS
    generation_config: str = "auto"  # sampling defaults: auto (the model's) | vllm | a folder
    enable_prefix_caching: bool = True
    dtype: str = "auto"  # auto => float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads; None => leave torch's choice
    trust_remote_code: bool = False
    model_impl: str = "auto"  # auto | tandem | transformers (engine_core/worker/loader.py)
    enforce_eager: bool = False  # no CUDA graphs
    cuda_graph_sizes: tuple[int, ...] | None = None  # decode graphs' batch sizes; None: ladder
    async_scheduling: bool | None = None  # overlapped steps; None: the platform's default
    speculative: SpeculativeConfig | None = None  # --speculative-config
    tensor_parallel_size: int = 1  # ranks the model is split over (worker/tensor_parallel.py)
    runner: str = "generate"  # "pooling": embeddings only (--runner pooling --convert embed)
    pooler: Pooling = Pooling()  # --pooler-config: embedding requests' default pooling
    enable_lora: bool = False  # --enable-lora: requests may name an adapter (engine_core/lora/)
    lora_modules: tuple[LoRAModule, ...] = ()  # --lora-modules
    max_loras: int = 1  # adapters on the device at once (vLLM's default)
    max_lora_rank: int = 16  # vLLM's default
    max_cpu_loras: int | None = None  # adapters kept in host memory; None: max_loras
    quantization: str | None = None  # "fp8": the decoder's weights quantized as they load
    kv_cache_dtype: str = "auto"  # auto (the model's) | fp8 | fp8_e4m3 (layers/quant/fp8_kv.py)
    calculate_kv_scales: bool = False  # fp8 scales from the first batch's K/V, not 1.0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting_requests",
                     "block_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("--num-kv-blocks must be at least 1")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"--dtype {self.dtype!r}: choose auto, float32, bfloat16 or float16")
        if self.cuda_graph_sizes is not None and any(s < 1 for s in self.cuda_graph_sizes):
            raise ValueError("--cuda-graph-sizes must be positive batch sizes")
        if self.model_impl not in ("auto", "tandem", "transformers"):
            raise ValueError(f"--model-impl {self.model_impl!r}: choose auto, tandem or "
                             "transformers")
        if self.tensor_parallel_size < 1:
            raise ValueError("--tensor-parallel-size must be at least 1")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("--max-loras and --max-lora-rank must be at least 1")
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError("--enable-lora: not yet with --tensor-parallel-size above 1")
        if self.runner not in ("generate", "pooling"):
            raise ValueError(f"runner {self.runner!r}: generate or pooling")
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"--quantization {self.quantization!r}: choose fp8")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype!r} is not supported: "
                             "choose auto, fp8 or fp8_e4m3")
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError("--calculate-kv-scales needs an fp8 KV cache (--kv-cache-dtype "
                             "fp8)")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device {self.device!r}: choose auto, cpu or cuda")
