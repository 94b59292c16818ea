"""`tandem bench serve` against a real `tandem serve` of the checked model: random prompts of
`serve_input_len` tokens, `serve_output_len` output tokens, `serve_concurrency` in flight.

The in-process engines and models give their memory back first. The server's log goes to
serve.log, the benchmark's tables to bench.txt and its full result to bench_serve.json.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.device.context import Context
from tests.e2e.server import free_port

READY_TIMEOUT_S = 240.0


def serve(ctx: Context) -> dict[str, Any]:
    ctx.release()
    s = ctx.sizes
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "frontend.cli", "serve", ctx.model, "--port", str(port),
           "--max-model-len", str(s.serve_input_len + s.serve_output_len + 64),
           "--log-level", "warning", *ctx.serve_args]
    if s.serve_kv_cache_bytes:
        cmd += ["--kv-cache-memory", str(s.serve_kv_cache_bytes)]
    if s.threads:
        cmd += ["--num-threads", str(s.threads)]
    with (ctx.out / "serve.log").open("w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            started = time.perf_counter()
            wait_healthy(url, server, ctx.out / "serve.log")
            ready_s = time.perf_counter() - started
            figures = bench(ctx, url)
        finally:
            stop(server)
    return {"command": " ".join(cmd[1:]), "ready_s": round(ready_s, 2), **figures}


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


def bench(ctx: Context, url: str) -> dict[str, Any]:
    s = ctx.sizes
    result = ctx.out / "bench_serve.json"
    cmd = [sys.executable, "-m", "frontend.bench", "serve", "--base-url", url,
           "--tokenizer", ctx.model, "--dataset-name", "random",
           "--random-input-len", str(s.serve_input_len),
           "--random-output-len", str(s.serve_output_len),
           "--num-prompts", str(s.serve_prompts), "--max-concurrency", str(s.serve_concurrency),
           "--warmup", "2", "--seed", str(int(time.time())), "--disable-tqdm",
           "--metric-percentiles", "50,90,99", "--result-file", str(result)]
    with (ctx.out / "bench.txt").open("w") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = (ctx.out / "bench.txt").read_text(errors="replace")[-2000:]
        raise RuntimeError(f"tandem bench serve exited with {done.returncode}:\n{tail}")
    return summary_figures(json.loads(result.read_text())["results"][0]["summary"])


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
               for w in ("median", "p99")},
            "passed": summary["failed"] == 0 and summary["completed"] > 0}


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
