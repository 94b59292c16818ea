"""The model build, and greedy parity of the engine against Hugging Face on the same device.

fp32: tokens equal to `generate()`'s, logprobs within 1e-4 (docs/architecture.md). bf16,
vLLM's rule: the reference re-scores the engine's own tokens (teacher forcing, so one near-tie
flip does not cascade), and every engine token must be in the reference's top-5 with a logprob
gap < 0.1.
The prompts are the engine tests' mixed short ones plus a few longer than the step budget
(chunked prefill), all in one batch.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import AutoTokenizer

from engine_core.worker.default_model import ensure_model
from shared.messages import SamplingParams
from tests.device.context import Context, check_run
from tests.engine.driver import Collected, run
from tests.engine.test_hf_parity import WORDS, make_prompts

FP32_ATOL = 1e-4
BF16_TOP_K = 5
BF16_MAX_GAP = 0.1


def build(ctx: Context) -> dict[str, Any]:
    start = time.perf_counter()
    ctx.model_dir = ensure_model(ctx.sizes.spec, ctx.cache, tokenizers=ctx.tokenizers)
    weights = sum(p.stat().st_size for p in ctx.model_dir.glob("*.safetensors"))
    return {"model": ctx.model, "spec": ctx.sizes.spec.name, "weights_bytes": weights,
            "build_s": round(time.perf_counter() - start, 2)}


def parity_prompts(ctx: Context) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(ctx.model)
    prompts = make_prompts(tokenizer, n=ctx.sizes.parity_prompts)
    for i in range(ctx.sizes.long_prompts):
        words = [WORDS[(i * 5 + j * 7) % len(WORDS)] for j in range(ctx.sizes.long_prompt_len)]
        ids = tokenizer(" ".join(words)).input_ids[:ctx.sizes.long_prompt_len]
        prompts.append(ids)
    return prompts


def engine_greedy(ctx: Context, dtype: str, prompts: list[list[int]]) -> dict[str, Collected]:
    """Every prompt at once, greedy with top-5 logprobs; results by prompt index. The run
    must be whole: no step error, every request finished with its tokens (`check_run`)."""
    core = ctx.engine(dtype)
    errors = core.stats().step_errors
    params = SamplingParams(max_tokens=ctx.sizes.parity_new_tokens, temperature=0.0,
                            logprobs=BF16_TOP_K)
    for i, prompt in enumerate(prompts):
        core.add_request(f"{dtype}-{i}", prompt, params)
    results = run(core)
    check_run(core, results, {f"{dtype}-{i}": params.max_tokens for i in range(len(prompts))},
              errors)
    return {key.split("-", 1)[1]: value for key, value in results.items()}


def blocks_in_use(ctx: Context, dtype: str) -> int:
    """KV blocks still held once every request finished: 0 unless blocks leak."""
    stats = ctx.engine(dtype).stats()
    return stats.num_blocks - stats.free_blocks


def parity_fp32(ctx: Context) -> dict[str, Any]:
    prompts = parity_prompts(ctx)
    got = engine_greedy(ctx, "float32", prompts)
    chunked = ctx.engine("float32").stats().chunked_prefills
    leaked = blocks_in_use(ctx, "float32")
    model = ctx.hf_model("float32")
    mismatches: list[dict[str, Any]] = []
    max_diff = 0.0
    for i, prompt in enumerate(prompts):
        tokens, logprobs, gaps = hf_generate(model, prompt, ctx.sizes.parity_new_tokens)
        engine = got[str(i)]
        same = _common_prefix(engine.token_ids, tokens)
        diffs = [abs(a - b) for a, b in zip(engine.logprobs[:same], logprobs[:same])]
        max_diff = max([max_diff, *diffs])
        if engine.token_ids != tokens:
            mismatches.append({"prompt": i, "position": same, "prompt_len": len(prompt),
                               "engine": engine.token_ids[same:same + 3],
                               "reference": tokens[same:same + 3],
                               "reference_top2_gap": gaps[same] if same < len(gaps) else None})
    ctx.release("float32")
    return {"prompts": len(prompts), "longest_prompt": max(map(len, prompts)),
            "chunked_prefills": chunked, "tokens_equal": len(prompts) - len(mismatches),
            "max_abs_logprob_diff": max_diff, "mismatches": mismatches[:5],
            "matmul_precision": torch.get_float32_matmul_precision(),
            "blocks_in_use_after": leaked,
            "passed": not mismatches and max_diff <= FP32_ATOL and not leaked}


@torch.inference_mode()
def hf_generate(model: Any, prompt: list[int],
                new_tokens: int) -> tuple[list[int], list[float], list[float]]:
    """Greedy tokens, their logprobs and the top-1/top-2 logprob gap at each step."""
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs, gaps = [], []
    for step, token in zip(out.logits, tokens):
        lp = torch.log_softmax(step[0].float(), -1)
        top2 = lp.topk(2).values
        logprobs.append(float(lp[token]))
        gaps.append(float(top2[0] - top2[1]))
    return tokens, logprobs, gaps


def parity_bf16(ctx: Context) -> dict[str, Any]:
    prompts = parity_prompts(ctx)
    got = engine_greedy(ctx, "bfloat16", prompts)
    leaked = blocks_in_use(ctx, "bfloat16")
    model = ctx.hf_model("bfloat16")
    total = in_top = argmax_same = 0
    gaps: list[float] = []
    worst: list[dict[str, Any]] = []
    for i, prompt in enumerate(prompts):
        engine = got[str(i)]
        ref_lp, ref_top = teacher_forced(model, prompt, engine.token_ids)
        for k, token in enumerate(engine.token_ids):
            gap = abs(engine.logprobs[k] - ref_lp[k])
            top = ref_top[k]
            total += 1
            in_top += token in top
            argmax_same += token == top[0]
            gaps.append(gap)
            if token not in top or gap >= BF16_MAX_GAP:
                worst.append({"prompt": i, "position": k, "token": token, "reference_top": top,
                              "gap": gap})
    max_gap = max(gaps, default=0.0)
    return {"prompts": len(prompts), "tokens": total, "in_reference_top5": in_top,
            "argmax_agreement": argmax_same / max(total, 1), "max_logprob_gap": max_gap,
            "mean_logprob_gap": sum(gaps) / max(len(gaps), 1), "violations": worst[:5],
            "blocks_in_use_after": leaked,
            "passed": in_top == total and max_gap < BF16_MAX_GAP and not leaked}


@torch.inference_mode()
def teacher_forced(model: Any, prompt: list[int],
                   tokens: list[int]) -> tuple[list[float], list[list[int]]]:
    """The reference's view of each of `tokens` given everything before it: per position, that
    token's logprob and the reference's own top-5 ids."""
    if not tokens:
        return [], []
    ids = torch.tensor([prompt + tokens[:-1]], device=model.device)
    logits = model(input_ids=ids, logits_to_keep=len(tokens)).logits[0]
    lp = torch.log_softmax(logits.float(), -1)
    top = lp.topk(BF16_TOP_K).indices.tolist()
    picked = lp[torch.arange(len(tokens)), torch.tensor(tokens, device=lp.device)].tolist()
    return picked, top


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
