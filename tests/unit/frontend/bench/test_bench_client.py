"""The benchmark client against a fake OpenAI server that streams SSE chunks with set delays,
then whole runs (`run_benchmark`, `run_comparison`, the CLI's exit codes) against it."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from itertools import groupby
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from engine_core.worker.default_model import DEFAULT, write_tokenizer
from frontend.bench import (
    BenchConfig,
    DatasetConfig,
    Target,
    round_seed,
    run_benchmark,
    run_comparison,
    warmup_draw,
)
from frontend.bench.__main__ import main, serve
from frontend.bench.client import RequestOptions, fetch_model_id, send_request
from frontend.bench.metrics import itls, output_tokens, ttft
from frontend.bench.report import format_comparison, format_summary, write_result_file
from frontend.bench.workload import Prompt
from frontend.metrics import render
from shared.messages import EngineStats

DELAYS = (0.05, 0.03, 0.03)  # seconds before each text chunk
SLACK = 0.1  # how late a chunk may arrive on a loaded machine
PROMPT = Prompt("hello there", 2, 3)


@dataclass
class Fake:
    """How the fake server answers, and what it saw (shared by every request)."""

    label: str = "A"
    texts: tuple[str, ...] = ("a", "b", "c")
    usage: bool = True
    status: int = 200
    error_event: bool = False
    done: bool = True
    tokenizer_path: str | None = None
    seen: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    speculates: bool = False  # /metrics has vLLM's spec_decode counters (else a 404)


FAKE = web.AppKey("fake", Fake)
LOG = web.AppKey("log", list)


def sse(data: Any) -> bytes:
    return b"data: " + (data if isinstance(data, bytes) else json.dumps(data).encode()) + b"\n\n"


async def stream(request: web.Request) -> web.StreamResponse:
    fake, body = request.app[FAKE], await request.json()
    auth = request.headers.get("Authorization")
    fake.seen.append({"path": request.path, "body": body, "auth": auth})
    request.app[LOG].append(fake.label)
    if fake.status != 200:
        return web.json_response({"error": {"message": "no such luck"}}, status=fake.status)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    fake.in_flight += 1
    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
    try:
        for delay, text in zip(DELAYS, fake.texts):
            await asyncio.sleep(delay)
            piece = {"delta": {"content": text}} if "chat" in request.path else {"text": text}
            await response.write(sse({"choices": [{"index": 0, **piece}]}))
        if fake.error_event:
            return await finish(response, sse({"error": {"message": "engine died"}}))
        if fake.usage:
            usage = {"prompt_tokens": 17, "completion_tokens": len(fake.texts)}
            await response.write(sse({"choices": [], "usage": usage}))
        return await finish(response, sse(b"[DONE]") if fake.done else b"")
    finally:
        fake.in_flight -= 1


async def finish(response: web.StreamResponse, last: bytes) -> web.StreamResponse:
    await response.write(last)
    await response.write_eof()
    return response


async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})


async def tokenizer_info(request: web.Request) -> web.Response:
    path = request.app[FAKE].tokenizer_path
    return web.json_response({"tokenizer_path": path}) if path else web.Response(status=404)


async def metrics(request: web.Request) -> web.Response:
    """Every request served so far drafted once, 3 tokens, the first two accepted."""
    fake = request.app[FAKE]
    if not fake.speculates:
        return web.Response(status=404)
    n = len(fake.seen)
    stats = EngineStats(spec_drafts=n, spec_draft_tokens=3 * n, spec_accepted_tokens=2 * n,
                        spec_accepted_per_pos=[n, n])
    return web.Response(body=render([(0, stats)], "fake-model", 3), content_type="text/plain")


def fake_app(fake: Fake, log: list[str] | None = None) -> web.Application:
    app = web.Application()
    app[FAKE], app[LOG] = fake, log if log is not None else []
    app.router.add_post("/v1/completions", stream)
    app.router.add_post("/v1/chat/completions", stream)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_get("/metrics", metrics)
    return app


Start = Callable[..., Awaitable[str]]


@pytest.fixture
def start(aiohttp_server: Callable[..., Awaitable[TestServer]]) -> Start:
    async def start_fake(fake: Fake, log: list[str] | None = None) -> str:
        server = await aiohttp_server(fake_app(fake, log))
        return f"http://{server.host}:{server.port}"

    return start_fake


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("bench-tokenizer")
    write_tokenizer(DEFAULT, folder)
    return str(folder)


async def one(base_url: str, options: RequestOptions, api_key: str | None = None) -> Any:
    async with aiohttp.ClientSession() as session:
        return await send_request(session, base_url, options, PROMPT, api_key)


COMPLETIONS = RequestOptions("completions", "fake-model")


async def test_completions_stream_is_timed_per_chunk(start: Start) -> None:
    fake = Fake()
    result = await one(await start(fake) + "/v1/", COMPLETIONS, api_key="sk-test")
    assert result.success, result.error
    assert DELAYS[0] - 0.005 <= ttft(result) < DELAYS[0] + SLACK
    assert len(itls(result)) == 2
    for gap, delay in zip(itls(result), DELAYS[1:]):
        assert delay - 0.005 <= gap < delay + SLACK
    assert result.latency >= result.text_times[-1]
    assert (result.prompt_len, result.prompt_tokens, result.completion_tokens) == (2, 17, 3)
    (seen,) = fake.seen
    assert seen["path"] == "/v1/completions" and seen["auth"] == "Bearer sk-test"
    assert seen["body"] == {
        "model": "fake-model",
        "prompt": "hello there",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def test_chat_sends_messages_and_reads_deltas(start: Start) -> None:
    fake = Fake()
    options = RequestOptions("chat", "fake-model", logprobs=2)
    result = await one(await start(fake), options)
    assert result.success and len(result.text_times) == 3
    body = fake.seen[0]["body"]
    assert fake.seen[0]["path"] == "/v1/chat/completions"
    assert body["messages"] == [{"role": "user", "content": "hello there"}]
    assert (body["logprobs"], body["top_logprobs"], fake.seen[0]["auth"]) == (True, 2, None)


async def test_completions_logprobs_and_echo_are_sent(start: Start) -> None:
    fake = Fake()
    await one(await start(fake), replace(COMPLETIONS, logprobs=3, echo=True))
    assert (fake.seen[0]["body"]["logprobs"], fake.seen[0]["body"]["echo"]) == (3, True)


async def test_ignore_eos_and_extra_body_are_sent_but_streaming_stays(start: Start) -> None:
    fake = Fake()
    extra = {"temperature": 0.5, "seed": 7, "stream": False, "max_tokens": 9}
    await one(await start(fake), replace(COMPLETIONS, ignore_eos=True, extra_body=extra))
    body = fake.seen[0]["body"]
    assert (body["ignore_eos"], body["temperature"], body["seed"]) == (True, 0.5, 7)
    assert body["max_tokens"] == 9  # the extra body wins over the prompt's, as in vLLM
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    ("fake", "message"),
    [
        (Fake(status=401), "HTTP 401: no such luck"),
        (Fake(error_event=True), "error event in the stream: engine died"),
        (Fake(done=False), "the stream ended before 'data: [DONE]'"),
        (Fake(texts=("", "", "")), "the stream carried no text"),
    ],
)
async def test_failures_become_results(start: Start, fake: Fake, message: str) -> None:
    result = await one(await start(fake), COMPLETIONS)
    assert (result.success, result.error) == (False, message)


async def test_connection_refused_is_a_failed_result() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    result = await one(f"http://127.0.0.1:{port}", COMPLETIONS)
    assert not result.success and "Connect" in result.error


async def test_without_usage_chunks_count_as_tokens(start: Start) -> None:
    result = await one(await start(Fake(usage=False)), COMPLETIONS)
    assert result.success and result.completion_tokens is None and output_tokens(result) == 3


async def test_a_chunk_longer_than_64_kib_is_read(start: Start) -> None:
    result = await one(await start(Fake(texts=("x" * 300_000, "y"))), COMPLETIONS)
    assert result.success and result.completion_tokens == 2


async def test_model_discovery_error_says_what_to_do(start: Start) -> None:
    async with aiohttp.ClientSession() as session:
        assert await fetch_model_id(session, await start(Fake()), None) == "fake-model"
        with pytest.raises(ValueError, match="--model"):
            await fetch_model_id(session, await start(Fake()) + "/nothing-here", None)


def config(base_url: str, **overrides: Any) -> BenchConfig:
    dataset = DatasetConfig(random_input_len=16, random_output_len=3)
    defaults: dict[str, Any] = {"num_prompts": 8, "dataset": dataset}
    return BenchConfig(target=Target(base_url), disable_tqdm=True, **defaults | overrides)


async def test_run_benchmark_end_to_end(start: Start, tokenizer_dir: str, tmp_path: Path) -> None:
    fake = Fake(tokenizer_path=tokenizer_dir)
    cfg = config(await start(fake), max_concurrency=2, goodput_slos_ms={"ttft": 10_000})
    result = await run_benchmark(cfg)
    s = result.summary
    assert (result.model, s.completed, s.failed, len(fake.seen)) == ("fake-model", 8, 0, 8)
    assert fake.max_in_flight == 2
    assert (s.prompt_tokens, s.output_tokens) == (8 * 17, 8 * 3)
    assert s.output_throughput == pytest.approx(24 / s.duration_s)
    assert s.goodput == pytest.approx(s.request_throughput)
    assert s.ttft_ms is not None and s.ttft_ms.mean >= 1000 * DELAYS[0] - 5
    assert len({seen["body"]["prompt"] for seen in fake.seen}) == 8
    assert "Successful requests:" in format_summary(result)
    path = tmp_path / "result.json"
    write_result_file(path, replace(cfg, target=replace(cfg.target, api_key="secret")), [result])
    saved = json.loads(path.read_text(), parse_constant=pytest.fail)
    assert saved["config"]["request_rate"] == "inf"
    assert saved["config"]["target"]["api_key"] == "***"
    assert len(saved["results"][0]["requests"]["ttft_s"]) == 8


async def test_comparison_alternates_with_the_same_prompts(
    start: Start, tokenizer_dir: str
) -> None:
    log: list[str] = []
    a, b = Fake(tokenizer_path=tokenizer_dir), Fake(label="B")
    url_a, url_b = await start(a, log), await start(b, log)
    cfg = config(url_a, compare=Target(url_b, label="B"), rounds=2, warmup=2, settle_s=0.2)
    started = time.perf_counter()
    result_a, result_b = await run_comparison(cfg)
    assert time.perf_counter() - started >= 4 * 0.2  # quiet before each of the four rounds
    runs = [(label, sum(1 for _ in group)) for label, group in groupby(log)]
    assert runs == [("A", 2), ("B", 2), ("A", 8), ("B", 8), ("A", 8), ("B", 8)]
    prompts = [[seen["body"]["prompt"] for seen in fake.seen] for fake in (a, b)]
    assert sorted(prompts[0]) == sorted(prompts[1])
    # the warm-up and each round have prompts of their own: no round meets a cached prompt
    assert len(set(prompts[0])) == 2 + 8 + 8
    assert round_seed(7, 1) == 7 and len({round_seed(7, 2), round_seed(7, "warm-up"), 7}) == 3
    # the warm-up draws only the prompts it sends (prefix_repetition: whole prefixes' worth)
    assert warmup_draw(cfg) == 2
    repeated = DatasetConfig(name="prefix_repetition", prefix_repetition_num_prefixes=3)
    assert warmup_draw(replace(cfg, dataset=repeated, warmup=4)) == 6
    assert result_a.summary.completed == result_b.summary.completed == 16
    assert len(result_a.round_durations_s) == 2
    table = format_comparison(result_a, result_b)
    assert "A/B" in table and "Mean TTFT (ms)" in table


async def test_acceptance_counts_the_rounds_not_the_warm_up(
    start: Start, tokenizer_dir: str
) -> None:
    fake = Fake(tokenizer_path=tokenizer_dir, speculates=True)
    cfg = config(await start(fake), rounds=2, warmup=2)
    spec = (await run_benchmark(cfg)).summary.spec_decode
    assert spec is not None and len(fake.seen) == 2 + 2 * 8
    assert (spec.num_drafts, spec.draft_tokens, spec.accepted_tokens) == (16, 48, 32)
    assert spec.acceptance_rate == pytest.approx(200 / 3)
    assert spec.acceptance_length == pytest.approx(3.0)
    assert spec.per_position_acceptance_rates == [1.0, 1.0, 0.0]
    assert "Acceptance length:" in format_summary(await run_benchmark(config(await start(fake))))
    plain = await run_benchmark(config(await start(Fake(tokenizer_path=tokenizer_dir))))
    assert plain.summary.spec_decode is None  # /metrics answers 404


async def test_serve_exits_1_when_every_request_failed(start: Start, tokenizer_dir: str) -> None:
    cfg = config(await start(Fake(status=500)), tokenizer=tokenizer_dir)
    assert await serve(cfg) == 1


def test_cli_rejects_echo_with_chat_and_reports_unreachable_servers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--endpoint", "chat", "--echo"])
    assert exit_info.value.code == 2
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["serve", "--base-url", f"http://127.0.0.1:{port}", "--disable-tqdm"]) == 2
    assert "pass --model" in capsys.readouterr().err
