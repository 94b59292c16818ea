"""`tandem serve --data-parallel-size 2`: two tiny engines of one thread each behind one frontend.

Greedy outputs equal Hugging Face's on either engine, each engine verifying drafts
(speculative decoding, the model as its own draft); each engine publishes its KV-cache events
in vLLM 0.32's format on its own ports (read here by Tandem's decoder, which the unit tests hold
to vLLM's recorded bytes), with replay, and `/reset_prefix_cache` clears every rank;
`/metrics` shows both engines; and an engine SIGKILLed under load: its requests fail clearly,
the other serves everything new, the launcher's replacement takes work again with an empty
cache. (Routing policy: unit tests.)"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from pathlib import Path

import aiohttp
import pytest
import zmq
from transformers import AutoTokenizer

from shared.block_hash import chain_hashes
from shared.kv_events import AllBlocksCleared, BlockStored, KVEventBatch
from tests import kv_subscriber
from tests.e2e.server import Server, free_port
from tests.e2e.test_launcher import children_of
from tests.engine.test_hf_parity import ATOL, MAX_NEW, Reference, make_prompts


def free_port_pair() -> int:
    """A port whose successor is free too (rank 1 binds the next one)."""
    for _ in range(100):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two consecutive free ports")


@pytest.fixture(scope="module")
def ports() -> tuple[int, int]:
    return free_port_pair(), free_port_pair()


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory, ports):
    pub, replay = ports
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": "kv@tandem"}
    srv = Server(tiny_llama, tmp_path_factory.mktemp("dp"), "--data-parallel-size", "2",
                 "--max-model-len", "512", "--num-kv-blocks", "64",
                 "--kv-events-config", json.dumps(events),
                 # each engine verifies drafts (the model as its own draft: all accepted)
                 "--speculative-config", json.dumps({"model": str(tiny_llama),
                                                     "num_speculative_tokens": 2})
                 ).wait_healthy()
    yield srv
    assert srv.stop() == 0


async def complete(session: aiohttp.ClientSession, url: str, prompt: list[int] | str,
                   rank: int | None = None, **body) -> tuple[int, dict]:
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    payload = {"model": "m", "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0,
               **body}
    async with session.post(f"{url}/v1/completions", json=payload, headers=headers) as resp:
        return resp.status, await resp.json()


async def metric(session: aiohttp.ClientSession, url: str, name: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as resp:
        text = await resp.text()
    found = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) + 1:].rsplit("} ", 1)
            engine = next(p.split("=")[1].strip('"') for p in labels.split(",")
                          if p.startswith("engine="))
            found[engine] = float(value)
    return found


async def test_greedy_outputs_equal_hf_on_either_engine(server, tiny_llama) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    reference = Reference(tiny_llama)
    prompts = make_prompts(tokenizer, n=4)
    async with aiohttp.ClientSession() as session:
        for rank in (0, 1):
            for prompt in prompts:
                status, body = await complete(session, server.url, prompt, rank, logprobs=0,
                                              return_tokens_as_token_ids=True)
                assert status == 200, body
                logprobs = body["choices"][0]["logprobs"]
                tokens = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
                want, want_lps = reference.generate(prompt)
                assert tokens == want
                assert logprobs["token_logprobs"] == pytest.approx(want_lps, abs=ATOL)
        generated = await metric(session, server.url, "vllm:generation_tokens_total")
        assert set(generated) == {"0", "1"}
        assert all(v >= len(prompts) * MAX_NEW for v in generated.values()), generated
        accepted = await metric(session, server.url,
                                "vllm:spec_decode_num_accepted_tokens_total")
        assert set(accepted) == {"0", "1"} and min(accepted.values()) > 0, accepted
        status, body = await complete(session, server.url, "hi", rank=2)
        assert status == 400 and "X-data-parallel-rank" in body["error"]["message"]


def subscribe(ctx: zmq.Context, port: int) -> zmq.Socket:  # type: ignore[type-arg]
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@tandem")
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub


def batches_until(sub: zmq.Socket, found, timeout_s: float = 20.0):  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sub.poll(200):
            topic, seq, batch = kv_subscriber.read(sub.recv_multipart())
            assert topic == b"kv@tandem"
            if found(batch):
                return seq, batch
    raise AssertionError("the awaited KV-cache event never came")


async def subscribed(session: aiohttp.ClientSession, url: str, rank: int,
                     sub: zmq.Socket) -> None:  # type: ignore[type-arg]
    """Requests pinned to `rank` until `sub` hears its events: a PUB drops what it sends
    before a subscription has reached it, and how long that takes after the connect has no
    bound on a loaded machine (a fixed sleep lost the events there)."""
    for attempt in range(40):
        prompt = f"subscription check {rank} {attempt} " * 4  # a full block or more
        status, _ = await complete(session, url, prompt, rank=rank, max_tokens=1)
        assert status == 200
        if await asyncio.to_thread(sub.poll, 500):
            return
    raise AssertionError(f"rank {rank}'s KV-event subscription never reached its publisher")


async def test_each_rank_publishes_vllms_events_with_replay_and_clear(
        server, tiny_llama, ports) -> None:
    pub, replay = ports
    ctx = zmq.Context()
    subs = [subscribe(ctx, pub + rank) for rank in (0, 1)]
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
        prompt = tokenizer("one two three four five six seven eight " * 6).input_ids
        async with aiohttp.ClientSession() as session:
            for rank, sub in enumerate(subs):
                await subscribed(session, server.url, rank, sub)
            status, _ = await complete(session, server.url, prompt, rank=1, max_tokens=1)
            assert status == 200
            want = chain_hashes(prompt, 16)

            def stores_prompt(batch: KVEventBatch) -> bool:
                return any(isinstance(e, BlockStored) and e.block_hashes == want
                           for e in batch.events)

            seq, batch = await asyncio.to_thread(batches_until, subs[1], stores_prompt)
            assert batch.data_parallel_rank == 1
            (stored,) = [e for e in batch.events if isinstance(e, BlockStored)]
            assert stored.parent_block_hash is None and stored.block_size == 16
            assert stored.token_ids == prompt[:16 * len(want)] and stored.medium == "GPU"
            assert stored.group_idx == 0 and stored.extra_keys == [None] * len(want)
            replayed = kv_subscriber.replay(ctx, f"tcp://127.0.0.1:{replay + 1}", 0)
            assert any(r.seq == seq and stores_prompt(r.batch) for r in replayed)
            assert {r.topic for r in replayed} == {b"kv@tandem"}
            seqs = [r.seq for r in replayed]
            assert seqs == sorted(seqs)
            async with session.post(f"{server.url}/reset_prefix_cache") as resp:
                assert resp.status == 200
        for rank, sub in enumerate(subs):
            _, cleared = await asyncio.to_thread(batches_until, sub, lambda b: any(
                isinstance(e, AllBlocksCleared) for e in b.events))
            assert cleared.data_parallel_rank == rank
    finally:
        for sub in subs:
            sub.close()
        ctx.term()


async def stream_one(session: aiohttp.ClientSession, url: str, i: int) -> tuple[float, str]:
    """(when it was sent, "ok" or the error a client sees) for one streamed completion."""
    sent = time.monotonic()
    payload = {"model": "m", "prompt": f"request number {i} " * 8, "max_tokens": 24,
               "ignore_eos": True, "stream": True}
    try:
        async with session.post(f"{url}/v1/completions", json=payload) as resp:
            if resp.status != 200:
                return sent, f"{resp.status}: {(await resp.json())['error']['message']}"
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])  # (a chunk's text may itself hold '"error"')
                if "error" in event:
                    return sent, "event: " + event["error"]["message"]
                assert "choices" in event, line
        return sent, "ok"
    except aiohttp.ClientError as exc:
        return sent, f"connection: {exc}"


async def test_an_engine_killed_under_load_fails_its_requests_and_is_replaced(server) -> None:
    (rank1,) = [pid for pid in children_of(server.proc.pid)
                if b"--data-parallel-rank\x001" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    results: list[tuple[float, str]] = []
    killed_at = 0.0

    async def load(session: aiohttp.ClientSession, worker: int) -> None:
        for i in range(worker, 400, 4):
            results.append(await stream_one(session, server.url, i))
            if killed_at and time.monotonic() - killed_at > 6:
                return

    async with aiohttp.ClientSession() as session:
        workers = [asyncio.create_task(load(session, w)) for w in range(4)]
        await asyncio.sleep(2.0)
        os.kill(rank1, signal.SIGKILL)
        killed_at = time.monotonic()
        await asyncio.gather(*workers)
        failed = [why for sent, why in results if why != "ok"]
        late = [why for sent, why in results if sent > killed_at + 3 and why != "ok"]
        assert not late, late
        assert failed, "no request was running on the killed engine"
        assert all("engine" in why and why.startswith(("503", "event")) for why in failed), failed
        assert sum(1 for sent, _ in results if sent > killed_at + 3) >= 4
        deadline = time.monotonic() + 90
        while True:  # the replacement takes work again
            status, _ = await complete(session, server.url, "back again", rank=1, max_tokens=2)
            if status == 200:
                break
            assert time.monotonic() < deadline, "the replacement engine never took work"
            await asyncio.sleep(0.5)
        hits = await metric(session, server.url, "vllm:prefix_cache_hits_total")
        assert hits.get("1") == 0  # a new engine, with an empty cache
