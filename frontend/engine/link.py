"""`EngineLink`: whether the engine's process is there at all, apart from whether it answers.

The engine answers pings from its I/O thread, a Python thread. A C call that holds the GIL
anywhere in the engine keeps those answers back as surely as a dead process would: the first
grammar compile's tokenizer load is one Rust call of ~1.1 s here, 4.4 s with both cores busy
(docs/reliability.md, "A busy engine is not a dead one"). So a frontend keeps a second
connection to the engine's socket that carries no message, only ZeroMQ's own heartbeats (ZMTP
PING and PONG), which libzmq's I/O thread answers in C, without the GIL. While that connection
stands, the engine's process runs and is reachable, whatever its Python is doing.

It falls when the process cannot answer: at once when the process dies (the kernel closes its
socket), and after `timeout_s` without a PONG when it is stopped (SIGSTOP, a frozen VM or
container) or cut off. ZeroMQ reconnects it by itself once the engine is back.
"""

from __future__ import annotations

import zmq
from zmq.utils.monitor import parse_monitor_message

from shared.curve import ClientKeys, secure_client
from shared.transport import configure

_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


class EngineLink:
    """A message-free DEALER to the engine with ZMTP heartbeats, and whether it stands."""

    def __init__(self, ctx: zmq.Context, address: str,  # type: ignore[type-arg]
                 interval_s: float, timeout_s: float, curve: ClientKeys | None = None) -> None:
        """A PING every `interval_s`; the connection falls after `timeout_s` without a
        PONG (or anything else) from the engine."""
        self._sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
        configure(self._sock)
        self._sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, round(interval_s * 1000)))
        self._sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, round(timeout_s * 1000)))
        if curve is not None:
            secure_client(self._sock, curve)
        self._monitor: zmq.Socket[bytes] = self._sock.get_monitor_socket(_EVENTS)
        self._sock.connect(address)
        self._up = False

    @property
    def up(self) -> bool:
        """The connection stands now: its handshake done, no disconnect since. Reads the
        events that came since the last look; never blocks."""
        while self._monitor.poll(0):
            event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            self._up = event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        return self._up

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
