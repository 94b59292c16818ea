"""The launcher and process topology: many frontends on one port, split halves over tcp://,
engine death, graceful SIGTERM, API keys, and client disconnects."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import openai
import pytest

from tests.e2e.engine_proc import EngineConn
from tests.e2e.server import Server, free_port


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def stream_text(
    session: aiohttp.ClientSession, url: str, **body
) -> tuple[str, list[dict], str]:
    """POST a streamed completion; return (text, error events, frontend header)."""
    payload = {"model": "m", "prompt": "Hello there", "max_tokens": 16, "temperature": 0,
               "stream": True, **body}
    text, errors = "", []
    async with session.post(f"{url}/v1/completions", json=payload) as resp:
        assert resp.status == 200, await resp.text()
        frontend = resp.headers["X-Tandem-Frontend"]
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"])
            else:
                text += "".join(c["text"] for c in event["choices"])
    return text, errors, frontend


@pytest.fixture(scope="module")
def two_frontends(tiny_llama, tmp_path_factory):
    srv = Server(tiny_llama, tmp_path_factory.mktemp("two"), "--api-server-count", "2",
                 "--max-model-len", "512", "--num-kv-blocks", "512").wait_healthy()
    yield srv
    assert srv.stop() == 0


async def test_two_frontends_share_the_port(two_frontends):
    async def one(i: int) -> str:
        # a connection per request, so the kernel can spread them over both listeners
        async with aiohttp.ClientSession() as session:
            text, errors, frontend = await stream_text(session, two_frontends.url, max_tokens=4,
                                                       prompt=f"request {i}")
            assert text and not errors
            return frontend

    served_by = await asyncio.gather(*(one(i) for i in range(40)))
    assert len(set(served_by)) == 2, f"one frontend served everything: {set(served_by)}"


async def test_disconnecting_clients_leave_nothing_behind(two_frontends):
    async def leave_early(i: int) -> None:
        async with aiohttp.ClientSession() as session:
            payload = {"model": "m", "prompt": f"story {i}", "max_tokens": 400, "stream": True,
                       "ignore_eos": True}
            async with session.post(f"{two_frontends.url}/v1/completions", json=payload) as resp:
                assert resp.status == 200
                await resp.content.readline()  # the first event, then hang up mid-stream

    await asyncio.gather(*(leave_early(i) for i in range(32)))
    conn = EngineConn(two_frontends.engine_address)
    stats = conn.wait_drained(timeout_s=15)
    conn.close()
    assert stats.num_requests == 0 and stats.running == 0 and stats.waiting == 0
    assert stats.free_blocks == stats.num_blocks
    assert stats.generation_tokens < 32 * 400 / 2, "aborted requests kept generating"


def test_split_halves_over_tcp(tiny_llama):
    engine_port, ports = free_port(), [free_port(), free_port()]
    engine_addr = f"tcp://127.0.0.1:{engine_port}"
    tandem = [sys.executable, "-m", "frontend.cli"]
    procs = [subprocess.Popen([*tandem, "engine", str(tiny_llama), "--listen", engine_addr,
                               "--served-model-name", "m",
                               "--num-threads", "1", "--log-level", "warning"])]
    try:
        for port in ports:
            procs.append(subprocess.Popen([*tandem, "frontend", "--engine", engine_addr,
                                           "--port", str(port), "--log-level", "warning"]))
        for port in ports:
            _wait_health(f"http://127.0.0.1:{port}")

        async def main() -> None:
            async with aiohttp.ClientSession() as session:
                results = await asyncio.gather(*(
                    stream_text(session, f"http://127.0.0.1:{ports[i % 2]}", prompt="Same prompt")
                    for i in range(12)))
            texts = {r[0] for r in results}
            assert len(texts) == 1 and all(not r[1] for r in results)  # greedy: one answer
            assert len({r[2] for r in results}) == 2

        asyncio.run(main())
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            assert p.wait(timeout=30) == 0


def _wait_health(url: str, timeout_s: float = 120.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(url)


async def test_engine_death_fails_fast_and_leaves_no_orphans(tiny_llama, tmp_path):
    srv = Server(tiny_llama, tmp_path, "--api-server-count", "2").wait_healthy()
    kids = children_of(srv.proc.pid)
    engine_pid = next(p for p in kids if "engine_core" in Path(f"/proc/{p}/cmdline").read_text())
    async with aiohttp.ClientSession() as session:
        stream = asyncio.create_task(
            stream_text(session, srv.url, max_tokens=2000, ignore_eos=True)
        )
        await asyncio.sleep(1.0)
        os.kill(engine_pid, signal.SIGKILL)
        killed = time.monotonic()
        _, errors, _ = await asyncio.wait_for(stream, 10)
        assert errors, "the in-flight stream must end with an error event"
        while True:
            try:
                async with session.get(f"{srv.url}/health") as resp:
                    if resp.status == 503:
                        break
            except aiohttp.ClientError:
                pass  # the launcher may already be tearing the frontends down
            assert time.monotonic() - killed < 2.0 + 0.5, "/health still 200 after 2 s"
            await asyncio.sleep(0.05)
    code = srv.proc.wait(timeout=5.5)
    assert code != 0 and time.monotonic() - killed < 5.5
    time.sleep(0.5)
    assert not [p for p in kids if alive(p)], "child processes left behind"


async def test_sigterm_lets_the_stream_finish(tiny_llama, tmp_path):
    srv = Server(tiny_llama, tmp_path, "--shutdown-grace", "20").wait_healthy()
    async with aiohttp.ClientSession() as session:
        stream = asyncio.create_task(stream_text(session, srv.url, max_tokens=120, ignore_eos=True))
        await asyncio.sleep(0.5)
        srv.proc.send_signal(signal.SIGTERM)
        text, errors, _ = await asyncio.wait_for(stream, 20)
    assert not errors and text
    assert srv.proc.wait(timeout=20) == 0


def test_api_key(tiny_llama, tmp_path):
    srv = Server(tiny_llama, tmp_path, api_key="sekret").wait_healthy()
    try:
        bad = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0,
                            timeout=60)
        with pytest.raises(openai.AuthenticationError) as err:
            bad.models.list()
        assert err.value.status_code == 401 and err.value.body["message"]
        good = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sekret", max_retries=0,
                             timeout=60)
        model = good.models.list().data[0].id
        assert (
            good.completions.create(model=model, prompt="hi", max_tokens=2).choices[0].text
            is not None
        )
    finally:
        assert srv.stop() == 0
