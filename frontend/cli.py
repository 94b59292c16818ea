"""The `tandem` command: serve (engine + N frontends on one port), engine, frontend, bench.

The launcher knows both halves only as command lines: it starts `python -m engine_core` and
`python -m frontend.server` as child processes and never imports the engine (or torch).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time

import zmq

from shared.engine_args import add_engine_args, engine_argv
from shared.messages import Hello, Ready
from shared.transport import InputCodec, OutputCodec, configure, new_identity

ENGINE_DEATH_NOTICE_S = 2.5
SERVE_HELP = """Serve MODEL over the OpenAI API: one engine process and --api-server-count
frontend processes sharing one port. Without MODEL, the embedded tiny Llama (built offline on
first use into $TANDEM_CACHE or ~/.cache/tandem)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="Tandem: an OpenAI-compatible LLM server."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="engine + frontends on one port", description=SERVE_HELP)
    serve.add_argument("model", nargs="?", default=None,
                       help="model folder or hub id (default: embedded tiny Llama)")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port shared by every frontend")
    serve.add_argument("--api-server-count", type=int, default=1,
                       help="number of frontend processes")
    serve.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1/* "
                            "(default: $TANDEM_API_KEY)")
    serve.add_argument("--engine-address", default=None,
                       help="ZeroMQ address for the engine "
                            "(default: an ipc:// socket in a temp folder)")
    serve.add_argument("--shutdown-grace", type=float, default=30.0,
                       help="seconds in-flight requests get to finish on SIGINT/SIGTERM")
    serve.add_argument("--ready-timeout", type=float, default=900.0,
                       help="seconds to wait for the engine to load the model")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_engine_args(serve)
    sub.add_parser("engine", help="run the engine core alone (see `tandem engine --help`)",
                   add_help=False)
    sub.add_parser("frontend",
                   help="run one frontend against an engine (see `tandem frontend --help`)",
                   add_help=False)
    sub.add_parser("bench", help="benchmarks (see `tandem bench serve --help`)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("engine", "frontend", "bench"):
        module = {"engine": "engine_core", "frontend": "frontend.server",
                  "bench": "frontend.bench"}[argv[0]]
        os.execv(sys.executable, [sys.executable, "-m", module, *argv[1:]])
    args = build_parser().parse_args(argv)
    return Launcher(args).run()


class Launcher:
    """Starts the children, waits for the engine's READY, supervises, shuts down."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = tempfile.TemporaryDirectory(prefix="tandem-")
        self.address = args.engine_address or f"ipc://{self.tmp.name}/engine.sock"
        self.engine: subprocess.Popen[bytes] | None = None
        self.frontends: list[subprocess.Popen[bytes]] = []
        self.stop_signal: int | None = None
        self.grace = args.shutdown_grace + 5  # frontends' own grace, plus their teardown

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            self.engine = self._start_engine()
            ready = self._wait_ready()
            if ready is None:
                return 1
            self.frontends = [self._start_frontend(i) for i in range(self.args.api_server_count)]
            if not self._wait_frontends():
                return 1
            print(f"tandem: serving {ready.model!r} on http://{self.args.host}:{self.args.port} "
                  f"({self.args.api_server_count} frontend(s), engine pid {self.engine.pid})",
                  flush=True)
            return self._supervise()
        finally:
            self._stop_all()
            self.tmp.cleanup()

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stop_signal = signum

    def _start_engine(self) -> subprocess.Popen[bytes]:
        args = self.args
        if args.num_threads is None:
            # Torch threads collapse when another process takes their core (measured: 2 threads
            # with a busy frontend ran 2.4x slower than 1), so leave the frontends theirs.
            args.num_threads = max(1, (os.cpu_count() or 1) - args.api_server_count)
        cmd = [sys.executable, "-m", "engine_core", *([args.model] if args.model else []),
               "--listen", self.address, "--log-level", args.log_level, *engine_argv(args)]
        return subprocess.Popen(cmd, preexec_fn=_child_setup)

    def _ready_file(self, i: int) -> str:
        return os.path.join(self.tmp.name, f"frontend-{i}.ready")

    def _start_frontend(self, i: int) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "frontend.server", "--engine", self.address,
               "--ready-file", self._ready_file(i),
               "--host", self.args.host, "--port", str(self.args.port), "--reuse-port",
               "--shutdown-grace", str(self.args.shutdown_grace),
               "--log-level", self.args.log_level]
        env = dict(os.environ)
        if self.args.api_key:
            env["TANDEM_API_KEY"] = self.args.api_key  # not on the command line, where ps shows it
        return subprocess.Popen(cmd, env=env, preexec_fn=_child_setup)

    def _wait_ready(self) -> Ready | None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        configure(sock)
        sock.setsockopt(zmq.IDENTITY, new_identity("launcher"))
        sock.connect(self.address)
        sock.send(InputCodec().encode(Hello("launcher")))
        deadline = time.monotonic() + self.args.ready_timeout
        try:
            while time.monotonic() < deadline and self.stop_signal is None:
                assert self.engine is not None
                if self.engine.poll() is not None:
                    print(f"tandem: the engine exited with code {self.engine.returncode} "
                          "before it was ready (see its log above)", file=sys.stderr)
                    return None
                if sock.poll(200):
                    msg = OutputCodec().decode(sock.recv())
                    if isinstance(msg, Ready):
                        return msg
            if self.stop_signal is None:
                print(f"tandem: the engine was not ready after {self.args.ready_timeout:.0f} s",
                      file=sys.stderr)
            return None
        finally:
            sock.close()
            ctx.term()

    def _wait_frontends(self, timeout_s: float = 120.0) -> bool:
        """Until every frontend listens, so the first client may reach any of them."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.stop_signal is None:
            if self._dead_child() is not None:
                return False
            if all(os.path.exists(self._ready_file(i)) for i in range(len(self.frontends))):
                return True
            time.sleep(0.05)
        return False

    def _dead_child(self) -> subprocess.Popen[bytes] | None:
        for proc in [self.engine, *self.frontends]:
            if proc is not None and proc.poll() is not None:
                role = "engine" if proc is self.engine else "frontend"
                print(f"tandem: the {role} process {proc.pid} exited with code {proc.returncode}; "
                      "stopping everything", file=sys.stderr)
                return proc
        return None

    def _supervise(self) -> int:
        while self.stop_signal is None:
            dead = self._dead_child()
            if dead is self.engine:
                # Frontends notice within 2 s: they fail in-flight requests and turn /health to
                # 503, so clients and probes see why. Then everything stops (exit within 5 s).
                time.sleep(ENGINE_DEATH_NOTICE_S)
                self.grace = 1.0  # nothing left in flight; SIGKILL after that
            if dead is not None:
                return 1
            time.sleep(0.1)
        return 0

    def _stop_all(self) -> None:
        """Frontends first (they drain in-flight requests within the grace period), then the
        engine."""
        _terminate(self.frontends, self.grace)
        _terminate([self.engine] if self.engine else [], 10)


def _child_setup() -> None:
    """In the child: leave the terminal's process group (Ctrl-C reaches only the launcher, which
    shuts down in order) and die with the launcher even if it is SIGKILLed (no orphans)."""
    os.setpgrp()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def _terminate(procs: list[subprocess.Popen[bytes]], grace: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


if __name__ == "__main__":
    sys.exit(main())
