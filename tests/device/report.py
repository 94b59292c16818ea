"""The device check's record: gpu_check.json (everything) and gpu_check.md (one readable table,
the stages' errors under it), both rewritten after every stage."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from tests.device.context import Context


def environment(ctx: Context) -> dict[str, Any]:
    env: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": ctx.device,
        "dry_run": ctx.device != "cuda",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpus": os.cpu_count(),
        "commit": _commit(),
    }
    for package in ("transformers", "triton", "tokenizers", "msgspec", "pyzmq", "xxhash",
                    "aiohttp", "uvloop"):
        try:
            env[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            env[package] = None
    if ctx.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    return env


def _commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5, check=False)
    except OSError:
        return None
    return done.stdout.strip() or None


def write_report(out: Path, report: dict[str, Any]) -> str:
    """Write both files; return the markdown."""
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str))
    text = markdown(report)
    (out / "gpu_check.md").write_text(text)
    return text


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    where = env.get("gpu") or f"CPU dry run ({env['cpus']} CPUs)"
    lines = [f"# Tandem device check: {where}, {env['date']}", "",
             f"torch {env['torch']} (CUDA {env['cuda']}), transformers {env['transformers']}, "
             f"triton {env['triton']}, Python {env['python']}, commit {env['commit']}; "
             f"model {report['sizes']['spec']['name']}", "",
             "| stage | ran | target | seconds | figures |", "|---|---|---|---|---|"]
    errors = []
    for name, record in report["stages"].items():
        ran = "ok" if record["ok"] else ("skipped" if "skipped" in record else "FAILED")
        verdict = {True: "met", False: "missed", None: "-"}[record.get("passed")]
        figures = _FIGURES[name](record) if record["ok"] else record.get("skipped", "")
        lines.append(f"| {name} | {ran} | {verdict} | {record.get('seconds', '')} | {figures} |")
        if "error" in record:
            errors.append(f"- {name}: {record['error']}")
    lines += _targets(report["stages"])
    if errors:
        lines += ["", "Errors (tracebacks in gpu_check.json):", *errors]
    return "\n".join(lines) + "\n"


def _targets(stages: dict[str, Any]) -> list[str]:
    """One row per target a stage judged (issue 39's): measured, bound, met."""
    rows = []
    for name, record in stages.items():
        for t in record.get("targets", []) if record["ok"] else []:
            met = {True: "met", False: "missed", None: "-"}[t["met"]]
            op = "" if t["unit"] == "yes/no" else {"<=": "≤ ", ">=": "≥ "}[t["op"]]
            rows.append(f"| {name} | {t['name']} | {_value(t['value'], t['unit'])} | "
                        f"{op}{_value(t['bound'], t['unit'])} | {met} |")
    if not rows:
        return []
    return ["", "| stage | target | measured | bound | met |", "|---|---|---|---|---|", *rows]


def _value(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit == "yes/no":
        return "yes" if value else "no"
    text = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    return f"{text} {unit}".strip()


def _build(r: dict[str, Any]) -> str:
    return f"{r['spec']}, {r['weights_bytes'] / 1e9:.2f} GB of weights, built in {r['build_s']} s"


def _fp32(r: dict[str, Any]) -> str:
    return (f"{r['tokens_equal']}/{r['prompts']} prompts token-exact (longest "
            f"{r['longest_prompt']}, {r['chunked_prefills']} chunked prefills), max "
            f"logprob diff {r['max_abs_logprob_diff']:.1e} (≤ 1e-4){_leak(r)}")


def _bf16(r: dict[str, Any]) -> str:
    return (f"{r['in_reference_top5']}/{r['tokens']} tokens in the reference's top-5, max "
            f"logprob gap {r['max_logprob_gap']:.3f} (< 0.1), argmax agreement "
            f"{r['argmax_agreement']:.1%}{_leak(r)}")


def _leak(r: dict[str, Any]) -> str:
    held = r.get("blocks_in_use_after")
    return f", {held} KV blocks still in use after the run" if held else ""


def _structured(r: dict[str, Any]) -> str:
    return (f"{r['requests']} constrained requests ({r['dtype']}): {r['finished']['stop']} "
            f"complete and valid, {r['finished']['length']} cut by max_tokens, "
            f"{len(r['failures'])} wrong; decode step at batch {r['batch']} ({r['full_steps']} "
            f"full steps): free {r['free_step_ms']:.2f} ms, constrained "
            f"{r['constrained_step_ms']:.2f} ms ({r['constrained_over_free']:.2f}× the "
            f"speed){_leak(r)}")


def _kernels(r: dict[str, Any]) -> str:
    parts = []
    for name, record in r["kernels"].items():
        cases = ", ".join(f"{c['batch']}x{c['context']}: " + (
            f"{c['ms']:.3f} ms (err {c['max_error']:.1e})" if "ms" in c else "ERROR")
            for c in record["cases"])
        parts.append(f"{name} {'ok' if record['ok'] else 'FAILED'} [{cases}]")
    fallbacks = ", ".join(r["fallbacks"].values())
    return "; ".join(parts) + (f"; fallbacks for later stages: {fallbacks}" if fallbacks else "")


def _roof(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:.2g}×"


def _throughput(r: dict[str, Any]) -> str:
    def one(label: str, e: dict[str, Any], ratio: float) -> str:
        roof = e["roofline"]
        return (f"{label} {e['tok_s']:.0f} tok/s ({e['decode_tok_s']:.0f} decoding, ratio "
                f"{ratio:.2f}; decode step {roof['decode_step_ms']:.2f} ms = "
                f"{_roof(roof['decode_fraction'])} its roofline; per decode step host "
                f"{e['decode_host_ms']:.2f} ms + wait {e['decode_wait_ms']:.2f} ms)")

    base = r["baselines"][r["baseline_used"]]
    graph = r["baselines"].get("hf_static_graph", {})
    if "replays_eager" in graph:
        exact, served = graph["replay_float32"], graph["replay"]
        replay = (f"graph loop vs eager: float32 {exact['free_running_agreement']:.1%} free "
                  f"running, {exact['lockstep_agreement']:.1%} step by step (logits within "
                  f"{exact['max_rel_logit_error']:.1e}); {served['dtype']} "
                  f"{served['free_running_agreement']:.1%} free running, "
                  f"{served['lockstep_agreement']:.1%} step by step (within "
                  f"{served['max_rel_logit_error']:.1e})")
    else:
        replay = f"graph loop: {graph.get('error', 'not run')}"
    return (f"batch {r['batch']}, {r['input_len']}+{r['output_len']}: "
            f"{one('engine+graphs', r['engine'], r['ratio'])}, "
            f"{one('eager', r['engine_eager'], r['ratio_eager'])}, "
            f"{one('graphs+async', r['engine_async'], r['ratio_async'])} vs "
            f"{r['baseline_used']} {base['tok_s']:.0f} ({base['decode_tok_s']:.0f}); "
            f"{replay}")


def _profile(r: dict[str, Any]) -> str:
    text = (f"decode step {r['wall_ms']:.2f} ms at batch {r['batch']}, context {r['context']} "
            f"(floor {r['floor_ms']:.2f} ms: {_roof(r['roofline_fraction'])}; host "
            f"{r.get('host_ms', 0):.2f} ms before the wait, {r.get('wait_ms', 0):.2f} ms in it)")
    if "gpu_kernel_ms" in r:
        text += (f", GPU kernels {r['gpu_kernel_ms']:.2f} ms ({r['kernels_per_step']:.0f} "
                 f"launches): {r['outside_gpu_share']:.0%} outside kernels")
    replays = r.get("mixed_graph_replays")
    text += (f"; {r['mixed_steps']} mixed steps (a prompt's prefill beside the decodes): host "
             f"{r['mixed_host_ms']:.2f} ms, wall {r['mixed_wall_ms']:.2f} ms"
             + ("" if replays is None else f", {replays} graph replays"))
    return text + "; table in profile.txt"


def _serve(r: dict[str, Any]) -> str:
    def ms(run: dict[str, Any], key: str) -> str:
        return "-" if run.get(key) is None else f"{run[key]:.1f}"

    parts = []
    for name, run in r["runs"].items():
        parts.append(
            f"{name} ({run['prompts']} × {run['input_len']}+{run['output_len']}): "
            f"{run['completed']} done, {run['failed']} failed, output {run['output_tok_s']:.0f} "
            f"tok/s ({_roof(run['output_fraction'])} of its floor "
            f"{run['floor_output_tok_s']:.0f}), TTFT p50 {ms(run, 'ttft_median_ms')} ms, TPOT "
            f"p50 {ms(run, 'tpot_median_ms')} ms (floor {run['tpot_floor_ms']:.2f}), ITL p99 "
            f"{ms(run, 'itl_p99_ms')} ms")
    return f"server ready in {r['ready_s']} s; " + "; ".join(parts) + " (bench.txt)"


def _spec(r: dict[str, Any]) -> str:
    c1, cb = r["batch1_ms_per_token"], r["batch_tok_s"]
    return (f"copying model follows its chain {r['chain_tokens_followed']}; batch 1: "
            f"{c1['plain']:.2f} → {c1['ngram']:.2f} ms a token "
            f"({c1['ngram'] / c1['plain']:.2f}×), acceptance length "
            f"{r['acceptance_length']}; batch: {cb['plain']:.0f} → {cb['ngram']:.0f} tok/s "
            f"({cb['ngram'] / cb['plain']:.2f}×)")


def _fp8(r: dict[str, Any]) -> str:
    bf16, fp8 = r["engines"]["bf16"], r["engines"]["fp8"]
    agree = r["argmax_agreement"]
    return (f"fp8 ({fp8['linear']}) vs bf16: decode step {bf16['decode_step_ms']:.2f} → "
            f"{fp8['decode_step_ms']:.2f} ms; batch {bf16['batch']['tok_s']:.0f} → "
            f"{fp8['batch']['tok_s']:.0f} tok/s; teacher-forced argmax agreement with bf16 "
            f"{agree['fp8']:.3f} (bf16 engine's own {agree['bf16']:.3f})")


def _lora(r: dict[str, Any]) -> str:
    ms = r["decode_step_ms"]
    return (f"decode step {ms['base']:.2f} ms base-only → {ms['mixed']:.2f} ms with 4 adapters "
            f"mixed ({r['ratio']:.2f}×), {r['graph_replays']} graph replays")


_FIGURES: dict[str, Callable[[dict[str, Any]], str]] = {
    "build": _build, "kernels": _kernels, "parity_fp32": _fp32, "parity_bf16": _bf16,
    "structured": _structured,
    "throughput": _throughput,
    "profile": _profile, "serve": _serve, "spec": _spec, "fp8": _fp8,
    "lora": _lora,
}


if __name__ == "__main__":  # re-render a saved record: python -m tests.device.report FILE
    print(markdown(json.loads(Path(sys.argv[1]).read_text())))
