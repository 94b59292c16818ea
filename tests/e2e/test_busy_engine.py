"""A busy engine is not a dead one: the frontend's liveness rule against an engine process.

The engine here is the fake engine in a process of its own (`python -m tests.unit.fake_engine
HOLD_S`); SIGUSR1 makes it hold its GIL for HOLD_S in one C call, as a real engine's first
grammar compile does while it loads the tokenizer (docs/reliability.md, "A busy engine is not a
dead one"). Its pings then go unanswered, but its process runs: the frontend must wait for it,
with both cores busy too, and still find an engine that is stopped or killed as fast as before.
The client's bounds are the production ones scaled down: pings every 0.05 s, silence 0.3 s, the
busy bound (`stall_timeout`) 3 s.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from frontend.engine.client import EngineClient, EngineDeadError
from frontend.engine.stream import OutputStream
from shared.messages import SamplingParams

REPO = Path(__file__).resolve().parents[2]
PROMPT = [128000, 9906, 1917, 0]
SILENCE_S = 0.3
BUSY_BOUND_S = 3.0


def start_engine(hold_s: float) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.unit.fake_engine", str(hold_s)],
                            cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    if not select.select([proc.stdout], [], [], 60)[0]:
        proc.kill()
        raise TimeoutError("the fake engine process printed no address")
    return proc, proc.stdout.readline().strip()


@pytest.fixture
def engine_factory() -> Iterator[Callable[[float], tuple[subprocess.Popen[str], str]]]:
    procs: list[subprocess.Popen[str]] = []

    def start(hold_s: float) -> tuple[subprocess.Popen[str], str]:
        proc, address = start_engine(hold_s)
        procs.append(proc)
        return proc, address

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(timeout=10)


@pytest.fixture
async def connect() -> AsyncIterator[Callable[[str], asyncio.Future[EngineClient]]]:
    clients: list[EngineClient] = []

    async def make(address: str) -> EngineClient:
        client = EngineClient(address, heartbeat_interval=0.05, silence_timeout=SILENCE_S,
                              stall_timeout=BUSY_BOUND_S, handshake_timeout=30)
        await client.start()
        clients.append(client)
        return client

    yield make  # type: ignore[misc]
    for client in clients:
        await client.close()


def spin(until: float) -> None:
    while time.monotonic() < until:
        pass


@contextmanager
def both_cores_busy(seconds: float) -> Iterator[None]:
    """A busy loop on every core (of 2 here) for `seconds` at most."""
    until = time.monotonic() + seconds
    spinners = [multiprocessing.Process(target=spin, args=(until,), daemon=True)
                for _ in range(os.cpu_count() or 2)]
    for p in spinners:
        p.start()
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
            p.join(timeout=10)


async def next_tokens(stream: OutputStream, timeout_s: float = 10.0) -> int:
    return len(await asyncio.wait_for(stream.get(), timeout_s))


async def failure_of(stream: OutputStream, within_s: float) -> tuple[EngineDeadError, float]:
    """The error that ends `stream`, and how long after the call it came."""
    start = time.monotonic()
    try:
        async with asyncio.timeout(within_s):
            while True:
                await next_tokens(stream)
    except EngineDeadError as exc:
        return exc, time.monotonic() - start
    raise AssertionError(f"the stream did not fail within {within_s} s")


async def test_an_engine_holding_its_gil_on_a_loaded_machine_is_waited_for(
        engine_factory, connect) -> None:
    proc, address = engine_factory(1.5)  # 5x the silence bound
    client = await connect(address)
    stream = client.add("r1", PROMPT, SamplingParams(max_tokens=100_000, ignore_eos=True))
    await next_tokens(stream)
    with both_cores_busy(4.0):
        os.kill(proc.pid, signal.SIGUSR1)
        held_at = time.monotonic()
        longest_gap, last = 0.0, held_at
        while time.monotonic() - held_at < 2.5:
            assert client.healthy, "a busy engine was declared dead"
            try:
                await asyncio.wait_for(stream.get(), 0.05)
            except TimeoutError:
                continue
            now = time.monotonic()
            longest_gap, last = max(longest_gap, now - last), now
    assert longest_gap > 1.0, "the engine's GIL was not held: this test tests nothing"
    assert client.healthy
    assert await next_tokens(stream) > 0  # and it serves on
    client.abort(stream.unfinished)


async def test_an_engine_held_past_the_busy_bound_is_dead(engine_factory, connect) -> None:
    proc, address = engine_factory(BUSY_BOUND_S + 3)
    client = await connect(address)
    stream = client.add("r1", PROMPT, SamplingParams(max_tokens=100_000, ignore_eos=True))
    await next_tokens(stream)
    os.kill(proc.pid, signal.SIGUSR1)
    exc, after = await failure_of(stream, BUSY_BOUND_S + 3)
    assert "process is up but has answered no ping" in str(exc)
    assert after >= BUSY_BOUND_S
    assert not client.healthy


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL])
async def test_a_stopped_or_killed_engine_is_dead_at_its_silence(
        engine_factory, connect, sig: signal.Signals) -> None:
    """Stopped, its heartbeats stop too: its link falls within the silence bound (a ping
    interval, then 0.25 s), so it is found by its silence as before (0.3-0.5 s here), not
    after the busy bound; killed, its link falls at once."""
    proc, address = engine_factory(1.0)
    client = await connect(address)
    stream = client.add("r1", PROMPT, SamplingParams(max_tokens=100_000, ignore_eos=True))
    await next_tokens(stream)
    os.kill(proc.pid, sig)
    exc, _ = await failure_of(stream, BUSY_BOUND_S)
    assert "stopped answering" in str(exc)
    assert not client.healthy
    if sig == signal.SIGSTOP:
        os.kill(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 5
        while not client.healthy:
            assert time.monotonic() < deadline, "the resumed engine was not heard again"
            await asyncio.sleep(0.02)
