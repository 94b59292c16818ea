"""Protected mode: an engine socket that anyone reaching the port could use refuses to start.

As Redis does without a password: `tcp://` beyond loopback without CURVE keys is a start-up
error naming the ways out (`tandem keys DIR` + `--curve-keys`, or
`--allow-unauthenticated-engine`), for `tandem engine` and for `tandem serve --engine-address`;
loopback and ipc:// are as they were. The refusal comes before the model loads.
"""

from __future__ import annotations

import subprocess
import sys
import time

from tests.e2e.engine_proc import EngineConn
from tests.e2e.server import free_port

TANDEM = [sys.executable, "-m", "frontend.cli"]
WAYS_OUT = ("tandem keys DIR", "--curve-keys", "--allow-unauthenticated-engine")


def _refused(cmd: list[str]) -> str:
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert time.monotonic() - start < 30, "refused only after loading the model"
    for way in WAYS_OUT:
        assert way in done.stderr, done.stderr
    return done.stderr


def test_engine_on_every_interface_without_keys_refuses_to_start(tiny_llama):
    stderr = _refused([*TANDEM, "engine", str(tiny_llama), "--listen",
                       f"tcp://0.0.0.0:{free_port()}"])
    assert "0.0.0.0" in stderr


def test_serve_with_an_open_engine_address_refuses_to_start(tiny_llama):
    _refused([*TANDEM, "serve", str(tiny_llama), "--port", str(free_port()),
              "--engine-address", f"tcp://0.0.0.0:{free_port()}"])


def test_allowed_on_purpose_it_starts_and_warns(tiny_llama):
    port = free_port()
    proc = subprocess.Popen([*TANDEM, "engine", str(tiny_llama), "--listen", f"tcp://0.0.0.0:{port}",
                             "--allow-unauthenticated-engine", "--num-threads", "1",
                             "--log-level", "warning"], stderr=subprocess.PIPE, text=True)
    try:
        conn = EngineConn(f"tcp://127.0.0.1:{port}", timeout_s=120)
        assert conn.hello().model
        conn.close()
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=30)
    assert "without --curve-keys" in stderr, stderr
