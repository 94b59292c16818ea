"""ZeroMQ framing shared by both sides: msgpack codecs for the message unions.

The engine binds a ROUTER; each frontend connects a DEALER with a unique identity. A frame
that does not decode raises `msgspec.DecodeError`; callers log and drop it.
"""

from __future__ import annotations

import os
import uuid

import msgspec
import zmq

from shared.messages import EngineInput, EngineOutput


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
