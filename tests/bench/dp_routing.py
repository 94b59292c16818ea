"""Data-parallel routing under cache pressure, and balance, measured in one command.

    .venv/bin/python -m tests.bench.dp_routing [--model M] [--port 8540] [--rounds 1]

Cache pressure (issue 28): two engines of 200 blocks of 16 tokens each (one thread each),
16 shared 256-token prefixes × 8 requests with their own 32-token suffixes (`tandem bench
serve`'s prefix_repetition dataset), shuffled, sent at concurrency 4 to
- `tandem serve --data-parallel-size 2` (cache-aware routing, the default),
- the same with `--data-parallel-routing round-robin`,
- two single-engine `tandem serve`s, fed round robin by this client.
Each set-up's prefix-cache hit rate is read from its /metrics (every engine's
`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`, before and after), next to
the workload's ideal (each prefix computed once: its first request misses, the others hit its
whole blocks) and the client's TTFT. Balance: 64 random prompts sharing nothing, at
concurrency 16, against the cache-aware server: each engine's share of the generated tokens.

Prompts are the same for every set-up (one seed per round); the machine's load goes next to the
figures (docs/benchmarks.md, "Several engines").
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from engine_core.worker.default_model import resolve_model
from frontend.bench.client import RequestOptions, send_request
from frontend.bench.datasets import DatasetConfig, sample_prompts
from frontend.bench.metrics import RequestResult, stats_ms, ttft
from frontend.bench.workload import Prompt, load_tokenizer

ENGINE_FLAGS = ("--num-kv-blocks", "200", "--block-size", "16", "--num-threads", "1",
                "--max-model-len", "1024", "--served-model-name", "m", "--log-level", "warning",
                "--disable-uvicorn-access-log")
PRESSURE = DatasetConfig(name="prefix_repetition", prefix_repetition_prefix_len=256,
                         prefix_repetition_suffix_len=32, prefix_repetition_num_prefixes=16,
                         prefix_repetition_output_len=16)
SHARING_NOTHING = DatasetConfig(name="random", random_input_len=128, random_output_len=64)


class Serve:
    """One `tandem serve`, started at construction, stopped by `stop()`."""

    def __init__(self, model: str | None, port: int, *flags: str) -> None:
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "frontend.cli", "serve", *([model] if model else []),
               "--port", str(port), *ENGINE_FLAGS, *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)

    def wait(self, timeout_s: float = 300) -> Serve:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        for line in self.proc.stdout:
            if line.startswith("tandem: serving"):
                return self
            if time.monotonic() > deadline:
                break
        raise RuntimeError(f"tandem serve on {self.url} did not start")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[tuple[str, str], float]:
    """{(sample name, engine): value} of the vLLM counters this benchmark reads."""
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    wanted = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
              "vllm:generation_tokens_total")
    return {(s.name, s.labels.get("engine", "0")): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name in wanted}


def delta(after: dict[tuple[str, str], float], before: dict[tuple[str, str], float],
          name: str) -> dict[str, float]:
    return {engine: value - before.get((n, engine), 0.0)
            for (n, engine), value in after.items() if n == name}


@dataclass
class Outcome:
    label: str
    hit_rate: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    generated: dict[str, float]  # by "url engine"
    failed: int


async def run(label: str, urls: Sequence[str], prompts: Sequence[Prompt],
              concurrency: int) -> Outcome:
    """Send `prompts` at `concurrency`, request i to urls[i % len(urls)]."""
    options = RequestOptions(endpoint="completions", model="m", ignore_eos=True)
    slots = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        before = {u: await scrape(session, u) for u in urls}

        async def one(i: int, prompt: Prompt) -> RequestResult:
            async with slots:
                return await send_request(session, urls[i % len(urls)], options, prompt)

        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        after = {u: await scrape(session, u) for u in urls}
    hits = sum(sum(delta(after[u], before[u], "vllm:prefix_cache_hits_total").values())
               for u in urls)
    queries = sum(sum(delta(after[u], before[u], "vllm:prefix_cache_queries_total").values())
                  for u in urls)
    generated = {f"{u} engine {e}": v for u in urls
                 for e, v in delta(after[u], before[u], "vllm:generation_tokens_total").items()}
    ok = [r for r in results if r.success]
    latency = stats_ms([ttft(r) for r in ok], (50.0, 99.0))
    assert latency is not None
    return Outcome(label, hits / queries if queries else 0.0, latency.percentiles[50.0],
                   latency.percentiles[99.0], generated, len(results) - len(ok))


def ideal_hit_rate(tokenizer: object, prompts: Sequence[Prompt], block: int = 16) -> float:
    """Each prompt family's shared full blocks computed once: the hits of a cache that never
    evicts, over every prompt token (with the BOS the server adds)."""
    encoded = [list(tokenizer.encode(p.text)) for p in prompts]  # type: ignore[attr-defined]
    families: dict[tuple[int, ...], list[list[int]]] = {}
    for ids in encoded:
        families.setdefault(tuple(ids[:64]), []).append(ids)
    hits = 0
    for members in families.values():
        shared = len(os.path.commonprefix(members))  # type: ignore[type-var]
        reusable = min(shared, min(len(m) for m in members) - 1) // block * block
        hits += reusable * (len(members) - 1)
    return hits / sum(len(ids) for ids in encoded)


def report(outcomes: list[Outcome], ideal: float) -> None:
    print(f"\nideal hit rate of the workload: {ideal:.3f}")
    print(f"{'set-up':<34} {'hit rate':>8} {'x ideal':>8} {'TTFT p50':>9} {'p99':>7} failed")
    for o in outcomes:
        print(f"{o.label:<34} {o.hit_rate:8.3f} {o.hit_rate / ideal:8.2f} "
              f"{o.ttft_p50_ms:8.0f}ms {o.ttft_p99_ms:6.0f}ms {o.failed:>5}")
    bases = [o for o in outcomes if o.label.startswith("two servers")]
    aware = [o for o in outcomes if o.label.startswith("cache-aware")]
    for number, (a, b) in enumerate(zip(aware, bases, strict=False), 1):  # same prompts
        if b.hit_rate:
            print(f"round {number}: cache-aware / two servers round robin: "
                  f"{a.hit_rate / b.hit_rate:.2f}x")


async def main(args: argparse.Namespace) -> None:
    print(f"load average before: {os.getloadavg()}, cpus: {os.cpu_count()}")
    port = args.port
    setups = [("cache-aware (-dp 2)", [("--data-parallel-size", "2")]),
              ("round-robin (-dp 2)", [("--data-parallel-size", "2", "--data-parallel-routing",
                                        "round-robin")]),
              ("two servers fed round robin", [(), ()])]
    outcomes: list[Outcome] = []
    for label, servers in setups:
        procs = [Serve(args.model, port + i, *flags) for i, flags in enumerate(servers)]
        try:
            for p in procs:
                p.wait()
            tokenizer = load_tokenizer(resolve_model(args.model)[0])
            for number in range(args.rounds):
                prompts = sample_prompts(tokenizer, PRESSURE, 128, seed=args.seed + number)
                outcome = await run(label, [p.url for p in procs], prompts, 4)
                outcomes.append(outcome)
                print(f"{label}: hit rate {outcome.hit_rate:.3f}, TTFT p50 "
                      f"{outcome.ttft_p50_ms:.0f} ms", flush=True)
            if label.startswith("cache-aware"):
                plain = sample_prompts(tokenizer, SHARING_NOTHING, 64, seed=args.seed + 100)
                spread = await run("sharing nothing, c16", [procs[0].url], plain, 16)
                total = sum(spread.generated.values())
                shares = {k: v / total for k, v in spread.generated.items()}
                print("prompts sharing nothing, c16, share of generated tokens: "
                      + ", ".join(f"{k.rsplit(' ', 1)[-1]}: {v:.2f}" for k, v in shares.items()))
        finally:
            for p in procs:
                p.stop()
    ideal = ideal_hit_rate(tokenizer, sample_prompts(tokenizer, PRESSURE, 128, seed=args.seed))
    report(outcomes, ideal)
    print(f"load average after: {os.getloadavg()}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model (default: the embedded tiny Llama)")
    parser.add_argument("--port", type=int, default=8540, help="first of two ports to serve on")
    parser.add_argument("--rounds", type=int, default=1, help="workloads per set-up")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
