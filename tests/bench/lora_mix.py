"""LoRA's cost on the CPU: a batch whose requests mix 4 adapters against a base-only batch of the
same size, on one in-process engine with --enable-lora, in one run.

    .venv/bin/python tests/bench/lora_mix.py [--models tandem-tiny-llama,tandem-qwen2.5-0.5b-shape]
        [--batch 16] [--prompt-len 128] [--output-len 64] [--rounds 3] [--rank 16]

Adapters: 4 random peft-format adapters of rank `--rank` on every decoder linear (q, k, v, o,
gate, up, down), written here from the model's shape. Each round times one batch of each kind,
alternating (greedy, ignore_eos, fresh random prompts so nothing is a prefix-cache hit); the
ratio is of each kind's best round. Load from other jobs changes both sides of a round alike;
compare ratios, not seconds. The target (issue 44): mixed / base <= 1.3.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from engine_core.worker.default_model import BUILTIN, ensure_model
from shared.engine_args import LoRAModule
from shared.messages import SamplingParams


def write_adapter(model: Path, folder: Path, rank: int, seed: int) -> None:
    """A random rank-`rank` LoRA of every decoder linear of `model`, in peft's format."""
    config = json.loads((model / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    widths = {"q_proj": (hidden, config["num_attention_heads"] * dim),
              "k_proj": (hidden, config["num_key_value_heads"] * dim),
              "v_proj": (hidden, config["num_key_value_heads"] * dim),
              "o_proj": (config["num_attention_heads"] * dim, hidden),
              "gate_proj": (hidden, config["intermediate_size"]),
              "up_proj": (hidden, config["intermediate_size"]),
              "down_proj": (config["intermediate_size"], hidden)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for name, (width_in, width_out) in widths.items():
            where = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{i}.{where}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, width_in, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(width_out, rank, generator=g) * 0.02
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
         "target_modules": sorted(widths)}))


def timed(core: EngineCore, prompts: list[list[int]], loras: list[str | None],
          output_len: int, tag: str) -> float:
    start = time.perf_counter()
    for i, (p, lora) in enumerate(zip(prompts, loras)):
        core.add_request(f"{tag}{i}", p, SamplingParams(max_tokens=output_len, temperature=0.0,
                                                        ignore_eos=True, lora=lora))
    while core.has_work:
        core.step()
    return time.perf_counter() - start


def bench(name: str, args: argparse.Namespace, tmp: Path) -> float:
    model = ensure_model(BUILTIN[name])
    names = [f"a{j}" for j in range(4)]
    for j, adapter in enumerate(names):
        write_adapter(model, tmp / name / adapter, args.rank, seed=j)
    core = EngineCore(EngineConfig(
        model=str(model), num_threads=torch.get_num_threads(), enable_lora=True, max_loras=4,
        max_lora_rank=args.rank, max_model_len=args.prompt_len + args.output_len + 8,
        lora_modules=tuple(LoRAModule(a, str(tmp / name / a)) for a in names)))
    vocab = core.facts.vocab_size
    rng = random.Random(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]

    kinds: dict[str, list[str | None]] = {
        "base": [None] * args.batch, "mixed": [names[i % 4] for i in range(args.batch)]}
    for kind, loras in kinds.items():  # warm-up (and the adapters into their slots)
        timed(core, prompts(args.batch, 16), loras, 4, f"warm-{kind}")
    best = dict.fromkeys(kinds, float("inf"))
    for r in range(args.rounds):
        for kind, loras in kinds.items():
            seconds = timed(core, prompts(args.batch, args.prompt_len), loras, args.output_len,
                            f"r{r}{kind}")
            best[kind] = min(best[kind], seconds)
            print(f"  {name} round {r} {kind}: {seconds:.2f} s", flush=True)
    ratio = best["mixed"] / best["base"]
    print(f"{name}: batch {args.batch} x ({args.prompt_len} + {args.output_len}) tokens, "
          f"base {best['base']:.2f} s, 4 adapters mixed {best['mixed']:.2f} s, "
          f"ratio {ratio:.3f}", flush=True)
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tandem-tiny-llama,tandem-qwen2.5-0.5b-shape")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            bench(name, args, Path(tmp))


if __name__ == "__main__":
    main()
