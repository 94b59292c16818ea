"""`tandem bench serve`: an async load generator for any OpenAI-compatible server.

`run_benchmark(config)` runs one workload against `config.target`; `run_comparison(config)`
runs the very same workload (same prompts, same arrival times) against `config.target` (A) and
`config.compare` (B), alternating A, B, A, B for `config.rounds` rounds after a warm-up. The
package owns: workload.py (prompts, arrival times), client.py (one streamed request),
metrics.py (the arithmetic), report.py (tables, result file), __main__.py (the CLI).

The tokenizer that builds the prompts is `config.tokenizer`, else whatever the server names at
GET /tokenizer_info (best effort), else A's model id used as a folder or hub id.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import aiohttp
from tqdm import tqdm

from frontend.bench.client import RequestOptions, fetch_model_id, fetch_tokenizer_hint, send_request
from frontend.bench.metrics import RequestResult, Summary, summarize
from frontend.bench.workload import Prompt, arrival_times, build_prompts, load_tokenizer


@dataclass(frozen=True)
class Target:
    """One server under test; `model` None means the first id of its GET /v1/models."""

    base_url: str
    model: str | None = None
    api_key: str | None = None
    label: str = "A"


@dataclass(frozen=True)
class BenchConfig:
    target: Target
    endpoint: str = "completions"  # "completions" | "chat"
    num_prompts: int = 100
    input_len: int = 1024
    output_len: int = 128
    request_rate: float = math.inf  # requests/s; inf sends everything at once
    burstiness: float = 1.0  # gamma shape of the gaps; 1.0 is Poisson
    max_concurrency: int | None = None  # None: unlimited
    seed: int = 0
    tokenizer: str | None = None
    logprobs: int | None = None
    echo: bool = False
    goodput_slos_ms: Mapping[str, float] = field(default_factory=dict)  # e.g. {"ttft": 200}
    compare: Target | None = None
    rounds: int = 1
    warmup: int = 0  # requests sent (and not measured) to each target before the first round
    request_timeout_s: float = 3600.0
    disable_tqdm: bool = False


@dataclass(frozen=True)
class BenchResult:
    """All measured requests of one target over every round, and their summary."""

    target: Target
    model: str
    requests: tuple[RequestResult, ...]
    round_durations_s: tuple[float, ...]
    summary: Summary


class Comparison(NamedTuple):
    a: BenchResult
    b: BenchResult


class Workload(NamedTuple):
    prompts: list[Prompt]
    arrivals: list[float]  # seconds from the start of a round


class Round(NamedTuple):
    requests: list[RequestResult]
    duration_s: float


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


async def run_targets(config: BenchConfig, targets: Sequence[Target]) -> list[BenchResult]:
    """Warm each target up, then run every round against each target in turn."""
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s)
    # limit=0: aiohttp's default pool of 100 connections would queue requests client-side.
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        options = [await resolve_options(session, config, target) for target in targets]
        workload = await prepare_workload(session, config, options[0].model)
        for target, opts in zip(targets, options):
            await warm_up(session, target, opts, workload.prompts, config.warmup)
        rounds: list[list[Round]] = [[] for _ in targets]
        for number in range(1, config.rounds + 1):
            for target, opts, done in zip(targets, options, rounds):
                desc = f"{target.label} round {number}/{config.rounds}"
                done.append(await run_round(session, target, opts, workload, config, desc))
    return [
        merge_rounds(target, opts.model, done, config.goodput_slos_ms)
        for target, opts, done in zip(targets, options, rounds)
    ]


async def resolve_options(
    session: aiohttp.ClientSession, config: BenchConfig, target: Target
) -> RequestOptions:
    model = target.model or await fetch_model_id(session, target.base_url, target.api_key)
    return RequestOptions(config.endpoint, model, config.output_len, config.logprobs, config.echo)


async def prepare_workload(
    session: aiohttp.ClientSession, config: BenchConfig, model: str
) -> Workload:
    name = config.tokenizer
    if name is None:
        hint = await fetch_tokenizer_hint(session, config.target.base_url, config.target.api_key)
        name = hint or model
    tokenizer = await asyncio.to_thread(load_tokenizer, name)
    prompts = await asyncio.to_thread(
        build_prompts, tokenizer, config.num_prompts, config.input_len, config.seed
    )
    arrivals = arrival_times(
        config.num_prompts, config.request_rate, config.burstiness, config.seed
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
            result = await send_request(session, target.base_url, options, prompt, target.api_key)
        bar.update()
        return result

    try:
        results = await asyncio.gather(*map(one, workload.prompts, workload.arrivals))
    finally:
        bar.close()
    return Round(list(results), time.perf_counter() - start)


def merge_rounds(
    target: Target, model: str, rounds: Sequence[Round], slos_ms: Mapping[str, float]
) -> BenchResult:
    """One result per target: the requests of all rounds over the sum of their durations."""
    requests = tuple(r for one in rounds for r in one.requests)
    durations = tuple(one.duration_s for one in rounds)
    summary = summarize(requests, sum(durations), slos_ms or None)
    return BenchResult(target, model, requests, durations, summary)


__all__ = ["BenchConfig", "BenchResult", "Comparison", "Target", "run_benchmark", "run_comparison"]
