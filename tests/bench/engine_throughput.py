"""Engine throughput against the same model's bare batched forward loop, in one run.

    .venv/bin/python tests/bench/engine_throughput.py [--model DIR] [--num-requests 64]
        [--input-len 128] [--output-len 64]

The engine is driven in-process (no HTTP, no sockets): all requests are added at once, greedy,
ignore_eos. The baseline is transformers' own model with its own KV cache: one batched prefill
of every prompt, then one batched forward + argmax per output token. The ratio engine/baseline
is what to compare across machines; absolute tokens/s are noise on a shared 2-core box.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from engine_core.worker.default_model import ensure_model
from shared.messages import SamplingParams


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab - 1000) for _ in range(length)] for _ in range(n)]


def run_engine(model: str, prompts: list[list[int]], output_len: int, **config) -> float:
    core = EngineCore(EngineConfig(model=model, num_threads=torch.get_num_threads(), **config))
    for i, p in enumerate(prompts):  # warm-up request, not timed
        core.add_request(f"warm{i}", p[:8], SamplingParams(max_tokens=2, temperature=0.0))
        break
    while core.has_work:
        core.step()
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, SamplingParams(max_tokens=output_len, temperature=0.0,
                                                    ignore_eos=True))
    steps = 0
    while core.has_work:
        core.step()
        steps += 1
    elapsed = time.perf_counter() - start
    assert core.stats().generation_tokens == len(prompts) * output_len + 2
    print(f"  engine: {steps} steps, {elapsed:.2f} s")
    return len(prompts) * output_len / elapsed


@torch.inference_mode()
def run_baseline(model_dir: str, prompts: list[list[int]], output_len: int) -> float:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)
    model(ids[:1, :8])  # warm-up
    start = time.perf_counter()
    cache = DynamicCache()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    for _ in range(output_len - 1):
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    elapsed = time.perf_counter() - start
    print(f"  baseline: {output_len} forwards, {elapsed:.2f} s")
    return len(prompts) * output_len / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="model folder (default: the embedded tiny Llama)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for both sides (default: torch's own choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or str(ensure_model())
    vocab = AutoModelForCausalLM.from_pretrained(model).config.vocab_size
    prompts = make_prompts(args.num_requests, args.input_len, vocab)
    print(f"model {model}, {args.num_requests} requests x {args.input_len} prompt + "
          f"{args.output_len} output tokens, torch threads {torch.get_num_threads()}")
    engine = run_engine(model, prompts, args.output_len,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=256)
    baseline = run_baseline(model, prompts, args.output_len)
    print(f"{'':10}{'output tok/s':>14}")
    print(f"{'engine':10}{engine:14.1f}")
    print(f"{'baseline':10}{baseline:14.1f}")
    print(f"ratio engine/baseline: {engine / baseline:.2f}")


if __name__ == "__main__":
    main()
