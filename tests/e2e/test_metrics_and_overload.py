"""/metrics through real processes (whole-server figures from either of two frontends) and
the waiting-queue limit (503 + Retry-After beyond it, every accepted request completes).

One server for the module (starting one costs most of this file's time): two frontends, at
most 2 requests running and 2 waiting. The metrics workload never has more than 2 requests
in flight, so it is never refused; the burst then overflows the queue on purpose.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.server import Server

BOS = 128000
TTFT, ITL, E2E = ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                  "vllm:e2e_request_latency_seconds")


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    srv = Server(tiny_llama, tmp_path_factory.mktemp("metrics"), "--api-server-count", "2",
                 "--max-model-len", "512", "--num-kv-blocks", "512", "--max-num-seqs", "2",
                 "--max-waiting-requests", "2").wait_healthy()
    yield srv
    assert srv.stop() == 0


async def two_at_a_time(*coros: Any) -> list[Any]:
    """Run coroutines with at most two in flight (within --max-num-seqs: never refused)."""
    slots = asyncio.Semaphore(2)

    async def run(coro: Any) -> Any:
        async with slots:
            return await coro

    return await asyncio.gather(*(run(c) for c in coros))


def prompt(seed: int, length: int) -> list[int]:
    """Token ids, distinct from the first block on for each seed (no accidental prefix hits)."""
    return [BOS] + [1000 + 97 * seed + k for k in range(length - 1)]


async def scrape(url: str) -> tuple[dict[str, float], str]:
    """One scrape on a fresh connection: ({sample name[{labels}]: value}, serving frontend)."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=connector) as s, s.get(f"{url}/metrics") as resp:
        assert resp.status == 200, await resp.text()
        text, frontend = await resp.text(), resp.headers["X-Tandem-Frontend"]
    values = {}
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:cache_config_info":  # the cache's facts in labels, value 1
            continue
        for sample in family.samples:
            assert sample.labels.pop("model_name") == "m"
            assert sample.labels.pop("engine") == "0"
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values, frontend


def figures(values: dict[str, float]) -> dict[str, float]:
    """The figures this test checks, by short name."""
    keys = {
        "prompt": "vllm:prompt_tokens_total", "gen": "vllm:generation_tokens_total",
        "stop": "vllm:request_success_total{finished_reason=stop}",
        "length": "vllm:request_success_total{finished_reason=length}",
        "abort": "vllm:request_success_total{finished_reason=abort}",
        "queries": "vllm:prefix_cache_queries_total", "hits": "vllm:prefix_cache_hits_total",
        "preempt": "vllm:num_preemptions_total", "running": "vllm:num_requests_running",
        "waiting": "vllm:num_requests_waiting", "kv": "vllm:kv_cache_usage_perc",
        "ttft": f"{TTFT}_count", "itl": f"{ITL}_count", "e2e": f"{E2E}_count",
    }
    return {short: values[name] for short, name in keys.items()}


async def settled(url: str, done: Any, timeout_s: float = 10.0) -> dict[str, float]:
    """Scrape until `done(figures)` (latency reports from the other frontend may lag a little)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = figures((await scrape(url))[0])
        if done(got) or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.1)


async def check_every_frontend(url: str, expected: dict[str, float]) -> None:
    """Scrape on fresh connections until both frontends answered; each shows `expected`."""
    seen: set[str] = set()
    for n in range(60):
        values, frontend = await scrape(url)
        got = figures(values)
        assert {k: got[k] for k in expected} == expected, f"frontend {frontend}"
        seen.add(frontend)
        if len(seen) == 2 and n >= 3:
            return
    raise AssertionError(f"only {seen} answered /metrics")


async def complete(session: aiohttp.ClientSession, url: str, **body: Any) -> dict[str, Any]:
    payload = {"model": "m", "temperature": 0, **body}
    async with session.post(f"{url}/v1/completions", json=payload) as resp:
        text = await resp.text()
        assert resp.status == 200, text
        return {"stream": text} if body.get("stream") else await resp.json()


async def hang_up_after_first_event(url: str, ids: list[int]) -> None:
    async with aiohttp.ClientSession() as session:
        payload = {"model": "m", "prompt": ids, "max_tokens": 400, "ignore_eos": True,
                   "stream": True}
        async with session.post(f"{url}/v1/completions", json=payload) as resp:
            assert resp.status == 200
            await resp.content.readline()


async def test_metrics_are_the_whole_servers_on_every_frontend(server):
    url = server.url
    base = figures((await scrape(url))[0])
    prompts = [prompt(i, 40) for i in range(5)]
    async with aiohttp.ClientSession() as session:
        for wave in range(2):  # the second wave finds the first one's 2 full blocks cached
            await two_at_a_time(*(
                complete(session, url, prompt=p, max_tokens=5, ignore_eos=True,
                         stream=(i + wave) % 2 == 0) for i, p in enumerate(prompts)))
        await two_at_a_time(*(
            complete(session, url, prompt=prompt(10 + i, 20), max_tokens=0, echo=True)
            for i in range(3)))
    moved = {"prompt": 10 * 40 + 3 * 20, "gen": 10 * 5, "stop": 0, "length": 13, "abort": 0,
             "queries": 10 * 40 + 3 * 20, "hits": 5 * 32, "preempt": 0,
             "ttft": 10, "itl": 10 * 4, "e2e": 13}
    expected = {k: base[k] + v for k, v in moved.items()} | {"running": 0, "waiting": 0,
                                                             "kv": 0.0}
    await settled(url, lambda f: f["e2e"] >= expected["e2e"])
    await check_every_frontend(url, expected)

    await asyncio.gather(*(hang_up_after_first_event(url, prompt(20 + i, 30)) for i in range(2)))
    got = await settled(url, lambda f: f["abort"] >= expected["abort"] + 2
                        and f["e2e"] >= expected["e2e"] + 2 and f["running"] == 0)
    gen = got["gen"] - expected["gen"]
    assert 2 <= gen <= 2 * 400
    assert 0 <= got["itl"] - expected["itl"] <= gen - 2
    aborted = {"prompt": expected["prompt"] + 2 * 30, "abort": expected["abort"] + 2,
               "length": expected["length"], "ttft": expected["ttft"] + 2,
               "e2e": expected["e2e"] + 2, "gen": got["gen"], "running": 0, "waiting": 0,
               "kv": 0.0}
    await check_every_frontend(url, aborted)


async def overload_one(session: aiohttp.ClientSession, url: str, i: int) -> str:
    """One request of the burst: "ok" (all 24 tokens), or "busy" (a proper 503)."""
    payload = {"model": "m", "prompt": prompt(i, 12), "max_tokens": 24, "ignore_eos": True,
               "stream": i % 2 == 0}
    async with session.post(f"{url}/v1/completions", json=payload) as resp:
        if resp.status == 503:
            assert int(resp.headers["Retry-After"]) >= 1
            error = (await resp.json())["error"]
            assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
            assert "overloaded" in error["message"] and "--max-waiting-requests" in error["message"]
            return "busy"
        assert resp.status == 200, await resp.text()
        if payload["stream"]:
            text = await resp.text()
            assert text.rstrip().endswith("data: [DONE]") and '"finish_reason":"length"' in text
        else:
            body = await resp.json()
            assert body["usage"]["completion_tokens"] == 24
            assert body["choices"][0]["finish_reason"] == "length"
        return "ok"


async def test_a_burst_beyond_the_waiting_limit_gets_503s_and_the_rest_completes(server):
    rejected = "tandem:requests_rejected_total{reason=overloaded}"
    before, _ = await scrape(server.url)
    async with aiohttp.ClientSession() as session:  # a connection each: both frontends take some
        results = await asyncio.gather(*(overload_one(session, server.url, i) for i in range(30)))
    assert 0 < results.count("busy") < 30, results
    after, _ = await scrape(server.url)
    assert after[rejected] - before[rejected] == results.count("busy")
    assert figures(after)["length"] - figures(before)["length"] == results.count("ok")
    assert figures(after)["running"] == 0 and figures(after)["waiting"] == 0
