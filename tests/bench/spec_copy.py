"""Speculative decoding where the output repeats the prompt: n-gram speculation against the same
engine without it, in-process, in one run.

    .venv/bin/python tests/bench/spec_copy.py [--base tandem-qwen2.5-0.5b-shape] [--batches 1,4]
        [--cycle 48] [--output-len 128] [--rounds 3] [--k 4]

The embedded models have random weights, and a random model never copies its prompt, so what
n-gram proposals accept on it says nothing of a copying workload (docs/benchmarks.md). This
benchmark builds a model that does copy, from the base model's shape and weights: every layer
is still computed in full (the CPU's GEMMs cost the same whatever the weights hold), but the
attention and MLP outputs are zeroed (o_proj, down_proj), so the last hidden state is the
current token's embedding, and the LM head maps token t to pi(t) for a permutation pi made of
cycles of `--cycle` tokens: a first-order chain. A prompt that walks one whole cycle and some
more is continued, token for token, by the same cycle, so its output repeats its prompt, which
n-gram lookup finds. The benchmark checks that the plain engine's greedy output does follow the
chain, then times batches of such requests (new cycles every round, so nothing is a prefix-cache
hit) with and without `--speculative-config` (n-gram, k, lookup 2..4, no batch bound),
alternating, and prints tokens/s and the ratio of each batch's best rounds.

Load from other jobs changes both sides of a round alike; compare ratios, not tokens/s.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from engine_core.worker.default_model import BUILTIN, ensure_model
from shared.messages import SamplingParams
from shared.speculative import parse_speculative_config
from shared.step_outputs import unpack_step

FIRST_ID = 1000  # chains stay clear of the special and byte tokens at both ends


def chain_model(base: Path, dest: Path, cycle: int, seed: int = 0) -> list[list[int]]:
    """Write the copying model (see the module docstring) into `dest`; its cycles."""
    tensors = load_file(str(base / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    vocab = embed.shape[0]
    ids = list(range(FIRST_ID, vocab - FIRST_ID))
    random.Random(seed).shuffle(ids)
    cycles = [ids[i:i + cycle] for i in range(0, len(ids) - cycle + 1, cycle)]
    source = torch.arange(vocab)  # lm_head row j is the embedding of the token before j
    for c in cycles:
        for a, b in zip(c, c[1:] + c[:1]):
            source[b] = a
    for name, t in tensors.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            t.zero_()
    tensors["model.norm.weight"] = torch.ones_like(tensors["model.norm.weight"])
    tensors["lm_head.weight"] = embed[source].clone()
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / "model.safetensors"))
    config = json.loads((base / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    for f in base.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, dest / f.name)
    return cycles


def chain_prompt(c: list[int], start: int, length: int) -> list[int]:
    return [c[(start + i) % len(c)] for i in range(length)]


def make_engine(model: Path, k: int | None, max_model_len: int) -> EngineCore:
    spec = None if k is None else parse_speculative_config(json.dumps(
        {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2, "disable_by_batch_size": 1024}))
    return EngineCore(EngineConfig(model=str(model), num_threads=torch.get_num_threads(),
                                   max_model_len=max_model_len, speculative=spec))


def timed(core: EngineCore, prompts: list[list[int]], output_len: int,
          tag: str) -> tuple[float, dict[str, list[int]]]:
    outputs: dict[str, list[int]] = {}
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(f"{tag}{i}", p, SamplingParams(max_tokens=output_len, temperature=0.0,
                                                        ignore_eos=True))
    while core.has_work:
        for out in core.step().values():
            for row in unpack_step(out):
                if row.token_id is not None:
                    outputs.setdefault(row.request_id, []).append(row.token_id)
    return len(prompts) * output_len / (time.perf_counter() - start), outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="tandem-qwen2.5-0.5b-shape", choices=sorted(BUILTIN))
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--cycle", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()
    base = ensure_model(BUILTIN[args.base])
    prompt_len = args.cycle + 16
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "chain"
        cycles = chain_model(base, model, args.cycle)
        rng = random.Random(1)
        rng.shuffle(cycles)
        fresh = iter(cycles)
        max_len = prompt_len + args.output_len + 8
        engines = {"plain": make_engine(model, None, max_len),
                   "ngram": make_engine(model, args.k, max_len)}
        # the model copies: the plain engine's output continues each prompt's cycle
        c = next(fresh)
        _, got = timed(engines["plain"], [chain_prompt(c, 0, prompt_len)], 32, "check")
        want = chain_prompt(c, prompt_len, 32)
        same = sum(a == b for a, b in zip(got["check0"], want))
        print(f"model check: {same}/32 output tokens follow the prompt's chain")
        for name, core in engines.items():  # warm-up, not timed
            timed(core, [chain_prompt(next(fresh), 0, prompt_len)], 8, f"warm-{name}")
        for batch in [int(b) for b in args.batches.split(",")]:
            best = {"plain": 0.0, "ngram": 0.0}
            for r in range(args.rounds):
                for name, core in engines.items():
                    prompts = [chain_prompt(next(fresh), rng.randrange(args.cycle), prompt_len)
                               for _ in range(batch)]
                    rate, _ = timed(core, prompts, args.output_len, f"b{batch}r{r}{name}")
                    best[name] = max(best[name], rate)
                    print(f"  batch {batch} round {r} {name}: {rate:.1f} tok/s")
            stats = engines["ngram"].stats()
            accepted = stats.spec_accepted_tokens / max(stats.spec_drafts, 1)
            print(f"batch {batch}: plain {best['plain']:.1f} tok/s, n-gram "
                  f"{best['ngram']:.1f} tok/s, ratio {best['ngram'] / best['plain']:.2f} "
                  f"(accepted per draft so far {accepted:.2f})")


if __name__ == "__main__":
    main()
