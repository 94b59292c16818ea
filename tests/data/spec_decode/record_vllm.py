"""Record vLLM's speculative-decoding counters as its own Prometheus code writes them.

Run once with a vLLM venv (`shared/peers/install_vllm_cpu.sh DIR`), from anywhere:

    DIR/bin/python tests/data/spec_decode/record_vllm.py

It writes, beside itself, `metrics.txt` and `VERSIONS` (see README.md). The counters are made
by vLLM's `SpecDecodingProm` exactly as its `PrometheusStatLogger` makes them (label names
`model_name` and `engine`, one label set per data-parallel engine, the speculative config of
`--speculative-config '{"method": "ngram", "num_speculative_tokens": 3, ...}'`), fed through
`observe` with the `SpecDecodingStats` its scheduler would fill for the drafts of the scenario,
and written by prometheus_client's `generate_latest` from the default registry, as vLLM's
/metrics answers with one API server. Only the `vllm:spec_decode_*` lines are kept (the
registry also holds the process and GC collectors). Nothing here imports Tandem.
"""

from __future__ import annotations

import sys
from importlib.metadata import version
from pathlib import Path

import vllm
from prometheus_client import REGISTRY, generate_latest
from vllm.config import SpeculativeConfig
from vllm.v1.spec_decode.metrics import SpecDecodingProm, SpecDecodingStats

HERE = Path(__file__).resolve().parent
MODEL = "golden-model"
K = 3
# Per engine, the accepted count of each draft of K tokens (README.md's scenario).
DRAFTS = {0: [3, 3, 3, 2, 2, 2, 1, 1, 0, 0], 1: [2, 1, 0, 0]}
PREFIX = "vllm:spec_decode"


def stats(accepted: list[int]) -> SpecDecodingStats:
    step = SpecDecodingStats.new(K)
    for count in accepted:
        step.observe_draft(num_draft_tokens=K, num_accepted_tokens=count)
    return step


def spec_lines(text: str) -> list[str]:
    """The exposition's lines that belong to vLLM's spec_decode families."""
    def name(line: str) -> str:
        return line.split(" ")[2] if line.startswith("# ") else line
    return [line for line in text.splitlines() if name(line).startswith(PREFIX)]


def main() -> None:
    labelnames = ["model_name", "engine"]  # PrometheusStatLogger's
    per_engine = {idx: [MODEL, str(idx)] for idx in DRAFTS}
    off = SpecDecodingProm(None, labelnames, per_engine)  # no --speculative-config
    if spec_lines(generate_latest(REGISTRY).decode()) or off.spec_decoding_enabled:
        sys.exit("vLLM published spec_decode counters without a speculative config")
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=K, prompt_lookup_max=4,
                               prompt_lookup_min=2)
    prom = SpecDecodingProm(config, labelnames, per_engine)
    for idx, accepted in DRAFTS.items():
        prom.observe(stats(accepted), engine_idx=idx)
    lines = spec_lines(generate_latest(REGISTRY).decode())
    (HERE / "metrics.txt").write_text("\n".join(lines) + "\n")
    (HERE / "VERSIONS").write_text(
        f"metrics.txt: vllm {vllm.__version__} (vllm-cpu), prometheus_client "
        f"{version('prometheus_client')}, Python {sys.version.split()[0]}\n")
    print(f"wrote {len(lines)} lines to {HERE / 'metrics.txt'}")


if __name__ == "__main__":
    main()
