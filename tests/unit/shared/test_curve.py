"""CURVE on the engine socket: `tandem keys` files, who the server admits, the open-port warning."""

from __future__ import annotations

import logging
import stat
import time
from pathlib import Path

import pytest
import zmq
import zmq.auth

from frontend.cli import main as tandem
from shared.curve import (
    ClientKeys,
    CurveKeyError,
    client_keys,
    open_engine_refusal,
    secure_client,
    secure_server,
    warn_if_open,
)

REFUSED_WITHIN_MS = 500


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    assert tandem(["keys", str(tmp_path / "keys")]) == 0
    return tmp_path / "keys"


def test_tandem_keys_writes_loadable_private_files(keys: Path) -> None:
    for name in ("engine", "frontend"):
        public, secret = zmq.auth.load_certificate(keys / f"{name}.key_secret")
        assert secret is not None and zmq.auth.load_certificate(keys / f"{name}.key")[0] == public
        assert stat.S_IMODE((keys / f"{name}.key_secret").stat().st_mode) == 0o600
    loaded = client_keys(keys)
    assert loaded.server == zmq.auth.load_certificate(keys / "engine.key")[0]


def test_tandem_keys_never_overwrites(keys: Path) -> None:
    before = (keys / "engine.key_secret").read_bytes()
    assert tandem(["keys", str(keys)]) == 1
    assert (keys / "engine.key_secret").read_bytes() == before


def test_a_missing_key_file_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(CurveKeyError, match="frontend.key_secret not found.*tandem keys"):
        client_keys(tmp_path)


def reaches(router: zmq.Socket, address: str, curve: ClientKeys | None,
            after_refusal: bool = False) -> bool:
    """Whether a DEALER with `curve` gets a frame through to `router`, bound at `address`.
    `after_refusal`: send only once the server has refused the handshake (a ZAP denial).

    The send is bounded: a refused handshake tears down the DEALER's only pipe, and a send
    after that (this thread preempted past the refusal, as on a loaded machine) would block
    forever. Refused before the send or after it, nothing arrives."""
    ctx = zmq.Context.instance()
    with ctx.socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.SNDTIMEO, REFUSED_WITHIN_MS)
        if curve is not None:
            secure_client(dealer, curve)
        monitor = dealer.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            dealer.connect(address)
            if after_refusal:  # the refusal, then the connection dropped, then its pipe
                assert monitor.poll(5000), "the server did not refuse the handshake"
                time.sleep(0.1)  # (the pipe goes on libzmq's thread, just after the event)
            try:
                dealer.send(b"hello")
            except zmq.Again:  # no pipe left: the handshake was refused already
                return False
        finally:
            dealer.disable_monitor()
            monitor.close()
        return bool(router.poll(REFUSED_WITHIN_MS)) and router.recv_multipart()[1] == b"hello"


def test_the_server_admits_only_listed_keypairs(keys: Path, tmp_path: Path) -> None:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    auth = secure_server(ctx, router, keys)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    try:
        good = client_keys(keys)
        stranger_public, stranger_secret = zmq.curve_keypair()
        assert not reaches(router, address, None)
        stranger = ClientKeys(stranger_public, stranger_secret, good.server)
        assert not reaches(router, address, stranger)
        assert not reaches(router, address, stranger, after_refusal=True)
        assert not reaches(router, address, ClientKeys(good.public, good.secret,
                                                       stranger_public))
        assert reaches(router, address, good)
    finally:
        auth.stop()
        router.close()
        ctx.term()


@pytest.mark.parametrize(("address", "warns"), [
    ("tcp://0.0.0.0:5570", True), ("tcp://10.1.2.3:5570", True), ("tcp://gpu-host:5570", True),
    ("tcp://127.0.0.1:5570", False), ("tcp://localhost:5570", False), ("tcp://[::1]:5570", False),
    ("ipc:///tmp/engine.sock", False)])
def test_an_open_tcp_address_without_keys_warns(address: str, warns: bool,
                                               caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="shared.curve"):
        warn_if_open(address)
    assert ("--curve-keys" in caplog.text) == warns


@pytest.mark.parametrize(("address", "keys", "allowed", "refused"), [
    ("tcp://0.0.0.0:5570", None, False, True), ("tcp://10.1.2.3:5570", None, False, True),
    ("tcp://gpu-host:5570", None, False, True), ("tcp://[::]:5570", None, False, True),
    ("tcp://0.0.0.0:5570", "/keys", False, False), ("tcp://0.0.0.0:5570", None, True, False),
    ("tcp://127.0.0.1:5570", None, False, False), ("tcp://localhost:5570", None, False, False),
    ("tcp://[::1]:5570", None, False, False), ("ipc:///tmp/engine.sock", None, False, False)])
def test_an_open_engine_address_without_keys_is_refused(address: str, keys: str | None,
                                                        allowed: bool, refused: bool) -> None:
    refusal = open_engine_refusal(address, keys, allowed)
    assert (refusal is not None) == refused
    if refusal is not None:
        assert address in refusal
        for way in ("tandem keys DIR", "--curve-keys", "--allow-unauthenticated-engine"):
            assert way in refusal
