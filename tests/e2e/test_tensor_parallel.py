"""`tandem serve --tensor-parallel-size 2` on the CPU: the real launcher, engine (rank 0) and
its gloo worker. Concurrent greedy completions equal Hugging Face's; a worker SIGKILLed
mid-stream ends every stream of the engine with an error within seconds, and nothing hangs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest
from transformers import AutoTokenizer

from tests.e2e.server import Server
from tests.e2e.test_launcher import children_of
from tests.engine.test_hf_parity import ATOL, MAX_NEW, Reference, make_prompts

pytestmark = pytest.mark.timeout(240)


def _worker_pid(server: Server) -> int:
    """The engine's worker process: the launcher's grandchild started by spawn."""
    (worker,) = [pid for child in children_of(server.proc.pid) for pid in children_of(child)
                 if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    return worker


async def _stream(session: aiohttp.ClientSession, url: str, prompt: str) -> str:
    payload = {"model": "m", "prompt": prompt, "max_tokens": 400, "temperature": 0,
               "ignore_eos": True, "stream": True}
    try:
        async with session.post(f"{url}/v1/completions", json=payload) as resp:
            if resp.status != 200:
                return f"{resp.status}"
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data: {") and "error" in json.loads(line[6:]):
                    return "error event"
        return "ok"
    except aiohttp.ClientError as exc:
        return f"connection: {exc}"


async def test_tp2_serves_hf_tokens_and_a_dead_worker_fails_streams_fast(tiny_llama: Path,
                                                                        tmp_path: Path) -> None:
    server = Server(tiny_llama, tmp_path, "--tensor-parallel-size", "2", "--device", "cpu",
                    "--max-model-len", "512", "--num-kv-blocks", "96").wait_healthy()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
        reference = Reference(tiny_llama)
        prompts = make_prompts(tokenizer, n=6)
        async with aiohttp.ClientSession() as session:

            async def complete(prompt: list[int]) -> dict:
                body = {"model": "m", "prompt": prompt, "max_tokens": MAX_NEW,
                        "temperature": 0, "logprobs": 1}
                async with session.post(f"{server.url}/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    return await resp.json()

            answers = await asyncio.gather(*(complete(p) for p in prompts))
            for prompt, answer in zip(prompts, answers, strict=True):
                tokens, lps = reference.generate(prompt)
                got = answer["choices"][0]["logprobs"]["token_logprobs"]
                assert answer["choices"][0]["text"] == tokenizer.decode(tokens)
                assert got == pytest.approx(lps, abs=ATOL)

            streams = [asyncio.create_task(_stream(session, server.url, f"story {i}"))
                       for i in range(3)]
            await asyncio.sleep(1.5)
            assert not any(s.done() for s in streams)
            os.kill(_worker_pid(server), signal.SIGKILL)
            killed = time.monotonic()
            ends = await asyncio.wait_for(asyncio.gather(*streams), timeout=20)
            assert time.monotonic() - killed < 15
            assert all(end != "ok" for end in ends), ends
    finally:
        server.stop()


async def _stream_end(session: aiohttp.ClientSession, url: str, prompt: str) -> str:
    """How a long stream ended: "ok", or the message of its error event, or what broke."""
    payload = {"model": "m", "prompt": prompt, "max_tokens": 400, "temperature": 0,
               "ignore_eos": True, "stream": True}
    try:
        async with session.post(f"{url}/v1/completions", json=payload) as resp:
            async for raw in resp.content:
                line = raw.decode().strip()
                if line.startswith("data: {") and "error" in (event := json.loads(line[6:])):
                    return f"error event: {event['error']['message']}"
        return "ok"
    except aiohttp.ClientError as exc:
        return f"connection: {exc}"


async def test_a_hung_worker_fails_the_engine_after_the_collective_timeout(
        tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capfd: pytest.CaptureFixture[str]) -> None:
    """A worker SIGSTOPped mid-stream (alive, silent: what a hang looks like) fails rank 0's
    next collective after TANDEM_TP_TIMEOUT_S (shorter than the launcher's 10 s stall bound,
    so it is the collective's timeout that ends it): every stream ends with an error event
    that names the cause, the engine kills the worker and exits, the server stops."""
    timeout_s = 6
    monkeypatch.setenv("TANDEM_TP_TIMEOUT_S", str(timeout_s))
    server = Server(tiny_llama, tmp_path, "--tensor-parallel-size", "2", "--device", "cpu",
                    "--max-model-len", "512", "--num-kv-blocks", "96").wait_healthy()
    worker = _worker_pid(server)
    try:
        async with aiohttp.ClientSession() as session:
            streams = [asyncio.create_task(_stream_end(session, server.url, f"story {i}"))
                       for i in range(3)]
            await asyncio.sleep(1.5)
            assert not any(s.done() for s in streams)
            os.kill(worker, signal.SIGSTOP)
            stopped = time.monotonic()
            ends = await asyncio.wait_for(asyncio.gather(*streams), timeout=timeout_s + 20)
            took = time.monotonic() - stopped
        assert all(end.startswith("error event: a tensor-parallel worker did not answer")
                   for end in ends), ends
        assert timeout_s - 1 < took < timeout_s + 5, took
        assert server.proc.wait(timeout=20) != 0  # the engine exited, so the server stopped
        assert not Path(f"/proc/{worker}").exists()  # killed and reaped by rank 0
        log = capfd.readouterr().err
        assert f"did not answer within {timeout_s} s (TANDEM_TP_TIMEOUT_S)" in log
        assert "exited with code 3" in log
    finally:
        if Path(f"/proc/{worker}").exists():
            os.kill(worker, signal.SIGKILL)
        server.stop()
