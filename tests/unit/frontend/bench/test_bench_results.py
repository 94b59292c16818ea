"""vLLM's flat --save-result file (keys and units as vllm/benchmarks/serve.py writes them), the
flags that shape a run, and the pictures, on hand-made results (no server)."""

from __future__ import annotations

import json
import math
from datetime import datetime
from pathlib import Path

import pytest

from frontend.bench import BenchConfig, BenchResult, DatasetConfig, Round, Target
from frontend.bench.__main__ import main, plot_context
from frontend.bench.args import build_parser, config_from_args, outputs_from_args
from frontend.bench.metrics import RequestResult, summarize
from frontend.bench.plots import plot_run, plot_sweep
from frontend.bench.sweep import SweepPoint, parse_sweep, point_config
from frontend.bench.vllm_result import SaveOptions, result_path, save_vllm_result, vllm_result
from frontend.bench.workload import RampUp

# The keys `vllm bench serve --save-result` writes for a generation benchmark (vLLM 0.32's
# vllm/benchmarks/serve.py: main_async's result_json, benchmark()'s result dict and
# process_one_metric's mean_/median_/std_/p{N}_{metric}_ms).
VLLM_SETUP_KEYS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
    "request_rate", "burstiness", "max_concurrency",
}
VLLM_RESULT_KEYS = {
    "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
    "request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
    "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "errors",
    "max_output_tokens_per_s", "max_concurrent_requests",
}


def ok(start: float, times: tuple[float, ...], latency: float, tokens: int) -> RequestResult:
    return RequestResult(True, latency, times, 8, 9, tokens, start=start)


REQUESTS = [
    ok(0.0, (0.125, 0.25, 0.5), 0.625, 3),
    ok(0.25, (0.25, 0.375), 0.5, 2),
    RequestResult(False, 0.5, prompt_len=8, error="HTTP 500: boom", start=0.5),
]


def result(label: str = "A", requests: list[RequestResult] = REQUESTS) -> BenchResult:
    summary = summarize(requests, 2.0, {"ttft": 200.0}, (50.0, 99.9))
    target = Target(f"http://{label}", label=label)
    return BenchResult(target, "org/tiny", (Round(requests, 2.0),), summary)


CONFIG = BenchConfig(
    Target("http://A"), num_prompts=3, max_concurrency=4, goodput_slos_ms={"ttft": 200.0},
    percentiles=(50.0, 99.9), tokenizer="tok",
)


def test_save_result_has_vllms_keys_and_units(tmp_path: Path) -> None:
    metrics = ("ttft", "tpot", "itl", "e2el")
    content = vllm_result(CONFIG, result(), "20260101-120000", metrics=metrics)
    assert VLLM_SETUP_KEYS | VLLM_RESULT_KEYS <= set(content)
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99.9"):
            assert f"{stat}_{metric}_ms" in content
    # Statistics in ms, durations and per-request arrays in seconds, as vLLM writes them.
    assert content["mean_ttft_ms"] == pytest.approx(187.5)  # TTFTs 125 and 250 ms
    assert content["median_ttft_ms"] == pytest.approx(187.5)
    assert content["std_ttft_ms"] == pytest.approx(62.5)
    assert content["p50_itl_ms"] == pytest.approx(125.0)  # gaps 125, 250, 125 ms
    assert content["mean_tpot_ms"] == pytest.approx(250.0)  # (625-125)/2 and (500-250)/1
    assert content["mean_e2el_ms"] == pytest.approx(562.5)
    assert content["ttfts"] == [0.125, 0.25, 0.0] and content["itls"][2] == []
    assert content["itls"][0] == [0.125, 0.25] and content["latencies"] == [0.625, 0.5, 0.5]
    assert content["input_lens"] == [9, 9, 8] and content["output_lens"] == [3, 2, 0]
    assert content["start_times"] == [0.0, 0.25, 0.5] and content["errors"][2] == "HTTP 500: boom"
    assert (content["duration"], content["completed"], content["failed"]) == (2.0, 2, 1)
    assert (content["total_input_tokens"], content["total_output_tokens"]) == (18, 5)
    assert content["request_throughput"] == 1.0 and content["output_throughput"] == 2.5
    assert content["total_token_throughput"] == 11.5
    assert content["request_goodput"] == 0.5  # 1 request with TTFT <= 200 ms in 2 s
    assert content["max_concurrent_requests"] == 2
    assert (content["backend"], content["request_rate"], content["max_concurrency"]) == (
        "openai", "inf", 4,
    )
    path = save_vllm_result(tmp_path / "out" / "r.json", content)
    assert json.loads(path.read_text(), parse_constant=pytest.fail) == content


def test_unmeasured_statistics_are_zero_as_in_vllm() -> None:
    failed = [RequestResult(False, 0.5, error="x")]
    config = BenchConfig(Target("http://A"), percentiles=(99.0,))
    content = vllm_result(config, result(requests=failed), "d", metrics=("ttft",))
    assert (content["mean_ttft_ms"], content["p99_ttft_ms"], content["completed"]) == (0.0, 0.0, 0)
    assert content["request_goodput"] is None  # no SLO given
    assert "mean_tpot_ms" not in content  # only the chosen --percentile-metrics


def test_result_path_follows_vllms_pattern() -> None:
    date = "20260101-120000"
    assert result_path(CONFIG, "org/tiny", date, SaveOptions()) == Path(
        "openai-infqps-concurrency4-tiny-20260101-120000.json"
    )
    ramp = BenchConfig(Target("u"), endpoint="chat", ramp_up=RampUp("linear", 1, 8))
    assert result_path(ramp, "tiny", date, SaveOptions("lbl", "out"), "-B") == Path(
        "out/lbl-B-ramp-up-linear-1qps-8qps-tiny-20260101-120000.json"
    )
    named = SaveOptions(result_dir="d", result_filename="run.json")
    assert result_path(CONFIG, "m", date, named, "-A-c4") == Path("d/run-A-c4.json")


def parse(*flags: str) -> tuple[BenchConfig, object]:
    args = build_parser().parse_args(["serve", *flags])
    return config_from_args(args), outputs_from_args(args)


def test_flags_map_onto_datasets_and_defaults_follow_vllm() -> None:
    config, _ = parse()
    assert (config.num_prompts, config.dataset.name, config.ignore_eos) == (1000, "random", True)
    assert (config.warmup, config.settle_s) == (0, 0.0)
    config, _ = parse("--compare", "http://b")
    assert (config.warmup, config.settle_s) == (2, 2.0)  # quiet before each compared round
    config, _ = parse("--input-len", "64", "--output-len", "9", "--dataset-name", "sharegpt",
                      "--dataset-path", "f.json")
    assert config.dataset.random_input_len == 64 and config.dataset.sharegpt_output_len == 9
    assert config.ignore_eos is False  # vLLM ignores EOS for the random dataset only
    config, _ = parse("--no-ignore-eos", "--dataset-name", "prefix-repetition")
    assert config.dataset.name == "prefix_repetition" and config.ignore_eos is False
    config, outputs = parse("--extra-body", '{"temperature": 1, "seed": 3}', "--temperature",
                            "0", "--top-k", "5", "--percentile-metrics", "ttft,e2el",
                            "--metric-percentiles", "50,90", "--save-result", "--sweep",
                            "max-concurrency=1,2")
    assert config.extra_body == {"temperature": 1, "seed": 3, "top_k": 5}
    assert config.percentiles == (50.0, 90.0)
    assert outputs == outputs_from_args(build_parser().parse_args(
        ["serve", "--percentile-metrics", "ttft,e2el", "--save-result", "--sweep",
         "max-concurrency=1,2"]))


def test_the_repeat_dataset_is_greedy_unless_told() -> None:
    config, _ = parse("--dataset-name", "repeat", "--repeat-passage-len", "64")
    assert (config.dataset.name, config.dataset.repeat_passage_len) == ("repeat", 64)
    assert config.dataset.repeat_output_len is None and config.ignore_eos is False
    assert config.extra_body == {"temperature": 0.0}
    config, _ = parse("--dataset-name", "repeat", "--temperature", "0.7", "--output-len", "9")
    assert config.extra_body == {"temperature": 0.7} and config.dataset.repeat_output_len == 9
    config, _ = parse("--dataset-name", "repeat", "--extra-body", '{"temperature": 1}')
    assert config.extra_body == {"temperature": 1}
    config, _ = parse()  # other datasets leave the temperature to the server
    assert "temperature" not in config.extra_body


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1"], "ramp-up-end-rps"),
        (["--ramp-up-strategy", "linear", "--ramp-up-start-rps", "1", "--ramp-up-end-rps",
          "4", "--request-rate", "3"], "drop --request-rate"),
        (["--dataset-path", "x.json"], "drop --dataset-path"),
        (["--dataset-name", "repeat", "--repeat-passage-len", "0"], "lengths must be"),
        (["--sweep", "threads=1,2"], "max-concurrency=1,4,16"),
        (["--metric-percentiles", "p99"], "metric-percentiles"),
        (["--extra-body", "[1]"], "JSON object"),
        (["--settle", "-1"], "--settle"),
    ],
)
def test_bad_flags_say_what_to_fix(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_sweep_points_vary_the_value_and_the_seed() -> None:
    sweep = parse_sweep("max-concurrency=1,4")
    assert point_config(CONFIG, sweep, 1).max_concurrency == 4
    assert point_config(CONFIG, sweep, 1).seed == CONFIG.seed + 1
    rates = parse_sweep("request_rate=0.5,inf")
    assert math.isinf(point_config(CONFIG, rates, 1).request_rate)
    assert (rates.label(0.5), sweep.label(4)) == ("rate 0.5/s", "concurrency 4")


def test_pictures_are_written(tmp_path: Path) -> None:
    results = [result("A"), result("B")]
    ctx = plot_context(BenchConfig(Target("u"), dataset=DatasetConfig()), results, datetime.now())
    assert "org/tiny" in ctx.model and "random 1024→128 tok" in ctx.workload
    paths = plot_run(results, ctx, tmp_path)
    sweep = parse_sweep("max-concurrency=1,2")
    paths.append(plot_sweep([SweepPoint(1, results), SweepPoint(2, results)], sweep, ctx, tmp_path))
    names = sorted(p.name for p in paths)
    assert names == ["latency_cdf.png", "sweep_throughput_latency.png", "tokens_per_second.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
