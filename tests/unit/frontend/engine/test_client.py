"""EngineClient against the fake engine: handshake, routing, abort, utilities, liveness."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import zmq

from frontend.engine.client import (
    EngineClient,
    EngineDeadError,
    EngineUnavailableError,
    UtilityError,
)
from frontend.engine.stream import OutputStream, StepItem
from shared.messages import Hello, Ready, SamplingParams
from shared.transport import InputCodec, OutputCodec
from tests.unit.fake_engine import FakeEngine

PROMPT = [128000, 9906, 1917, 0]


@pytest.fixture
async def client(engine: FakeEngine) -> AsyncIterator[EngineClient]:
    c = EngineClient(engine.address, heartbeat_interval=0.05, silence_timeout=0.3)
    await c.start()
    yield c
    await c.close()


async def drain(stream: OutputStream) -> list[StepItem]:
    items: list[StepItem] = []
    while batch := await asyncio.wait_for(stream.get(), 2):
        items += batch
    return items


async def test_handshake_gives_model_facts(client: EngineClient, engine: FakeEngine) -> None:
    assert client.ready == engine.ready
    assert client.healthy


async def test_handshake_timeout_names_the_address() -> None:
    c = EngineClient("tcp://127.0.0.1:1", handshake_timeout=0.2)
    with pytest.raises(EngineUnavailableError, match="tcp://127.0.0.1:1"):
        await c.start()


async def test_tokens_logprobs_and_finish_are_routed(client: EngineClient) -> None:
    stream = client.add("r1", PROMPT, SamplingParams(max_tokens=5, logprobs=2))
    items = await drain(stream)
    assert [i.token_id for i in items] == [9906, 1917, 0, 9906, 1917]
    assert [i.finish_reason for i in items] == [None] * 4 + ["length"]
    first = items[0].logprob
    assert first is not None and list(first.top_ids) == [9906, 9907] and first.rank == 1
    assert list(first.top_logprobs) == pytest.approx([-0.25, -1.25])
    assert client.num_in_flight == 0


async def test_prompt_only_request_brings_prompt_logprobs(client: EngineClient) -> None:
    params = SamplingParams(max_tokens=0, prompt_logprobs=1)
    [item] = await drain(client.add("r1", PROMPT, params))
    assert item.token_id is None and item.finish_reason == "length"
    assert item.prompt_logprobs is not None
    assert [lp.logprob for lp in item.prompt_logprobs] == pytest.approx([-0.1, -0.2, -0.3])
    assert [lp.top_ids for lp in item.prompt_logprobs] == [[9906], [1917], [0]]


async def test_one_stream_carries_several_requests(client: EngineClient) -> None:
    stream = OutputStream()
    client.add("a", PROMPT, SamplingParams(max_tokens=2), stream, choice=0)
    client.add("b", [5, 6], SamplingParams(max_tokens=3), stream, choice=1)
    items = await drain(stream)
    assert [i.token_id for i in items if i.choice == 0] == [9906, 1917]
    assert [i.token_id for i in items if i.choice == 1] == [5, 6, 5]


async def test_abort_reaches_the_engine_and_closes_the_stream(
    client: EngineClient, engine: FakeEngine
) -> None:
    stream = client.add("r1", PROMPT, SamplingParams(max_tokens=10_000))
    assert await stream.get()
    client.abort(stream.unfinished)
    await drain(stream)  # what was already routed, then the end
    assert stream.unfinished == []
    for _ in range(250):  # the fake engine's thread takes it when it next runs
        if engine.aborted and not engine.running:
            break
        await asyncio.sleep(0.02)
    assert engine.aborted == ["r1"] and not engine.running


async def test_engine_error_finish_carries_the_message(engine: FakeEngine) -> None:
    engine.error_prompt_len = 2
    c = EngineClient(engine.address)
    await c.start()
    [item] = await drain(c.add("r1", PROMPT, SamplingParams()))
    await c.close()
    assert item.finish_reason == "error" and "can never fit" in (item.error or "")


async def test_utilities(client: EngineClient) -> None:
    stats = await client.stats()
    assert (stats.running, stats.finished) == (0, {})
    with pytest.raises(UtilityError):
        await client.call_utility("nope")


async def test_silent_engine_fails_in_flight_requests(
    client: EngineClient, engine: FakeEngine
) -> None:
    stream = client.add("r1", PROMPT, SamplingParams(max_tokens=10_000))
    await stream.get()
    engine.stop()
    with pytest.raises(EngineDeadError):
        await drain(stream)
    assert not client.healthy
    with pytest.raises(EngineDeadError):
        client.add("r2", PROMPT, SamplingParams())


async def test_undecodable_frames_are_dropped() -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    ready = Ready("m", "tok", 16, 100, [1])
    client = EngineClient(f"tcp://127.0.0.1:{port}", handshake_timeout=2)
    start = asyncio.create_task(client.start())
    assert await asyncio.to_thread(router.poll, 5000), "no Hello came"  # (a bounded wait)
    identity, frame = router.recv_multipart()
    assert isinstance(InputCodec().decode(frame), Hello)
    router.send_multipart([identity, b"\xc1garbage"])
    router.send_multipart([identity, OutputCodec().encode(ready)])
    assert await start == ready
    await client.close()
    router.close(linger=0)
    ctx.term()
