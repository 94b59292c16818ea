"""Start `tandem serve` (the real launcher, engine and frontends) for end-to-end tests."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import urllib.error
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, model: Path, workdir: Path, *flags: str, api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine_address = f"ipc://{workdir}/engine-{self.port}.sock"
        cmd = [sys.executable, "-m", "frontend.cli", "serve", str(model), "--port", str(self.port),
               "--engine-address", self.engine_address, "--num-threads", "1",
               "--log-level", "warning", *flags]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def wait_healthy(self, timeout_s: float = 120.0) -> "Server":
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"tandem serve exited with {self.proc.returncode}"
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1.0) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise TimeoutError("tandem serve did not become healthy")

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)
