"""No wire message kills the engine (issue 15): hypothesis draws messages over the msgspec wire
schemas (out-of-range and non-finite values, bad buffers, unknown ids and methods, garbage
histograms) and sends them to a real engine process over its socket; after each batch the
engine must still answer, and at the end serve a good request, with nothing left running."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.messages import (
    AbortRequest,
    AddRequest,
    Histogram,
    MetricsReport,
    SamplingParams,
    StepOutputs,
    StopRequest,
    UtilityRequest,
    ints,
)
from tests.e2e.engine_proc import EngineConn, start_engine

VOCAB = 128256
INT64 = st.integers(-(2**63), 2**63 - 1)
WIDE = st.one_of(st.integers(-3, 40), INT64, st.integers(2**63, 2**64 - 1))
FLOATS = st.one_of(st.floats(-3, 3), st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0.0, 1.0, -0.0, 1e-300, 1e300, math.nan, math.inf]))
TOKEN = st.one_of(st.integers(0, VOCAB - 1), st.integers(-(2**31), 2**31 - 1))
SMALL_COUNT = st.one_of(st.integers(0, 8), st.integers(-3, 30), WIDE)

PARAMS = st.builds(
    SamplingParams,
    max_tokens=st.one_of(st.integers(0, 8), WIDE),
    temperature=FLOATS, top_p=FLOATS, top_k=SMALL_COUNT, min_p=FLOATS,
    seed=st.one_of(st.none(), WIDE),
    presence_penalty=FLOATS, frequency_penalty=FLOATS, repetition_penalty=FLOATS,
    logit_bias=st.one_of(st.none(), st.dictionaries(TOKEN, FLOATS, max_size=3)),
    min_tokens=SMALL_COUNT,
    stop_token_ids=st.lists(TOKEN, max_size=3),
    ignore_eos=st.booleans(),
    logprobs=st.one_of(st.none(), SMALL_COUNT),
    prompt_logprobs=st.one_of(st.none(), SMALL_COUNT),
)
PROMPT = st.one_of(st.lists(TOKEN, min_size=0, max_size=12).map(ints), st.binary(max_size=40))
IDS = st.lists(st.text(max_size=8), max_size=3)
HISTOGRAM = st.builds(Histogram, name=st.sampled_from(["ttft", "x", ""]),
                      bounds=st.lists(FLOATS, max_size=4), counts=st.lists(WIDE, max_size=5),
                      sum=FLOATS)
MESSAGE = st.one_of(
    st.builds(AddRequest, request_id=st.text(max_size=6), prompt_token_ids=PROMPT, params=PARAMS),
    st.builds(AbortRequest, request_ids=IDS),
    st.builds(StopRequest, request_ids=IDS),
    st.builds(UtilityRequest, call_id=INT64, method=st.sampled_from(["stats", "ping", "zap"])),
    st.builds(MetricsReport, histograms=st.lists(HISTOGRAM, max_size=2)),
)


@pytest.fixture(scope="module")
def conn(tiny_llama, tmp_path_factory):
    addr = f"ipc://{tmp_path_factory.mktemp('ipc')}/engine.sock"
    proc = start_engine(tiny_llama, addr, "--num-kv-blocks", "64", "--max-model-len", "128")
    c = EngineConn(addr, timeout_s=60)
    c.hello()
    yield c
    c.close()
    proc.terminate()
    assert proc.wait(timeout=20) == 0, "the engine did not survive to a clean exit"


@settings(max_examples=60, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(batch=st.lists(MESSAGE, min_size=1, max_size=6))
def test_generated_wire_messages_never_kill_the_engine(conn: EngineConn, batch) -> None:
    for msg in batch:
        conn.send(msg)
    assert conn.stats() is not None  # still answering, after everything before it was handled


def test_the_engine_serves_after_the_fuzz(conn: EngineConn) -> None:
    stats = conn.wait_drained(timeout_s=60)
    assert stats.num_requests == 0 and stats.free_blocks == stats.num_blocks
    assert stats.step_errors == 0, "a generated request got past the checks and failed a step"
    conn.add("good", [128000, 9906], max_tokens=3, temperature=0.0)
    while True:
        msg = conn.recv()
        if isinstance(msg, StepOutputs) and "good" in msg.req_ids:
            done = [f for f in msg.finished if msg.req_ids[f.index] == "good"]
            if done:
                assert done[0].reason == "length"
                break
