"""Start `tandem serve` (the real launcher, engine and frontends) for end-to-end tests."""

from __future__ import annotations

import queue
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`tandem serve MODEL` on a free port; ready once the launcher prints that it serves."""

    def __init__(self, model: Path, workdir: Path, *flags: str, api_key: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.engine_address = f"ipc://{workdir}/engine-{self.port}.sock"
        cmd = [sys.executable, "-m", "frontend.cli", "serve", str(model), "--port", str(self.port),
               "--engine-address", self.engine_address, "--num-threads", "1",
               "--served-model-name", "m", "--log-level", "warning", *flags]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            sys.stdout.write(line)
            self._lines.put(line)
        self._lines.put(None)

    def wait_healthy(self, timeout_s: float = 120.0) -> Server:
        while True:
            try:
                line = self._lines.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError("tandem serve did not start serving") from None
            if line is None:
                raise RuntimeError(f"tandem serve exited with {self.proc.wait()}")
            if line.startswith("tandem: serving"):
                return self

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout_s)
