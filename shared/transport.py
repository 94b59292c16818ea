"""ZeroMQ framing shared by both sides: msgpack codecs for the message unions, and the rule
both sides apply to judge a stuck engine (`is_stalled`).

The engine binds a ROUTER; each frontend connects a DEALER with a unique identity. A frame
that does not decode raises `msgspec.DecodeError`; callers log and drop it.
"""

from __future__ import annotations

import os
import uuid

import msgspec
import zmq

from shared.messages import EngineInput, EngineOutput, StepProgress


class InputCodec:
    """Encodes what frontends send, decodes it on the engine."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(EngineInput)

    def encode(self, msg: EngineInput) -> bytes:
        return self._enc.encode(msg)

    def decode(self, frame: bytes | memoryview) -> EngineInput:
        return self._dec.decode(frame)


class OutputCodec:
    """Encodes what the engine sends, decodes it on a frontend."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(EngineOutput)

    def encode(self, msg: EngineOutput) -> bytes:
        return self._enc.encode(msg)

    def decode(self, frame: bytes | memoryview) -> EngineOutput:
        return self._dec.decode(frame)


def new_identity(prefix: str = "fe") -> bytes:
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}".encode()


def configure(sock: zmq.Socket) -> None:  # type: ignore[type-arg]
    """Socket options both sides want: never block on close, no high-water-mark drops."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)


DEFAULT_STALL_FLOOR_S = 10.0
STALL_SLOWEST_FACTOR = 5.0


def stall_bound(progress: StepProgress, floor_s: float = DEFAULT_STALL_FLOOR_S) -> float:
    """How long a busy engine may go without finishing a step before it counts as stuck: five
    times the slowest step it has run, never less than `floor_s` (a first step, a long prefill
    chunk on a slow machine)."""
    return max(floor_s, STALL_SLOWEST_FACTOR * progress.slowest_step_s)


def is_stalled(progress: StepProgress, floor_s: float = DEFAULT_STALL_FLOOR_S) -> bool:
    """The liveness rule frontends and the launcher share: work waits and no step finished
    within the bound. A socket that answers is not enough (the I/O thread answers pings)."""
    return progress.busy and progress.since_step_s > stall_bound(progress, floor_s)
