"""The benchmark CLI (`tandem bench serve ...` runs `python -m frontend.bench serve ...`).

    tandem bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 \\
        --input-len 1024 --output-len 128 --request-rate 8 --goodput ttft:500 tpot:50

Exit status: 0 on success, 1 when every request to a target failed, 2 on a setup error
(bad arguments, unreachable server, no tokenizer).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence

import aiohttp

from frontend.bench import BenchConfig, BenchResult, Target, run_benchmark, run_comparison
from frontend.bench.metrics import parse_slos
from frontend.bench.report import format_comparison, format_summary, write_result_file


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem bench", description="Tandem benchmarks.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server",
        description="Load-test an OpenAI-compatible server with streamed random-token prompts.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = serve.add_argument
    add("--base-url", default="http://127.0.0.1:8000", help="server A (e.g. Tandem)")
    add("--model", help="model name (default: the first id of GET /v1/models)")
    add("--api-key", help="sent as 'Authorization: Bearer <key>'")
    add("--endpoint", choices=("completions", "chat"), default="completions")
    add("--num-prompts", type=int, default=100)
    add("--input-len", type=int, default=1024, help="prompt tokens, without BOS")
    add("--output-len", type=int, default=128, help="max_tokens, sent with ignore_eos")
    add("--request-rate", type=float, default=float("inf"), help="requests/s; inf: all at once")
    add("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1.0 is Poisson")
    add("--max-concurrency", type=int, help="requests in flight at most (default: unlimited)")
    add("--seed", type=int, default=0)
    add(
        "--tokenizer",
        help="folder or hub id (default: what GET /tokenizer_info names, else the model id)",
    )
    add("--logprobs", type=int, help="ask for N top logprobs per token")
    add("--echo", action="store_true", help="completions only; TTFT then times the echo")
    add("--goodput", nargs="+", default=[], metavar="SLO", help="e.g. ttft:200 tpot:50 e2el:5000")
    add("--compare", metavar="URL2", help="also run the same workload against server B")
    add("--compare-model", help="B's model (default: the first id of B's GET /v1/models)")
    add("--compare-api-key", help="B's API key")
    add("--rounds", type=int, default=1, help="rounds per target, alternating A, B, A, B")
    add("--warmup", type=int, help="unmeasured requests per target (default: 2 with --compare)")
    add("--request-timeout", type=float, default=3600.0, help="seconds per request")
    add("--result-file", help="write config, totals, statistics and per-request arrays as JSON")
    add("--disable-tqdm", action="store_true")
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """A BenchConfig from parsed arguments; ValueError with the reason when they conflict."""
    if args.echo and args.endpoint == "chat":
        raise ValueError("--echo works with --endpoint completions only")
    for name in ("num_prompts", "input_len", "output_len", "rounds"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    compare = None
    if args.compare:
        compare = Target(args.compare, args.compare_model, args.compare_api_key, label="B")
    warmup = args.warmup if args.warmup is not None else (2 if compare else 0)
    return BenchConfig(
        target=Target(args.base_url, args.model, args.api_key, label="A"),
        endpoint=args.endpoint,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        tokenizer=args.tokenizer,
        logprobs=args.logprobs,
        echo=args.echo,
        goodput_slos_ms=parse_slos(args.goodput),
        compare=compare,
        rounds=args.rounds,
        warmup=warmup,
        request_timeout_s=args.request_timeout,
        disable_tqdm=args.disable_tqdm,
    )


async def serve(config: BenchConfig, result_file: str | None) -> int:
    """Run, print the tables, write the result file; 1 when a target had no success."""
    results: list[BenchResult]
    if config.compare is None:
        results = [await run_benchmark(config)]
    else:
        results = list(await run_comparison(config))
    for result in results:
        print(format_summary(result))
    if len(results) == 2:
        print(format_comparison(*results))
    if result_file:
        write_result_file(result_file, config, results)
    return 1 if any(r.summary.completed == 0 for r in results) else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        return asyncio.run(serve(config, args.result_file))
    except (ValueError, aiohttp.ClientError, OSError) as exc:
        print(f"tandem bench: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
