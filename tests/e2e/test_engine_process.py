"""The engine as a process: handshake, routing, bad frames, aborts, stats over ZeroMQ."""

from __future__ import annotations

import pytest

from shared.messages import AbortRequest, StepOutputs, read_ints
from tests.e2e.engine_proc import EngineConn, start_engine


@pytest.fixture(scope="module")
def engine_addr(tiny_llama, tmp_path_factory):
    addr = f"ipc://{tmp_path_factory.mktemp('ipc')}/engine.sock"
    proc = start_engine(tiny_llama, addr, "--num-kv-blocks", "128", "--max-model-len", "256")
    yield addr
    proc.terminate()
    assert proc.wait(timeout=20) == 0


def collect(conn: EngineConn, rids: set[str]) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {r: [] for r in rids}
    done: set[str] = set()
    while done != rids:
        msg = conn.recv()
        assert isinstance(msg, StepOutputs)
        for i, rid in enumerate(msg.req_ids):
            assert rid in rids, "an output was routed to the wrong frontend"
            t = read_ints(msg.token_ids)[i]
            if t >= 0:
                got[rid].append(t)
        done |= {msg.req_ids[f.index] for f in msg.finished}
    return got


def test_handshake_and_generation(engine_addr):
    conn = EngineConn(engine_addr)
    ready = conn.hello()
    assert (
        ready.max_model_len == 256 and ready.vocab_size == 128256 and 128001 in ready.eos_token_ids
    )
    conn.add("a", [128000, 9906, 1917], max_tokens=5, temperature=0.0)
    conn.add("b", [128000, 791], max_tokens=3, temperature=0.0)
    got = collect(conn, {"a", "b"})
    assert len(got["a"]) == 5 and len(got["b"]) == 3
    conn.close()


def test_outputs_route_to_the_sender(engine_addr):
    one, two = EngineConn(engine_addr), EngineConn(engine_addr)
    one.hello(), two.hello()
    one.add("one-1", [128000, 1, 2, 3], max_tokens=4, temperature=0.0)
    two.add("two-1", [128000, 1, 2, 3], max_tokens=6, temperature=0.0)
    assert len(collect(one, {"one-1"})["one-1"]) == 4
    assert len(collect(two, {"two-1"})["two-1"]) == 6
    one.close(), two.close()


def test_bad_frames_are_dropped_and_the_engine_keeps_serving(engine_addr):
    conn = EngineConn(engine_addr)
    conn.sock.send(b"\x93not msgpack of ours")
    conn.sock.send(b"")
    conn.hello()
    conn.add("after", [128000, 5], max_tokens=2)
    assert len(collect(conn, {"after"})["after"]) == 2
    conn.close()


def test_abort_frees_everything(engine_addr):
    conn = EngineConn(engine_addr)
    conn.hello()
    for i in range(8):
        conn.add(f"long{i}", [128000] + list(range(100, 140)), max_tokens=200, ignore_eos=True)
    first = conn.recv()
    assert isinstance(first, StepOutputs)
    conn.send(AbortRequest([f"long{i}" for i in range(8)]))
    stats = conn.wait_drained()
    assert stats.num_requests == 0 and stats.free_blocks == stats.num_blocks
    conn.close()
