"""Liveness judged on the work, not on the socket (issue 15).

The real engine process wrapper (engine_core/process.py: I/O thread answering pings, busy loop)
runs around a stub core whose steps can hang while its I/O thread stays alive; a real
EngineClient watches it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from frontend.engine.client import EngineClient, EngineDeadError
from frontend.engine.stream import OutputStream
from shared.messages import SamplingParams, StepProgress
from shared.transport import is_stalled, stall_bound
from tests.e2e.stub_engine import StubCore, start_stub_engine


@pytest.fixture
def core() -> StubCore:
    return StubCore()


@pytest.fixture
def address(core: StubCore, tmp_path) -> Iterator[str]:
    addr = f"ipc://{tmp_path}/engine.sock"
    proc = start_stub_engine(addr, core, frontend_timeout_s=1.0)
    yield addr
    core.resume()
    proc.stop()


@pytest.fixture
async def client(address: str) -> AsyncIterator[EngineClient]:
    c = EngineClient(address, heartbeat_interval=0.05, silence_timeout=0.3, stall_timeout=1.0)
    await c.start()
    yield c
    await c.close()


async def _drain(stream: OutputStream, timeout: float = 10.0) -> int:
    tokens = 0
    while batch := await asyncio.wait_for(stream.get(), timeout):
        tokens += len(batch)
    return tokens


async def _wait_for(predicate, timeout: float) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, "condition not reached in time"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def test_the_stall_bound_follows_the_slowest_step() -> None:
    assert stall_bound(StepProgress(True, 0.0, 0.1), floor_s=10) == 10
    assert stall_bound(StepProgress(True, 0.0, 4.0), floor_s=10) == 20
    assert not is_stalled(StepProgress(False, 100.0, 0.1))  # idle: nothing is owed
    assert is_stalled(StepProgress(True, 10.5, 0.1))


async def test_a_stuck_step_loop_is_detected_while_the_socket_answers(
    client: EngineClient, core: StubCore
) -> None:
    stream = client.add("r1", [1, 2, 3], SamplingParams(max_tokens=100_000))
    await asyncio.wait_for(stream.get(), 5)
    core.hang()
    hung_at = time.monotonic()
    with pytest.raises(EngineDeadError, match="step loop"):
        await _drain(stream)
    detected = time.monotonic() - hung_at
    assert not client.healthy
    with pytest.raises(EngineDeadError):
        client.add("r2", [1], SamplingParams())
    # the bound is 1 s (stall_timeout) here; the ping spacing adds at most 0.05 s
    assert 1.0 <= detected < 2.0, detected
    core.resume()
    recovered = await _wait_for(lambda: client.healthy, 5)
    assert recovered < 1.0
    assert await _drain(client.add("r3", [1], SamplingParams(max_tokens=3))) == 3


async def test_an_idle_engine_is_never_stalled(client: EngineClient, core: StubCore) -> None:
    core.hang()  # no work: the loop waits for input, which is not a stall
    await asyncio.sleep(1.5)
    assert client.healthy


async def test_a_blocked_frontend_loop_does_not_declare_a_live_engine_dead(
    client: EngineClient,
) -> None:
    """Silence is what the engine owes: when this process's own loop is blocked (a long
    GIL-holding call), the answers wait unread and must not count as the engine's silence."""
    stream = client.add("r1", [1, 2, 3], SamplingParams(max_tokens=300))
    await asyncio.wait_for(stream.get(), 5)
    for _ in range(5):
        time.sleep(1.0)  # the event loop blocked far beyond silence_timeout (0.3 s)
        await asyncio.sleep(0)
        assert client.healthy
    assert await _drain(stream) > 0
    assert client.healthy


async def test_requests_of_a_silent_frontend_are_aborted(address: str, core: StubCore) -> None:
    gone = EngineClient(address, heartbeat_interval=0.05)
    await gone.start()
    gone.add("orphan", [1], SamplingParams(max_tokens=100_000))
    await _wait_for(lambda: "orphan" in core.scheduler.requests, 5)
    await asyncio.sleep(0.2)  # it has pinged: a frontend the engine judges
    for task in gone._tasks:  # it stops pinging and reading, as a killed process would
        task.cancel()
    gone._stop_reading()
    aborted = await _wait_for(lambda: "orphan" not in core.scheduler.requests, 5)
    assert aborted < 3.0  # 1 s of silence allowed here, checked once a second
    assert core.counts.frontends_lost == 1
    gone._close_socket()
