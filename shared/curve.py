"""CURVE authentication of the engine socket: who may talk to the engine over tcp://.

A key folder (`tandem keys DIR`) holds two keypairs in `zmq.auth.create_certificates` format:
`engine.key` / `engine.key_secret` and `frontend.key` / `frontend.key_secret`. The engine
needs its secret key and accepts only clients whose public key is one of the `*.key` files in
the folder (checked by a ZAP authenticator thread), so a frontend host gets `engine.key` plus
`frontend.key_secret`, and another frontend keypair is allowed by dropping its `.key` there.
Traffic is encrypted as well. Over ipc:// (the default of `tandem serve`) the socket file's
permissions guard the engine and no keys are needed.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)
ENGINE = "engine"
FRONTEND = "frontend"


class CurveKeyError(ValueError):
    """A key folder that cannot be used; the message says what to do."""


@dataclass(frozen=True)
class ClientKeys:
    """What a frontend (or the launcher) needs: its own keypair and the engine's public key."""

    public: bytes
    secret: bytes
    server: bytes


def create_keys(folder: str | os.PathLike[str]) -> list[Path]:
    """Write the engine and frontend keypairs into `folder`; refuse to overwrite keys."""
    path = Path(folder)
    names = [path / f"{name}{suffix}" for name in (ENGINE, FRONTEND)
             for suffix in (".key", ".key_secret")]
    taken = [str(p) for p in names if p.exists()]
    if taken:
        raise CurveKeyError(f"{', '.join(taken)} already exist; remove them or pick another folder")
    path.mkdir(parents=True, exist_ok=True)
    for name in (ENGINE, FRONTEND):
        _, secret = zmq.auth.create_certificates(path, name)
        os.chmod(secret, 0o600)
    return names


def client_keys(folder: str | os.PathLike[str]) -> ClientKeys:
    """The frontend side of `folder`: `frontend.key_secret` and `engine.key`."""
    public, secret = _load(folder, FRONTEND + ".key_secret")
    server, _ = _load(folder, ENGINE + ".key")
    assert secret is not None  # a .key_secret file holds both keys
    return ClientKeys(public, secret, server)


def secure_client(sock: zmq.Socket, keys: ClientKeys) -> None:  # type: ignore[type-arg]
    """Make `sock` (before connect) a CURVE client of the engine."""
    sock.curve_publickey = keys.public
    sock.curve_secretkey = keys.secret
    sock.curve_serverkey = keys.server


def server_keys(folder: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """The engine's keypair from `folder`, once it is known that some client key is there."""
    public, secret = _load(folder, ENGINE + ".key_secret")
    assert secret is not None
    if not set(zmq.auth.load_certificates(str(folder))) - {public}:
        raise CurveKeyError(f"--curve-keys {folder}: no client public key (*.key besides "
                            "engine.key), so no frontend could connect; copy frontend.key there")
    return public, secret


def secure_server(ctx: zmq.Context, sock: zmq.Socket,  # type: ignore[type-arg]
                  folder: str | os.PathLike[str]) -> ThreadAuthenticator:
    """Make `sock` (before bind) a CURVE server that admits only the public keys in `folder`.
    Returns the running authenticator (a daemon thread; stop it to close it early)."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(folder))
    serve_curve(sock, folder)
    return auth


def serve_curve(sock: zmq.Socket, folder: str | os.PathLike[str]) -> None:  # type: ignore[type-arg]
    """Make another socket of a context that `secure_server` already guards (before bind) a
    CURVE server with the engine's keys: the same authenticator admits its clients."""
    public, secret = server_keys(folder)
    sock.curve_server = True
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def beyond_loopback(address: str) -> bool:
    """Whether `address` is tcp:// on other than a loopback host (an interface or host name
    counts as beyond: it is not provably local)."""
    if not address.startswith("tcp://"):
        return False
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    try:
        return not (host == "localhost" or ipaddress.ip_address(host).is_loopback)
    except ValueError:
        return True


def open_engine_refusal(address: str, curve_keys: str | None, allowed: bool) -> str | None:
    """The start-up error for an engine socket anyone who reaches it could use (tcp:// beyond
    loopback, no keys), unless `allowed` (--allow-unauthenticated-engine); else None. As in
    Redis's protected mode: such a peer could run requests past --api-key, read stats and
    flush the prefix cache."""
    if curve_keys is not None or allowed or not beyond_loopback(address):
        return None
    return (f"the engine would listen on {address} without keys: anyone who reaches that port "
            "could run requests past --api-key, read stats and flush the prefix cache. Make "
            "keys with `tandem keys DIR` and pass --curve-keys DIR to the engine and its "
            "frontends, or pass --allow-unauthenticated-engine on a network you trust")


def warn_if_open(address: str) -> None:
    """Log a warning when `address` is tcp:// beyond loopback (and no keys): allowed on purpose
    (--allow-unauthenticated-engine), or an engine started without its command line."""
    if beyond_loopback(address):
        log.warning("the engine listens on %s without --curve-keys: anyone who reaches that "
                    "port can run requests, read stats and reset the cache; make keys with "
                    "`tandem keys DIR` and pass --curve-keys DIR to the engine and its "
                    "frontends", address)


def _load(folder: str | os.PathLike[str], name: str) -> tuple[bytes, bytes | None]:
    path = Path(folder) / name
    if not path.is_file():
        raise CurveKeyError(f"--curve-keys {folder}: {name} not found (make keys with "
                            f"`tandem keys DIR` and copy the files this side needs)")
    try:
        return zmq.auth.load_certificate(path)
    except (ValueError, OSError) as exc:
        raise CurveKeyError(f"--curve-keys {folder}: {name} is not a key file: {exc}") from None
