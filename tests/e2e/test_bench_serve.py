"""`tandem bench serve` against real servers on the tiny default model: every dataset, a small
sweep with pictures, vLLM-format result files, and --compare against a second real server.
Requests are few and short so the file stays well under a minute."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from frontend.bench.__main__ import main
from tests.e2e.server import Server

DATA = Path(__file__).parents[1] / "data" / "bench"
SHORT = ["--num-prompts", "4", "--disable-tqdm", "--seed", "5"]


@pytest.fixture(scope="module")
def servers(tiny_llama, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("bench-e2e")
    started = [Server(tiny_llama, workdir, "--max-model-len", "1024") for _ in range(2)]
    yield [srv.wait_healthy() for srv in started]
    for srv in started:
        assert srv.stop() == 0


def bench(servers: list[Server], tiny_llama: Path, *flags: str) -> int:
    return main(["serve", "--base-url", servers[0].url, "--tokenizer", str(tiny_llama),
                 *SHORT, *flags])


def saved(folder: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))]


@pytest.mark.parametrize(
    "dataset",
    [
        ["--dataset-name", "random", "--random-input-len", "24", "--random-output-len", "6",
         "--random-range-ratio", "0.5", "--random-prefix-len", "8"],
        ["--dataset-name", "sharegpt", "--dataset-path", str(DATA / "sharegpt_sample.json"),
         "--sharegpt-output-len", "6"],
        ["--dataset-name", "custom", "--dataset-path", str(DATA / "custom_sample.jsonl"),
         "--ignore-eos", "--output-len", "5"],
        ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "16",
         "--prefix-repetition-suffix-len", "8", "--prefix-repetition-num-prefixes", "2",
         "--prefix-repetition-output-len", "6"],
    ],
    ids=["random", "sharegpt", "custom", "prefix_repetition"],
)
def test_each_dataset_runs_and_saves_vllms_file(
    servers: list[Server], tiny_llama: Path, tmp_path: Path, dataset: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert bench(servers, tiny_llama, *dataset, "--save-result", "--result-dir", str(tmp_path),
                 "--metric-percentiles", "50,99", "--extra-body", '{"temperature": 0}') == 0
    (result,) = saved(tmp_path)
    assert (result["completed"], result["failed"], result["num_prompts"]) == (4, 0, 4)
    assert len(result["ttfts"]) == len(result["itls"]) == 4
    assert result["p99_ttft_ms"] >= result["p50_ttft_ms"] > 0
    assert result["total_output_tokens"] == sum(result["output_lens"]) > 0
    assert "P99 TTFT (ms):" in capsys.readouterr().out


def test_sweep_writes_a_curve_and_a_file_per_point(
    servers: list[Server], tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench(servers, tiny_llama, "--input-len", "16", "--output-len", "6", "--sweep",
                 "max-concurrency=1,4", "--plot", str(tmp_path / "plots"), "--save-result",
                 "--result-dir", str(tmp_path)) == 0
    files = sorted(p.name for p in tmp_path.glob("*.json"))
    assert len(files) == 2 and "concurrency1" in files[0] and "-c4-" in files[1]
    assert [r["max_concurrency"] for r in saved(tmp_path)] == [1, 4]
    pictures = {p.name for p in (tmp_path / "plots").iterdir()}
    assert "sweep_throughput_latency.png" in pictures and "latency_cdf-c4.png" in pictures
    assert "Sweep" in capsys.readouterr().out


def test_compare_against_a_second_server(
    servers: list[Server], tiny_llama: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench(servers, tiny_llama, "--input-len", "16", "--output-len", "6", "--compare",
                 servers[1].url, "--rounds", "2", "--warmup", "1", "--settle", "0.1",
                 "--plot", str(tmp_path),
                 "--save-result", "--result-dir", str(tmp_path), "--result-file",
                 str(tmp_path / "rich.out")) == 0
    a, b = saved(tmp_path)
    assert (a["base_url"], b["base_url"]) == (servers[0].url, servers[1].url)
    assert a["completed"] == b["completed"] == 8  # two rounds of four
    assert {"latency_cdf.png", "tokens_per_second.png"} <= {p.name for p in tmp_path.iterdir()}
    rich = json.loads((tmp_path / "rich.out").read_text())
    assert [r["target"]["label"] for r in rich["results"]] == ["A", "B"]
    assert "A/B" in capsys.readouterr().out
