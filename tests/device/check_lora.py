"""LoRA on the device (issue 44): a decode batch whose requests mix 4 random adapters against a
base-only batch of the same size, on one in-process engine with --enable-lora (4 slots, rank
16), the platform's default (on the GPU: bf16, the Triton shrink/expand kernels, CUDA graphs,
overlapped steps).

Each batch is `Sizes.lora_batch` requests of `Sizes.lora_input_len` random prompt tokens, run
until every one has `Sizes.lora_output_len` tokens; the first step (their prefills) is not
timed, the decode steps after it are: time per decode step, mixed over base (target <= 1.2 at
batch 64 on the GPU). Base first, then mixed, then both again; each kind's best.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path
from typing import Any

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from shared.engine_args import LoRAModule
from shared.messages import SamplingParams
from tests.bench.lora_mix import write_adapter
from tests.device.context import Context
from tests.device.targets import all_met, target

ADAPTERS = 4
RANK = 16


def lora(ctx: Context) -> dict[str, Any]:
    ctx.release()
    s = ctx.sizes
    judged = ctx.device == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"a{j}" for j in range(ADAPTERS)]
        for j, name in enumerate(names):
            write_adapter(Path(ctx.model), Path(tmp) / name, RANK, seed=j)
        core = EngineCore(EngineConfig(
            model=ctx.model, device=ctx.device, kv_cache_memory=s.kv_cache_bytes,
            num_threads=s.threads, enable_lora=True, max_loras=ADAPTERS, max_lora_rank=RANK,
            max_model_len=s.lora_input_len + s.lora_output_len + 8,
            lora_modules=tuple(LoRAModule(n, str(Path(tmp) / n)) for n in names)))
        kinds: dict[str, list[str | None]] = {
            "base": [None] * s.lora_batch,
            "mixed": [names[i % ADAPTERS] for i in range(s.lora_batch)]}
        rng = random.Random(5)
        vocab = core.facts.vocab_size
        best: dict[str, float] = {}
        steps: dict[str, int] = {}
        for _ in range(2):
            for kind, loras in kinds.items():
                prompts = [[rng.randrange(100, vocab - 100) for _ in range(s.lora_input_len)]
                           for _ in loras]
                ms, n = _decode_ms(core, prompts, loras, s.lora_output_len)
                best[kind] = min(best.get(kind, float("inf")), ms)
                steps[kind] = n
        replays = (sum(core.runner.graphs.replays.values())
                   if core.runner.graphs is not None else 0)
        loads = core.loras.loads if core.loras is not None else 0
    ratio = best["mixed"] / best["base"]
    targets = [target(f"batch {s.lora_batch}, 4 adapters mixed / base: time per decode step",
                      round(ratio, 3), "<=", 1.2, "x", judged)]
    return {"decode_step_ms": {k: round(v, 3) for k, v in best.items()},
            "decode_steps": steps, "graph_replays": replays, "adapter_loads": loads,
            "ratio": round(ratio, 3), "targets": targets, "passed": all_met(targets)}


def _decode_ms(core: EngineCore, prompts: list[list[int]], loras: list[str | None],
               output_len: int) -> tuple[float, int]:
    """Milliseconds per step after the first (the prefills), and how many steps those were."""
    for i, (p, name) in enumerate(zip(prompts, loras)):
        core.add_request(f"{time.monotonic_ns()}-{i}", p, SamplingParams(
            max_tokens=output_len, temperature=0.0, ignore_eos=True, lora=name))
    core.step()
    steps, start = 0, time.perf_counter()
    while core.has_work:
        core.step()
        steps += 1
    return 1000 * (time.perf_counter() - start) / max(steps, 1), steps
