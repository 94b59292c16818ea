"""The flags of `tandem bench serve`: vLLM's names, defaults and groups (`vllm bench serve`),
plus Tandem's --compare, --rounds, --sweep, --plot and --result-file; and their conversion,
checked once, into a `BenchConfig` and the `Outputs` of the run."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from frontend.bench import BenchConfig, Target
from frontend.bench.datasets import DatasetConfig
from frontend.bench.metrics import LATENCY_METRICS, parse_metrics, parse_percentiles, parse_slos
from frontend.bench.sweep import Sweep, parse_sweep
from frontend.bench.vllm_result import SaveOptions
from frontend.bench.workload import RampUp, check_ramp_up

ENDPOINTS = {
    "completions": "completions",
    "chat": "chat",
    "/v1/completions": "completions",
    "/v1/chat/completions": "chat",
    "embeddings": "embeddings",
    "/v1/embeddings": "embeddings",
}
DATASET_NAMES = ("random", "sharegpt", "custom", "prefix_repetition", "prefix-repetition",
                 "repeat")
SAMPLING_FLAGS = ("temperature", "top_p", "top_k", "min_p")
SETTLE_S = 2.0  # --settle's default with --compare (BenchConfig.settle_s)
T = TypeVar("T")


def flag_type(parse: Callable[[str], T]) -> Callable[[str], T]:
    """`parse` as an argparse type: its ValueError message reaches the user."""

    def convert(value: str) -> T:
        try:
            return parse(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = parse.__name__
    return convert


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default only when it says something (not None, False or a help's own)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, [], {}) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


@dataclass(frozen=True)
class Outputs:
    """What the run prints and writes besides its tables."""

    metrics: tuple[str, ...] = LATENCY_METRICS  # --percentile-metrics
    save: SaveOptions | None = None  # --save-result
    result_file: str | None = None  # Tandem's rich JSON
    plot_dir: str | None = None
    sweep: Sweep | None = None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem bench", description="Tandem benchmarks.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server",
        description="Load-test OpenAI-compatible servers with streamed requests "
        "(vLLM's `bench serve` flags, plus A/B comparison, sweeps and pictures).",
        formatter_class=HelpFormatter,
    )
    add_general(serve)
    add_datasets(serve)
    add_traffic(serve.add_argument_group("traffic options"))
    add_sampling(serve.add_argument_group("sampling parameters"))
    add_results(serve.add_argument_group("statistics and results"))
    add_comparison(serve.add_argument_group("comparison (Tandem)"))
    return parser


def add_general(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--base-url", default="http://127.0.0.1:8000", help="server A (e.g. Tandem)")
    add("--model", help="model name (default: the first id of GET /v1/models)")
    add("--api-key", help="sent as 'Authorization: Bearer <key>'")
    add("--endpoint", type=endpoint, default="completions",
        help="completions, chat or embeddings (or vLLM's /v1/completions, "
             "/v1/chat/completions, /v1/embeddings); embeddings: each prompt is one "
             "non-streamed /v1/embeddings input, timed whole (TTFT = latency)")
    add("--tokenizer",
        help="folder or hub id (default: what GET /tokenizer_info names, else the model id)")
    add("--seed", type=int, default=0)
    add("--num-prompts", type=int, default=1000, help="requests per round")
    add("--label", help="the result file's label (default: the backend, openai or openai-chat)")
    add("--disable-tqdm", action="store_true", help="no progress bar")


def add_datasets(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dataset options")
    group.add_argument("--dataset-name", choices=DATASET_NAMES, default="random")
    group.add_argument("--dataset-path", help="the sharegpt JSON or custom JSONL file")
    group.add_argument("--input-len", type=int, help="sets --random-input-len")
    group.add_argument("--output-len", type=int, help="sets every dataset's output length")
    random = parser.add_argument_group("random dataset options")
    random.add_argument("--random-input-len", type=int, default=1024,
                        help="prompt tokens (without BOS) after the prefix")
    random.add_argument("--random-output-len", type=int, default=128, help="max_tokens")
    random.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths drawn from [L(1-r), L(1+r)], r in [0, 1)")
    random.add_argument("--random-prefix-len", type=int, default=0,
                        help="tokens of one random prefix shared by every prompt")
    sharegpt = parser.add_argument_group("sharegpt dataset options")
    sharegpt.add_argument("--sharegpt-output-len", type=int,
                          help="max_tokens for every request (default: each answer's length)")
    custom = parser.add_argument_group("custom dataset options")
    custom.add_argument("--custom-output-len", type=int,
                        help="max_tokens for every request (default: each line's "
                        "output_tokens, else 256)")
    prefix = parser.add_argument_group("prefix repetition dataset options")
    prefix.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    prefix.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    prefix.add_argument("--prefix-repetition-num-prefixes", type=int, default=10,
                        help="prompts per prefix: num_prompts // num_prefixes")
    prefix.add_argument("--prefix-repetition-output-len", type=int, default=128)
    repeat = parser.add_argument_group(
        "repeat dataset options (Tandem's: 'Repeat the following text exactly:' and a passage "
        "of random words, new each round; greedy unless --temperature or --extra-body says)")
    repeat.add_argument("--repeat-passage-len", type=int, default=256,
                        help="tokens of the passage to repeat")
    repeat.add_argument("--repeat-output-len", type=int,
                        help="max_tokens (default: the passage's length)")


def add_traffic(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add("--request-rate", type=float, default=math.inf, help="requests/s; inf: all at once")
    add("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1.0 is Poisson")
    add("--ramp-up-strategy", choices=("linear", "exponential"),
        help="grow the rate from --ramp-up-start-rps to --ramp-up-end-rps over the run")
    add("--ramp-up-start-rps", type=float)
    add("--ramp-up-end-rps", type=float)
    add("--max-concurrency", type=int, help="requests in flight at most (default: unlimited)")
    add("--sweep", type=flag_type(parse_sweep), metavar="KIND=V1,V2,...",
        help="one run per value: max-concurrency=1,4,16 or request-rate=1,2,inf")
    add("--request-timeout", type=float, default=3600.0, help="seconds per request")


def add_sampling(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
        help="send ignore_eos (default: on for the random dataset, off otherwise, as vLLM)")
    add("--extra-body", type=json_object, default={}, metavar="JSON",
        help='fields added to every request, e.g. \'{"temperature": 0}\'')
    add("--temperature", type=float,
        help="default: the server's (0 with --dataset-name repeat)")
    add("--top-p", type=float)
    add("--top-k", type=int)
    add("--min-p", type=float)
    add("--logprobs", type=int, help="ask for N top logprobs per token")
    add("--echo", action="store_true", help="completions only; TTFT then times the echo")


def add_results(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add("--percentile-metrics", type=flag_type(parse_metrics), default=LATENCY_METRICS,
        metavar="ttft,tpot,itl,e2el",
        help="the metrics whose statistics are reported (default: all four)")
    add("--metric-percentiles", type=flag_type(parse_percentiles), default=(99.0,),
        metavar="50,90,99",
        help="the percentiles reported besides mean, median and std (default: 99)")
    add("--goodput", nargs="+", default=[], metavar="SLO", help="e.g. ttft:200 tpot:50 e2el:5000")
    add("--save-result", action="store_true", help="write vLLM's flat JSON file per server")
    add("--result-dir", help="folder of the --save-result files (default: here)")
    add("--result-filename", help="name of the --save-result file (default: vLLM's pattern)")
    add("--result-file", help="Tandem's JSON: config, totals, statistics, per-request arrays")
    add("--plot", metavar="DIR", help="write PNG pictures (needs matplotlib)")


def add_comparison(group: argparse._ArgumentGroup) -> None:
    add = group.add_argument
    add("--compare", metavar="URL2", help="also run the same workload against server B")
    add("--compare-model", help="B's model (default: the first id of B's GET /v1/models)")
    add("--compare-api-key", help="B's API key")
    add("--rounds", type=int, default=1, help="rounds per target, alternating A, B, A, B")
    add("--warmup", "--num-warmups", type=int,
        help="unmeasured requests per target (default: 2 with --compare)")
    add("--settle", type=float, metavar="SECONDS",
        help="quiet before each round, so that a server still busy after its own round or "
             "warm-up does not slow the next one (default: 2 with --compare, else 0)")


def endpoint(value: str) -> str:
    if value not in ENDPOINTS:
        raise argparse.ArgumentTypeError(f"use one of {', '.join(ENDPOINTS)}")
    return ENDPOINTS[value]


def json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"temperature\": 0}'")
    return parsed


def dataset_from_args(args: argparse.Namespace) -> DatasetConfig:
    """The dataset, with --input-len/--output-len mapped onto each dataset's own flags."""
    out = args.output_len
    return DatasetConfig(
        name=args.dataset_name.replace("-", "_"),
        path=args.dataset_path,
        random_input_len=args.input_len if args.input_len is not None else args.random_input_len,
        random_output_len=out if out is not None else args.random_output_len,
        random_range_ratio=args.random_range_ratio,
        random_prefix_len=args.random_prefix_len,
        sharegpt_output_len=out if out is not None else args.sharegpt_output_len,
        custom_output_len=out if out is not None else args.custom_output_len,
        prefix_repetition_prefix_len=args.prefix_repetition_prefix_len,
        prefix_repetition_suffix_len=args.prefix_repetition_suffix_len,
        prefix_repetition_num_prefixes=args.prefix_repetition_num_prefixes,
        prefix_repetition_output_len=out if out is not None else args.prefix_repetition_output_len,
        repeat_passage_len=args.repeat_passage_len,
        repeat_output_len=out if out is not None else args.repeat_output_len,
    )


def check_args(args: argparse.Namespace, dataset: DatasetConfig) -> None:
    """ValueError with the reason when flags conflict or are out of range."""
    if args.echo and args.endpoint == "chat":
        raise ValueError("--echo works with --endpoint completions only")
    for name in ("num_prompts", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if dataset.name in ("random", "prefix_repetition", "repeat") and dataset.path is not None:
        raise ValueError(f"--dataset-name {dataset.name} makes its prompts: drop --dataset-path")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    if args.settle is not None and not 0 <= args.settle < math.inf:
        raise ValueError("--settle must be a number of seconds, 0 or more")
    lengths = [dataset.random_output_len, dataset.prefix_repetition_output_len,
               dataset.sharegpt_output_len or 1, dataset.custom_output_len or 1,
               dataset.repeat_output_len or 1, dataset.repeat_passage_len]
    if min(lengths) < 1 or dataset.random_input_len < 0 or dataset.random_prefix_len < 0:
        raise ValueError("input lengths must be >= 0 and output lengths >= 1")


def ramp_up_from_args(args: argparse.Namespace) -> RampUp | None:
    if args.ramp_up_strategy is None:
        return None
    if args.ramp_up_start_rps is None or args.ramp_up_end_rps is None:
        raise ValueError("--ramp-up-strategy needs --ramp-up-start-rps and --ramp-up-end-rps")
    ramp_up = RampUp(args.ramp_up_strategy, args.ramp_up_start_rps, args.ramp_up_end_rps)
    check_ramp_up(ramp_up, args.request_rate)
    return ramp_up


def extra_body_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags, then --extra-body on top (it wins, as in vLLM); the repeat dataset
    asks for greedy output unless told otherwise (its repetition is what it measures)."""
    sampling = {name: getattr(args, name) for name in SAMPLING_FLAGS}
    if args.dataset_name == "repeat" and sampling["temperature"] is None:
        sampling["temperature"] = 0.0
    return {name: value for name, value in sampling.items() if value is not None} | args.extra_body


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """A BenchConfig from parsed arguments; ValueError with the reason when they conflict."""
    dataset = dataset_from_args(args)
    check_args(args, dataset)
    compare = None
    if args.compare:
        compare = Target(args.compare, args.compare_model, args.compare_api_key, label="B")
    warmup = args.warmup if args.warmup is not None else (2 if compare else 0)
    settle = args.settle if args.settle is not None else (SETTLE_S if compare else 0.0)
    ignore_eos = args.ignore_eos if args.ignore_eos is not None else dataset.name == "random"
    return BenchConfig(
        target=Target(args.base_url, args.model, args.api_key, label="A"),
        endpoint=args.endpoint,
        num_prompts=args.num_prompts,
        dataset=dataset,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        ramp_up=ramp_up_from_args(args),
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        tokenizer=args.tokenizer,
        logprobs=args.logprobs,
        echo=args.echo,
        ignore_eos=ignore_eos,
        extra_body=extra_body_from_args(args),
        goodput_slos_ms=parse_slos(args.goodput),
        percentiles=args.metric_percentiles,
        compare=compare,
        rounds=args.rounds,
        warmup=warmup,
        settle_s=settle,
        request_timeout_s=args.request_timeout,
        disable_tqdm=args.disable_tqdm,
    )


def outputs_from_args(args: argparse.Namespace) -> Outputs:
    save = None
    if args.save_result:
        save = SaveOptions(args.label, args.result_dir, args.result_filename)
    return Outputs(args.percentile_metrics, save, args.result_file, args.plot, args.sweep)
