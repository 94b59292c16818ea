"""A paused engine is not a stuck one: SIGSTOP longer than the stall floor, streams in flight.

A whole engine process stopped (a cgroup freezer, `docker pause`, a VM frozen or migrated, a
debugger) finishes no step meanwhile, but none of that time could it run: on SIGCONT the
launcher must not kill it as stuck. The streams in flight fail clearly (the frontends' silence
timeout), and the same engine process serves again at once, with nothing left running.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from pathlib import Path

import aiohttp

from shared.transport import DEFAULT_STALL_FLOOR_S
from tests.e2e.server import Server
from tests.e2e.test_launcher import alive, children_of, stream_text

# past the stall floor; TANDEM_PAUSE_S=30 pytest -s tests/e2e/test_pause.py tries a longer one
PAUSE_S = float(os.environ.get("TANDEM_PAUSE_S", DEFAULT_STALL_FLOOR_S + 3.0))


async def _health_within(session: aiohttp.ClientSession, url: str, seconds: float) -> float:
    """Seconds until /health answers 200 (fails after `seconds`)."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        try:
            async with session.get(f"{url}/health") as resp:
                if resp.status == 200:
                    return time.monotonic() - start
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError(f"/health not 200 within {seconds} s of SIGCONT")


async def _running(session: aiohttp.ClientSession, url: str) -> float:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    match = re.search(r"^vllm:num_requests_running(?:\{[^}]*\})? (\S+)$", text, re.M)
    assert match, "no vllm:num_requests_running in /metrics"
    return float(match.group(1))


async def test_a_paused_engine_resumes_serving_and_is_not_killed(tiny_llama, tmp_path):
    srv = Server(tiny_llama, tmp_path, "--api-server-count", "2").wait_healthy()
    try:
        engine_pid = next(p for p in children_of(srv.proc.pid)
                          if "engine_core" in Path(f"/proc/{p}/cmdline").read_text())
        async with aiohttp.ClientSession() as session:
            streams = [asyncio.create_task(stream_text(session, srv.url, max_tokens=400,
                                                       ignore_eos=True)) for _ in range(8)]
            await asyncio.sleep(1.5)
            os.kill(engine_pid, signal.SIGSTOP)
            await asyncio.sleep(PAUSE_S)
            os.kill(engine_pid, signal.SIGCONT)
            took = await _health_within(session, srv.url, 3.0)
            results = await asyncio.wait_for(asyncio.gather(*streams), 30)
            text, errors, _ = await stream_text(session, srv.url, max_tokens=8)
            assert text and not errors, "a new request after the pause must succeed"
            assert srv.proc.poll() is None, "the launcher went down"
            assert alive(engine_pid) and engine_pid in children_of(srv.proc.pid), \
                "the engine was replaced or killed"
            # every stream in flight across the pause ended clearly: an error event, or whole
            for text, errors, _ in results:
                assert errors or text, "a stream ended with neither text nor an error"
            deadline = time.monotonic() + 5.0
            while await _running(session, srv.url) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert await _running(session, srv.url) == 0, "requests from before still run"
        print(f"paused {PAUSE_S:g} s: /health 200 {took:.2f} s after SIGCONT; "
              f"{sum(bool(e) for _, e, _ in results)} of 8 streams ended with an error event")
    finally:
        srv.stop()
