"""fp8 weights on the device (issue 43): the checked model in-process, bf16 against the same
build with FP8_OPTIONS (`--quantization fp8` and `--kv-cache-dtype fp8`: decoder weights in
e4m3 with per-channel scales, activations per token, products on torch._scaled_mm; the KV cache
in e4m3 with scales from the first batch), one engine at a time:

- a decode step at batch `Sizes.batch` (median wall time of `timed_steps` decode-only steps,
  after the prefill and one untimed step): fp8's over bf16's, target <= 0.65;
- output tokens/s with `fp8_batch` requests of `fp8_input_len` + `fp8_output_len` added at
  once (the in-process engine, as tests/bench/engine_throughput.py drives it, not
  `tandem bench serve` against a server: two more servers would cost the check minutes):
  fp8's over bf16's, target >= 1.3;
- teacher-forced agreement: transformers' bf16 model scores each prompt followed by the fp8
  engine's greedy tokens; the share of those tokens at its argmax, target >= 0.9. The bf16
  engine's own share stands beside it, the floor that kernels alone leave.

The dry run rehearses the GPU's path: its fp8 engine runs torch._scaled_mm on the CPU.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from engine_core.engine import EngineCore
from engine_core.quant.fp8 import Fp8Linear
from shared.messages import SamplingParams
from tests.bench.engine_throughput import make_prompts
from tests.device.check_speed import drive
from tests.device.context import Context, EngineRunError, sampled
from tests.device.targets import (
    FP8_ARGMAX_AGREEMENT,
    FP8_DECODE_STEP_RATIO,
    FP8_OUTPUT_TOK_S_RATIO,
    all_met,
    target,
)
from tests.engine.driver import run

DTYPE = "bfloat16"
# what the fp8 engine adds to the bf16 one (EngineConfig fields); the KV cache's fp8 joins here
# fp8 weights and the fp8 KV cache (scales from the first batch: the shape has none)
FP8_OPTIONS: dict[str, Any] = {"quantization": "fp8", "kv_cache_dtype": "fp8",
                               "calculate_kv_scales": True}


def fp8(ctx: Context) -> dict[str, Any]:
    ctx.release()
    s = ctx.sizes
    vocab = ctx.engine(DTYPE, options=_options(ctx, {})).facts.vocab_size
    decode_prompts = make_prompts(s.batch, s.input_len, vocab, seed=21)
    batch = make_prompts(s.fp8_batch, s.fp8_input_len, vocab, seed=22)
    scored = make_prompts(s.fp8_prompts, s.input_len, vocab, seed=23)
    figures: dict[str, dict[str, Any]] = {}
    greedy: dict[str, list[list[int]]] = {}
    for name, options in (("bf16", {}), ("fp8", FP8_OPTIONS)):
        core = ctx.engine(DTYPE, options=_options(ctx, options))
        decoder: Any = core.runner.decoder
        layer = decoder.layers[0].mlp.down_proj
        drive(core, make_prompts(4, 16, vocab, seed=20), 4, f"warm-{name}")
        figures[name] = {
            "linear": (("scaled_mm" if layer.scaled_mm else "dequantized")
                       if isinstance(layer, Fp8Linear) else type(layer).__name__),
            "decode_step_ms": decode_step_ms(core, decode_prompts, s.timed_steps),
            "batch": drive(core, batch, s.fp8_output_len, f"batch-{name}")}
        greedy[name] = _greedy(core, scored, s.fp8_new_tokens)
        ctx.release(DTYPE)
    agreement = {name: argmax_agreement(ctx.hf_model(DTYPE), scored, tokens, ctx.device)
                 for name, tokens in greedy.items()}
    ctx.release()
    step_ratio = figures["fp8"]["decode_step_ms"] / figures["bf16"]["decode_step_ms"]
    tok_s_ratio = figures["fp8"]["batch"]["tok_s"] / figures["bf16"]["batch"]["tok_s"]
    judged = ctx.device == "cuda"
    targets = [
        target(f"decode step at batch {s.batch}: fp8 / bf16", round(step_ratio, 3), "<=",
               FP8_DECODE_STEP_RATIO, "x", judged),
        target(f"output tok/s, {s.fp8_batch} at once, {s.fp8_input_len}+{s.fp8_output_len}: "
               "fp8 / bf16", round(tok_s_ratio, 3), ">=", FP8_OUTPUT_TOK_S_RATIO, "x", judged),
        target("fp8 tokens at bf16's argmax (teacher-forced)", round(agreement["fp8"], 4),
               ">=", FP8_ARGMAX_AGREEMENT, "share", judged)]
    return {"options": FP8_OPTIONS, "engines": figures, "argmax_agreement": agreement,
            "scored_tokens": s.fp8_prompts * s.fp8_new_tokens, "targets": targets,
            "passed": all_met(targets)}


def _options(ctx: Context, options: dict[str, Any]) -> dict[str, Any]:
    """The stage's engines' fields: a KV cache that holds the whole batch, and `options`."""
    room = {} if ctx.sizes.fp8_kv_cache_bytes is None else {
        "kv_cache_memory": ctx.sizes.fp8_kv_cache_bytes}
    return room | options


def decode_step_ms(core: EngineCore, prompts: list[list[int]], steps: int) -> float:
    """The median wall time of `steps` decode-only steps of `prompts` at once."""
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    errors = core.stats().step_errors
    for i, prompt in enumerate(prompts):
        core.add_request(f"step{i}", prompt, params)
    started: set[str] = set()
    while len(started) < len(prompts):
        sampled(core.step(), started)
    core.step()  # a first decode-only step, untimed
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()  # returns host data: the step's device work is done
        walls.append(time.perf_counter() - start)
    while core.has_work:
        core.step()
    if core.stats().step_errors != errors:
        raise EngineRunError(f"{core.stats().step_errors - errors} engine step(s) failed")
    return 1e3 * float(np.median(walls))


def _greedy(core: EngineCore, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(f"tf{i}", prompt, params)
    results = run(core)
    tokens = [results[f"tf{i}"].token_ids for i in range(len(prompts))]
    if any(len(t) != new_tokens for t in tokens):
        raise EngineRunError("a greedy request ended early")
    return tokens


@torch.inference_mode()
def argmax_agreement(model: Any, prompts: list[list[int]], tokens: list[list[int]],
                     device: str) -> float:
    """The share of `tokens` (each prompt's continuation) at `model`'s argmax, each scored
    after the prompt and the tokens before it."""
    same = total = 0
    for prompt, continuation in zip(prompts, tokens):
        ids = torch.tensor([prompt + continuation], device=device)
        logits = model(ids).logits[0, len(prompt) - 1:-1]
        same += int((logits.argmax(-1).cpu() == torch.tensor(continuation)).sum())
        total += len(continuation)
    return same / total
