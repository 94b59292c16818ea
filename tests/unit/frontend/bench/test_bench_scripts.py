"""The frontend bench scripts of issue 27 run: the in-process path bench on a few streams, and
the floor frontend answering a streamed completion as the load generator reads it."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from tests.e2e.server import free_port

REPO = Path(__file__).resolve().parents[4]
BENCH = REPO / "tests" / "bench"


def test_frontend_path_runs() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH / "frontend_path.py"), "--streams", "4", "--input-len", "8",
         "--output-len", "4", "--rounds", "1"],
        capture_output=True, text=True, timeout=120, cwd=REPO, check=True).stdout
    lines = out.splitlines()
    assert "4 streams x 4 tokens" in lines[0]
    assert [line.split()[0] for line in lines[1:]] == ["plain", "echo+lp5"]
    assert all("us a token" in line for line in lines[1:])


async def test_floor_frontend_streams(tmp_path: Path) -> None:
    port, ready = free_port(), tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, str(BENCH / "floor_frontend.py"), "--port",
                             str(port), "--ready-file", str(ready), "--step-interval", "0.002",
                             "--engine", "ignored"], cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        async with aiohttp.ClientSession() as session:
            body = {"model": "floor", "prompt": "x", "max_tokens": 5, "stream": True,
                    "stream_options": {"include_usage": True}}
            async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
                text = (await r.read()).decode()
        events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "xxxxx"
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["usage"]["completion_tokens"] == 5
    finally:
        proc.terminate()
        assert proc.wait(timeout=15) == 0
