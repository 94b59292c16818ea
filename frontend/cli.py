"""The `tandem` command: serve (engines + N frontends on one port), engine, frontend, bench,
keys (CURVE keypairs for the engine socket).

The launcher knows both halves only as command lines: it starts `python -m engine_core` and
`python -m frontend.server` as child processes and never imports the engine (or torch). With
`--data-parallel-size N` it starts N engines, each on its own GPU or share of the CPU cores
(frontend/placement.py), publishing KV-cache events that every frontend follows to route by
cache and load (frontend/engine/group.py).
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
from functools import partial

import msgspec
import zmq

from frontend.engine.routing import add_routing_args, routing_argv
from frontend.options import add_frontend_args, check_frontend_args, frontend_argv
from frontend.placement import EnginePlace, PlacementError, plan
from shared.argv import ConfigFileError, normalize
from shared.curve import (
    ClientKeys,
    CurveKeyError,
    client_keys,
    create_keys,
    open_engine_refusal,
    secure_client,
    server_keys,
)
from shared.engine_args import add_engine_args, check_engine_args, engine_argv
from shared.kv_events import KvEventsConfig, config_json, parse_kv_events_config, rank_endpoint
from shared.messages import Hello, Ready, StepProgress, UtilityRequest, UtilityResult
from shared.transport import InputCodec, OutputCodec, configure, is_stalled, new_identity

ENGINE_DEATH_NOTICE_S = 2.5
FRONTEND_RESTARTS = 5  # a frontend that dies this many times within the window stops the server
FRONTEND_RESTART_WINDOW_S = 60.0
FRONTEND_BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 4.0)  # wait before restart, by recent deaths
ENGINE_RESTARTS = 5  # data parallel: an engine dying this often within the window is given up
ENGINE_RESTART_WINDOW_S = 120.0
ENGINE_BACKOFF_S = (0.0, 1.0, 2.0, 4.0, 8.0)
WATCH_PING_S = 1.0
SERVE_HELP = """Serve MODEL over the OpenAI API: one engine process (--data-parallel-size of
them) and --api-server-count frontend processes sharing one port. Without MODEL, the embedded
tiny Llama (built offline on first use into $TANDEM_CACHE or ~/.cache/tandem)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="Tandem: an OpenAI-compatible LLM server."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="engine + frontends on one port", description=SERVE_HELP)
    serve.add_argument("model", nargs="?", default=None,
                       help="model folder or hub id (default: embedded tiny Llama)")
    serve.add_argument("--host", default=os.environ.get("TANDEM_HOST", "127.0.0.1"),
                       help="address to listen on (default: $TANDEM_HOST, else 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="HTTP port shared by every frontend")
    serve.add_argument("--api-server-count", type=int, default=1,
                       help="number of frontend processes")
    serve.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                       help="number of engines, each with its own KV cache (one GPU each on "
                            "CUDA, a share of the CPU cores on the CPU); every frontend routes "
                            "to all of them")
    serve.add_argument("--api-key", default=os.environ.get("TANDEM_API_KEY"),
                       help="require 'Authorization: Bearer KEY' on /v1/* "
                            "(default: $TANDEM_API_KEY)")
    serve.add_argument("--engine-address", default=None,
                       help="ZeroMQ address for the engine "
                            "(default: an ipc:// socket in a temp folder)")
    serve.add_argument("--curve-keys", default=os.environ.get("TANDEM_CURVE_KEYS"),
                       help="folder from `tandem keys`: the engine admits only CURVE clients "
                            "holding its keys (for a tcp:// --engine-address; default: "
                            "$TANDEM_CURVE_KEYS)")
    serve.add_argument("--allow-unauthenticated-engine", action="store_true",
                       help="let a tcp:// --engine-address beyond loopback go without "
                            "--curve-keys (refused otherwise): only on a network you trust")
    serve.add_argument("--shutdown-grace", type=float, default=30.0,
                       help="seconds in-flight requests get to finish on SIGINT/SIGTERM")
    serve.add_argument("--ready-timeout", type=float, default=900.0,
                       help="seconds to wait for the engine to load the model")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_frontend_args(serve)
    add_routing_args(serve)
    add_engine_args(serve)
    sub.add_parser("engine", help="run the engine core alone (see `tandem engine --help`)",
                   add_help=False)
    sub.add_parser("frontend",
                   help="run one frontend against an engine (see `tandem frontend --help`)",
                   add_help=False)
    sub.add_parser("bench", help="benchmarks (see `tandem bench serve --help`)", add_help=False)
    keys = sub.add_parser("keys", help="write engine and frontend CURVE keypairs into DIR",
                          description="Write engine.key(_secret) and frontend.key(_secret) "
                                      "for --curve-keys into DIR (created if missing).")
    keys.add_argument("dir", help="folder for the key files")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("engine", "frontend", "bench"):
        module = {"engine": "engine_core", "frontend": "frontend.server",
                  "bench": "frontend.bench"}[argv[0]]
        os.execv(sys.executable, [sys.executable, "-m", module, *argv[1:]])
    parser = build_parser()
    try:
        # vLLM's command lines: --config FILE, --flag_name (after the subcommand)
        argv = argv[:1] + normalize(argv[1:], parser)
    except ConfigFileError as exc:
        parser.error(str(exc))
    args = parser.parse_args(argv)
    if args.command == "keys":
        return write_keys(args.dir)
    check_frontend_args(parser, args)
    problem = check_engine_args(args) or open_engine_refusal(
        args.engine_address or "", args.curve_keys, args.allow_unauthenticated_engine)
    if problem is not None:
        parser.error(problem)
    if args.api_server_count < 1:
        parser.error(f"--api-server-count {args.api_server_count}: at least 1")
    try:  # both halves read the same folder here; a wrong one fails before the model loads
        curve = None if args.curve_keys is None else client_keys(args.curve_keys)
        if args.curve_keys is not None:
            server_keys(args.curve_keys)
    except CurveKeyError as exc:
        parser.error(str(exc))
    try:
        launcher = Launcher(args, curve)
    except PlacementError as exc:
        parser.error(str(exc))
    return launcher.run()


def write_keys(folder: str) -> int:
    try:
        files = create_keys(folder)
    except (CurveKeyError, OSError) as exc:
        print(f"tandem keys: {exc}", file=sys.stderr)
        return 1
    print("tandem keys: wrote " + ", ".join(str(f) for f in files) + "\n"
          "The engine's host needs engine.key_secret and frontend.key; each frontend's host "
          "needs frontend.key_secret and engine.key. Pass --curve-keys to both.")
    return 0


class Launcher:
    """Starts the children, waits for the engines' READY, supervises, shuts down.

    Supervision: with one engine, a dead engine, or one whose step loop is stuck (`EngineWatch`,
    then killed), stops everything, since every request lived there. With several (data
    parallel), such an engine is replaced while the others serve (its requests fail, the
    frontends route around it until the new one answers); one that keeps dying is given up,
    and only when every engine is given up does the server stop. A dead frontend is replaced
    (after a backoff that grows with its recent deaths) while the others keep serving the port;
    only one that keeps dying stops the server."""

    def __init__(self, args: argparse.Namespace, curve: ClientKeys | None = None) -> None:
        self.args = args
        self.curve = curve  # the launcher's own sockets connect as a frontend does
        self.tmp = tempfile.TemporaryDirectory(prefix="tandem-")
        base = args.engine_address or f"ipc://{self.tmp.name}/engine.sock"
        try:
            self.places: list[EnginePlace] = plan(args.data_parallel_size, base, args.device,
                                                 tensor_parallel=args.tensor_parallel_size)
        except PlacementError:
            self.tmp.cleanup()
            raise
        self.engine_args = self._engine_args()
        self.engines: list[subprocess.Popen[bytes] | None] = [None] * len(self.places)
        self.frontends: list[subprocess.Popen[bytes]] = []
        self.deaths: list[float] = []  # when frontends died, for the restart budget
        self.restart_at: dict[int, float] = {}  # frontend slot -> when to start it again
        self.engine_deaths: dict[int, list[float]] = {p.rank: [] for p in self.places}
        self.engine_restart_at: dict[int, float] = {}  # rank -> when to start it again
        self.given_up: set[int] = set()  # ranks that kept dying
        self.stop_signal: int | None = None
        self.grace = args.shutdown_grace + 5  # frontends' own grace, plus their teardown

    @property
    def address(self) -> str:
        """Engine 0's address (the only one without data parallelism)."""
        return self.places[0].address

    def _engine_args(self) -> argparse.Namespace:
        """The engines' flags; several engines publish KV-cache events for the frontends'
        router (on ipc:// in the launcher's folder, unless --kv-events-config says where)."""
        engine_args = argparse.Namespace(**vars(self.args))
        own = (None if self.args.kv_events_config is None
               else parse_kv_events_config(self.args.kv_events_config))
        if own is not None and own.enabled:
            _check_event_ports(own, len(self.places))
        if len(self.places) > 1 and (own is None or not own.enabled):
            folder = self.tmp.name
            engine_args.kv_events_config = config_json(msgspec.structs.replace(
                own or parse_kv_events_config("{}"), enable_kv_cache_events=True,
                publisher="zmq", endpoint=f"ipc://{folder}/kv-events",
                replay_endpoint=f"ipc://{folder}/kv-replay"))
        return engine_args

    def run(self) -> int:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            self.engines = [self._start_engine(p) for p in self.places]
            ready = self._wait_ready()
            if ready is None:
                return 1
            self.frontends = [self._start_frontend(i) for i in range(self.args.api_server_count)]
            if not self._wait_frontends():
                return 1
            scheme = "https" if self.args.ssl_certfile else "http"
            where = f"{scheme}://{self.args.host}:{self.args.port}"
            pids = ", ".join(str(e.pid) for e in self.engines if e is not None)
            engines = (f"engine pid {pids}" if len(self.places) == 1
                       else f"{len(self.places)} engines, pids {pids}")
            print(f"tandem: serving {ready.model!r} on {where} "
                  f"({self.args.api_server_count} frontend(s), {engines})", flush=True)
            return self._supervise()
        finally:
            self._stop_all()
            self.tmp.cleanup()

    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stop_signal = signum

    def _start_engine(self, place: EnginePlace) -> subprocess.Popen[bytes]:
        args = self.args
        # Without --num-threads the engine picks each step's torch threads by measurement
        # (engine_core/worker/threads.py): all cores for the steps they speed up, one fewer for the
        # steps that a busy frontend would stall. A data-parallel engine's cores are its share.
        cmd = [sys.executable, "-m", "engine_core", *([args.model] if args.model else []),
               "--listen", place.address, "--log-level", args.log_level,
               *engine_argv(self.engine_args), *_curve_argv(args),
               *(["--allow-unauthenticated-engine"] if args.allow_unauthenticated_engine else [])]
        if len(self.places) > 1:
            cmd += ["--data-parallel-rank", str(place.rank)]
        env = dict(os.environ)
        if place.cuda_device is not None:
            env["CUDA_VISIBLE_DEVICES"] = place.cuda_device
        return subprocess.Popen(cmd, env=env, preexec_fn=partial(_child_setup, place.cpus))

    def _ready_file(self, i: int) -> str:
        return os.path.join(self.tmp.name, f"frontend-{i}.ready")

    def _start_frontend(self, i: int) -> subprocess.Popen[bytes]:
        engines = [arg for p in self.places for arg in ("--engine", p.address)]
        cmd = [sys.executable, "-m", "frontend.server", *engines,
               "--ready-file", self._ready_file(i),
               "--host", self.args.host, "--port", str(self.args.port), "--reuse-port",
               "--shutdown-grace", str(self.args.shutdown_grace),
               "--log-level", self.args.log_level, *frontend_argv(self.args),
               *routing_argv(self.args), *_curve_argv(self.args)]
        env = dict(os.environ)
        if self.args.api_key:
            env["TANDEM_API_KEY"] = self.args.api_key  # not on the command line, where ps shows it
        return subprocess.Popen(cmd, env=env, preexec_fn=_child_setup)

    def _wait_ready(self) -> Ready | None:
        """Every engine's READY (the first one's model facts), or None when one exits first,
        the wait times out or a signal came."""
        ctx = zmq.Context()
        socks = {}
        for place in self.places:
            sock = ctx.socket(zmq.DEALER)
            configure(sock)
            sock.setsockopt(zmq.IDENTITY, new_identity("launcher"))
            if self.curve is not None:
                secure_client(sock, self.curve)
            sock.connect(place.address)
            sock.send(InputCodec().encode(Hello("launcher")))
            socks[place.rank] = sock
        ready: dict[int, Ready] = {}
        deadline = time.monotonic() + self.args.ready_timeout
        try:
            while time.monotonic() < deadline and self.stop_signal is None:
                for rank, proc in enumerate(self.engines):
                    if proc is not None and proc.poll() is not None:
                        print(f"tandem: the engine{_rank_note(self.places, rank)} exited with "
                              f"code {proc.returncode} before it was ready (see its log above)",
                              file=sys.stderr)
                        return None
                for rank, sock in socks.items():
                    if rank not in ready and sock.poll(200 // len(socks)):
                        msg = OutputCodec().decode(sock.recv())
                        if isinstance(msg, Ready):
                            ready[rank] = msg
                if len(ready) == len(socks):
                    return ready[0]
            if self.stop_signal is None:
                print(f"tandem: the engine was not ready after {self.args.ready_timeout:.0f} s",
                      file=sys.stderr)
            return None
        finally:
            for sock in socks.values():
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
        for proc in [*self.engines, *self.frontends]:
            if proc is not None and proc.poll() is not None:
                role = "frontend" if proc in self.frontends else "engine"
                print(f"tandem: the {role} process {proc.pid} exited with code {proc.returncode}; "
                      "stopping everything", file=sys.stderr)
                return proc
        return None

    def _supervise(self) -> int:
        watches = {p.rank: EngineWatch(p.address, self.curve) for p in self.places}
        try:
            while self.stop_signal is None:
                for rank, proc in enumerate(self.engines):
                    if proc is None:
                        continue
                    if proc.poll() is not None or self._engine_stuck(rank, watches[rank]):
                        if len(self.places) == 1:
                            return self._engine_died()
                        if not self._engine_lost(rank):
                            return 1
                for rank in self._engines_due():
                    watches[rank].close()
                    watches[rank] = EngineWatch(self.places[rank].address, self.curve)
                    self.engines[rank] = self._start_engine(self.places[rank])
                if not self._tend_frontends():
                    return 1
                time.sleep(0.1)
        finally:
            for watch in watches.values():
                watch.close()
        return 0

    def _engine_stuck(self, rank: int, watch: EngineWatch) -> bool:
        progress = watch.progress()
        proc = self.engines[rank]
        if progress is None or not is_stalled(progress) or proc is None:
            return False
        print(f"tandem: the step loop of engine{_rank_note(self.places, rank)} has finished no "
              f"step for {progress.since_step_s:.0f} s while it has work; killing it",
              file=sys.stderr)
        proc.kill()
        proc.wait()
        return True

    def _engine_died(self) -> int:
        engine = self.engines[0]
        assert engine is not None
        print(f"tandem: the engine process {engine.pid} exited with code "
              f"{engine.returncode}; stopping everything", file=sys.stderr)
        # Frontends notice within 2 s: they fail in-flight requests and turn /health to 503, so
        # clients and probes see why. Then everything stops (exit within 5 s).
        time.sleep(ENGINE_DEATH_NOTICE_S)
        self.grace = 1.0  # nothing left in flight; SIGKILL after that
        return 1

    def _engine_lost(self, rank: int) -> bool:
        """Data parallel: schedule a new engine for `rank`, or give the rank up when it keeps
        dying; False when every rank is given up (the server stops)."""
        proc = self.engines[rank]
        assert proc is not None
        self.engines[rank] = None
        now = time.monotonic()
        deaths = [t for t in self.engine_deaths[rank] if now - t < ENGINE_RESTART_WINDOW_S]
        deaths.append(now)
        self.engine_deaths[rank] = deaths
        if len(deaths) >= ENGINE_RESTARTS:
            self.given_up.add(rank)
            print(f"tandem: engine {rank} died {len(deaths)} times within "
                  f"{ENGINE_RESTART_WINDOW_S:.0f} s; not starting it again", file=sys.stderr)
            if len(self.given_up) == len(self.places):
                print("tandem: every engine keeps dying; stopping everything", file=sys.stderr)
                return False
            return True
        delay = ENGINE_BACKOFF_S[min(len(deaths), len(ENGINE_BACKOFF_S)) - 1]
        print(f"tandem: engine {rank} (process {proc.pid}) exited with code {proc.returncode}; "
              f"starting a new one in {delay:g} s (the other engines keep serving)",
              file=sys.stderr)
        self.engine_restart_at[rank] = now + delay
        return True

    def _engines_due(self) -> list[int]:
        now = time.monotonic()
        due = [rank for rank, at in self.engine_restart_at.items() if now >= at]
        for rank in due:
            del self.engine_restart_at[rank]
        return due

    def _tend_frontends(self) -> bool:
        """Schedule a dead frontend's replacement, start those due; False when one keeps dying."""
        now = time.monotonic()
        for i, proc in enumerate(self.frontends):
            if i in self.restart_at or proc.poll() is None:
                continue
            self.deaths = [t for t in self.deaths if now - t < FRONTEND_RESTART_WINDOW_S]
            self.deaths.append(now)
            if len(self.deaths) >= FRONTEND_RESTARTS:
                print(f"tandem: frontends died {len(self.deaths)} times within "
                      f"{FRONTEND_RESTART_WINDOW_S:.0f} s; stopping everything", file=sys.stderr)
                return False
            delay = FRONTEND_BACKOFF_S[min(len(self.deaths), len(FRONTEND_BACKOFF_S)) - 1]
            print(f"tandem: frontend {proc.pid} exited with code {proc.returncode}; starting a "
                  f"new one in {delay:g} s (the others keep serving)", file=sys.stderr)
            self.restart_at[i] = now + delay
        for i, due in list(self.restart_at.items()):
            if now >= due:
                del self.restart_at[i]
                self.frontends[i] = self._start_frontend(i)
        return True

    def _stop_all(self) -> None:
        """Frontends first (they drain in-flight requests within the grace period), then the
        engines."""
        _terminate(self.frontends, self.grace)
        _terminate([e for e in self.engines if e is not None], 10)


class EngineWatch:
    """The launcher's own look at the engine's step loop: a ping a second on a DEALER, and the
    progress its answers carry (`None` until one came back). A stuck loop is restarted as a dead
    engine is; a silent engine is the frontends' to judge (they fail requests within 2 s)."""

    def __init__(self, address: str, curve: ClientKeys | None = None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        configure(self.sock)
        self.sock.setsockopt(zmq.IDENTITY, new_identity("launcher-watch"))
        if curve is not None:
            secure_client(self.sock, curve)
        self.sock.connect(address)
        self.codec, self.out = InputCodec(), OutputCodec()
        self.next_ping = 0.0
        self.last: StepProgress | None = None

    def __enter__(self) -> EngineWatch:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def progress(self) -> StepProgress | None:
        """The latest progress heard; pings when one is due. Never blocks."""
        while self.sock.poll(0):
            try:
                msg = self.out.decode(self.sock.recv())
            except msgspec.DecodeError:
                continue
            if isinstance(msg, UtilityResult) and msg.progress is not None:
                self.last = msg.progress
        now = time.monotonic()
        if now >= self.next_ping:
            self.next_ping = now + WATCH_PING_S
            self.sock.send(self.codec.encode(UtilityRequest(0, "ping")))
        return self.last


def _curve_argv(args: argparse.Namespace) -> list[str]:
    return [] if args.curve_keys is None else ["--curve-keys", args.curve_keys]


def _check_event_ports(config: KvEventsConfig, size: int) -> None:
    """Every rank's event and replay addresses (the ports plus the rank) must differ."""
    taken: dict[str, str] = {}
    for rank in range(size):
        for role, base in (("endpoint", config.endpoint), ("replay_endpoint",
                                                          config.replay_endpoint)):
            if base is None:
                continue
            address = rank_endpoint(base, rank)
            if address in taken:
                raise PlacementError(
                    f"--kv-events-config: rank {rank}'s {role} {address} is also "
                    f"{taken[address]}; each rank adds its rank to the ports, so put the replay "
                    f"port at least {size} above the endpoint's")
            taken[address] = f"rank {rank}'s {role}"


def _rank_note(places: list[EnginePlace], rank: int) -> str:
    return f" {rank}" if len(places) > 1 else ""


def _child_setup(cpus: tuple[int, ...] = ()) -> None:
    """In the child: leave the terminal's process group (Ctrl-C reaches only the launcher, which
    shuts down in order), die with the launcher even if it is SIGKILLed (no orphans), and keep
    to `cpus` when given (a data-parallel engine's share of the cores)."""
    os.setpgrp()
    if cpus:
        os.sched_setaffinity(0, cpus)
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
