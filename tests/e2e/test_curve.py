"""The engine's tcp:// socket under CURVE: `tandem serve --curve-keys` serves as usual, and a
raw DEALER without the keys (or with others) gets nothing, while the engine keeps serving."""

from __future__ import annotations

import openai
import pytest
import zmq

from frontend.cli import main as tandem
from shared.curve import ClientKeys, client_keys
from tests.e2e.engine_proc import EngineConn
from tests.e2e.server import Server, free_port


@pytest.fixture(scope="module")
def keyed_server(tiny_llama, tmp_path_factory):
    keys = tmp_path_factory.mktemp("curve") / "keys"
    assert tandem(["keys", str(keys)]) == 0
    address = f"tcp://127.0.0.1:{free_port()}"
    srv = Server(tiny_llama, keys.parent, "--engine-address", address, "--curve-keys", str(keys),
                 "--max-model-len", "256", "--num-kv-blocks", "64").wait_healthy()
    yield srv, address, client_keys(keys)
    assert srv.stop() == 0


def complete(srv: Server) -> str:
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=60)
    out = client.completions.create(model="m", prompt="Hello", max_tokens=4, temperature=0)
    return out.choices[0].text


def answered(address: str, curve: ClientKeys | None) -> bool:
    conn = EngineConn(address, timeout_s=1.0, curve=curve)
    try:
        conn.hello()
        conn.stats()
        return True
    except TimeoutError:
        return False
    finally:
        conn.close()


def test_strangers_get_nothing_and_keyed_frontends_are_served(keyed_server):
    srv, address, keys = keyed_server
    first = complete(srv)
    assert first
    public, secret = zmq.curve_keypair()
    assert not answered(address, None)  # no CURVE at all
    assert not answered(address, ClientKeys(public, secret, keys.server))  # an unlisted keypair
    assert answered(address, keys)
    assert complete(srv) == first  # the engine kept serving through it
