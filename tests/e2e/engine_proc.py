"""Start a real engine process and talk to it over a real ZeroMQ socket."""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from pathlib import Path

import zmq

from shared.curve import ClientKeys, secure_client
from shared.messages import (
    AddRequest,
    EngineOutput,
    EngineStats,
    Hello,
    Ready,
    SamplingParams,
    UtilityRequest,
    UtilityResult,
    ints,
)
from shared.transport import InputCodec, OutputCodec, configure, new_identity


def start_engine(model: Path, address: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "engine_core", str(model), "--listen", address,
                             "--num-threads", "1", "--log-level", "warning", *extra])


class EngineConn:
    """A blocking DEALER client for tests."""

    def __init__(self, address: str, timeout_s: float = 60.0,
                 curve: ClientKeys | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        configure(self.sock)
        self.sock.setsockopt(zmq.IDENTITY, new_identity("test"))
        if curve is not None:
            secure_client(self.sock, curve)
        self.timeout_ms = int(timeout_s * 1000)
        # A DEALER's send blocks while it has no peer: once the engine refuses a CURVE
        # handshake, libzmq drops the pipe, so a send must time out like a receive.
        self.sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        self.sock.connect(address)
        self.inp, self.out = InputCodec(), OutputCodec()
        self.calls = itertools.count()

    def send(self, msg) -> None:
        try:
            self.sock.send(self.inp.encode(msg))
        except zmq.Again:
            raise TimeoutError("no connection to the engine to send on") from None

    def recv(self) -> EngineOutput:
        if not self.sock.poll(self.timeout_ms):
            raise TimeoutError("engine did not answer")
        return self.out.decode(self.sock.recv())

    def hello(self) -> Ready:
        self.send(Hello("test"))
        msg = self.recv()
        assert isinstance(msg, Ready)
        return msg

    def stats(self) -> EngineStats:
        call = next(self.calls)
        self.send(UtilityRequest(call, "stats"))
        while True:
            msg = self.recv()
            if isinstance(msg, UtilityResult) and msg.call_id == call:
                assert msg.stats is not None, msg.error
                return msg.stats

    def add(self, rid: str, prompt: list[int], **params) -> None:
        self.send(AddRequest(rid, ints(prompt), SamplingParams(**params)))

    def wait_drained(self, timeout_s: float = 30.0) -> EngineStats:
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if stats.num_requests == 0 or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()
