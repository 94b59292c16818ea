"""`tandem bench serve` against one real `tandem serve` of the checked model, run after run
(`Sizes.serve_runs`: on the GPU c256 with 1024 prompts of 1024 + 128 tokens, c64 with 128 of
1024 + 128, c1 with 16 of 256 + 256), each beside the benchmark's floor (tests/device/roofline.py)
and issue 39's targets.

The in-process engines and models give their memory back first. The server's log goes to
serve.log, every run's tables to bench.txt and their full results, by run, to bench_serve.json.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.device.context import Context, ServeRun
from tests.device.roofline import ModelShape, fraction
from tests.device.targets import all_met, target
from tests.e2e.server import free_port

READY_TIMEOUT_S = 240.0
DTYPE = "bfloat16"  # what `tandem serve` runs on the GPU
LABELS = {"output_tok_s": "output tok/s", "tpot_median_ms": "TPOT p50",
          "itl_p99_ms": "ITL p99", "ttft_median_ms": "TTFT p50"}


def serve(ctx: Context) -> dict[str, Any]:
    ctx.release()
    s = ctx.sizes
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    longest = max(run.input_len + run.output_len for run in s.serve_runs)
    cmd = [sys.executable, "-m", "frontend.cli", "serve", ctx.model, "--port", str(port),
           "--max-model-len", str(longest + 64), "--log-level", "warning", *ctx.serve_args]
    if s.serve_kv_cache_bytes:
        cmd += ["--kv-cache-memory", str(s.serve_kv_cache_bytes)]
    if s.threads:
        cmd += ["--num-threads", str(s.threads)]
    runs: dict[str, dict[str, Any]] = {}
    (ctx.out / "bench.txt").write_text("")
    with (ctx.out / "serve.log").open("w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            started = time.perf_counter()
            wait_healthy(url, server, ctx.out / "serve.log")
            ready_s = time.perf_counter() - started
            for run in s.serve_runs:
                runs[run.name] = bench(ctx, url, run)
        finally:
            stop(server)
    targets = [t for figures in runs.values() for t in figures["targets"]]
    done = all(figures["failed"] == 0 and figures["completed"] > 0 for figures in runs.values())
    met = all_met(targets)
    return {"command": " ".join(cmd[1:]), "ready_s": round(ready_s, 2), "runs": runs,
            "targets": targets, "passed": done and met is not False}


def wait_healthy(url: str, server: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"tandem serve exited with {server.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"tandem serve was not healthy within {READY_TIMEOUT_S:.0f} s")


def bench(ctx: Context, url: str, run: ServeRun) -> dict[str, Any]:
    """One benchmark run: its figures, its floor, its targets. Its tables are appended to
    bench.txt and its result, under its name, to bench_serve.json."""
    result = Path(tempfile.mkdtemp(prefix="tandem-bench-")) / "result.json"
    cmd = [sys.executable, "-m", "frontend.bench", "serve", "--base-url", url,
           "--tokenizer", ctx.model, "--dataset-name", "random",
           "--random-input-len", str(run.input_len), "--random-output-len", str(run.output_len),
           "--num-prompts", str(run.prompts), "--max-concurrency", str(run.concurrency),
           "--warmup", "2", "--seed", str(int(time.time())), "--disable-tqdm",
           "--metric-percentiles", "50,90,99", "--result-file", str(result)]
    with (ctx.out / "bench.txt").open("a") as out:
        out.write(f"== {run.name}: concurrency {run.concurrency}, {run.prompts} prompts of "
                  f"{run.input_len} + {run.output_len} tokens\n")
        out.flush()
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = (ctx.out / "bench.txt").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"tandem bench serve ({run.name}) exited with {done.returncode}:\n"
                           f"{tail}")
    full = json.loads(result.read_text())
    shutil.rmtree(result.parent)
    saved = ctx.out / "bench_serve.json"
    everything = json.loads(saved.read_text()) if saved.exists() else {}
    saved.write_text(json.dumps({**everything, run.name: full}, indent=2))
    figures = summary_figures(full["results"][0]["summary"])
    figures |= serve_roofline(ModelShape.of_model(ctx.model, DTYPE), run, figures)
    judged = ctx.device == "cuda"
    figures["targets"] = [target(f"{run.name} {LABELS[metric]}", figures.get(metric), op,
                                 bound, "tok/s" if metric.endswith("tok_s") else "ms", judged)
                          for metric, op, bound in run.targets]
    return {"concurrency": run.concurrency, "prompts": run.prompts,
            "input_len": run.input_len, "output_len": run.output_len, **figures}


def serve_roofline(shape: ModelShape, run: ServeRun, figures: dict[str, Any]) -> dict[str, Any]:
    """The run's floor (every prefill at the FLOP peak, the decode steps at the memory
    bandwidth) as output tok/s, and the decode step's floor at this concurrency, the least a
    TPOT can be."""
    floor_s = shape.run_floor_s(run.prompts, run.concurrency, run.input_len, run.output_len)
    floor_tok_s = run.prompts * run.output_len / floor_s
    step_s = shape.decode_step_floor_s(min(run.prompts, run.concurrency),
                                       run.input_len + run.output_len / 2)
    return {"floor_output_tok_s": floor_tok_s,
            "output_fraction": fraction(figures["output_tok_s"], floor_tok_s),
            "tpot_floor_ms": 1e3 * step_s}


def summary_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """The figures issue 13 asks for, from the benchmark's summary."""
    def stat(metric: str, which: str) -> float | None:
        stats = summary.get(f"{metric}_ms")
        if not stats:
            return None
        if which in ("mean", "median"):
            return float(stats[which])
        return next((float(v) for k, v in stats["percentiles"].items() if float(k) == 99), None)

    return {"completed": summary["completed"], "failed": summary["failed"],
            "duration_s": summary["duration_s"],
            "output_tok_s": summary["output_throughput"],
            "total_tok_s": summary["total_token_throughput"],
            "max_concurrent_requests": summary.get("max_concurrent_requests"),
            **{f"{m}_{w}_ms": stat(m, w) for m in ("ttft", "tpot", "itl")
               for w in ("median", "p99")}}


def stop(server: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the launcher's process group (it stops its children), SIGKILL if it stays."""
    if server.poll() is not None:
        return
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
