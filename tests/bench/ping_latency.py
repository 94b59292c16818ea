"""The engine's ping latency, as a frontend's liveness sees it, through each first-use path.

    .venv/bin/python tests/bench/ping_latency.py [--busy 2] [--model tandem-tiny-llama]

Starts `python -m engine_core MODEL` on an ipc socket and pings it from a thread of its own
(one DEALER, the next ping 20 ms after each answer: the longest answer is the longest silence a
frontend pinging every 0.25 s would have seen, within a ping interval), while the main thread
walks the engine through its phases on a second DEALER: idle; the first request (the first
forward); the first constrained request (the grammar compiler built: xgrammar, the tokenizer,
its tokenizer table; then the first compile); a second schema (a compile alone); a prefix-cache
reset and stats; 16 streams of 64 tokens; idle again. `--busy N` keeps N busy-loop processes
(plain Python `while True`) running through it all: CPU contention on every core.

Prints p50, p99 and max of the ping's round trip per phase, and the phase's length. Beside the
pings, two `EngineLink`s (the frontend's heartbeat-only connection) are watched, one with the
frontend's settings (a ZMTP PING every 0.25 s, down after 1.0 s without an answer) and one
five times tighter (0.05 s, 0.2 s): how often each fell per phase.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from frontend.engine.link import EngineLink  # noqa: E402
from shared.messages import (  # noqa: E402
    AddRequest,
    Hello,
    Ready,
    SamplingParams,
    StepOutputs,
    StructuredOutput,
    UtilityRequest,
    UtilityResult,
    ints,
)
from shared.transport import InputCodec, OutputCodec, configure, new_identity  # noqa: E402

PING_GAP_S = 0.02
SCHEMA_A = {"type": "object", "required": ["answer", "sure"], "additionalProperties": False,
            "properties": {"answer": {"type": "integer"}, "sure": {"type": "boolean"}}}
SCHEMA_B = {"type": "object", "required": ["name", "tags"],
            "properties": {"name": {"type": "string", "maxLength": 20},
                           "tags": {"type": "array", "items": {"type": "string"}}}}


def spin() -> None:
    while True:
        pass


class Pinger(threading.Thread):
    """Pings the engine back to back (PING_GAP_S apart) and keeps (sent at, round trip)."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:  # type: ignore[type-arg]
        super().__init__(daemon=True)
        self.sock = ctx.socket(zmq.DEALER)
        configure(self.sock)
        self.sock.setsockopt(zmq.IDENTITY, new_identity("ping"))
        self.sock.connect(address)
        self.samples: list[tuple[float, float]] = []
        self.links = {"0.25/1.0 s": EngineLink(ctx, address, 0.25, 1.0),
                      "0.05/0.2 s": EngineLink(ctx, address, 0.05, 0.2)}
        self.drops: dict[str, list[float]] = {name: [] for name in self.links}
        self._was_up = dict.fromkeys(self.links, False)
        self.stopping = threading.Event()
        self.inp, self.out = InputCodec(), OutputCodec()

    def run(self) -> None:
        for call in itertools.count():
            if self.stopping.is_set():
                return
            sent = time.monotonic()
            self.sock.send(self.inp.encode(UtilityRequest(call, "ping")))
            self.look_at_links()
            while self.sock.poll(60_000):
                msg = self.out.decode(self.sock.recv())
                if isinstance(msg, UtilityResult) and msg.call_id == call:
                    self.samples.append((sent, time.monotonic() - sent))
                    break
            else:
                print("no ping answer for 60 s", file=sys.stderr)
                return
            self.look_at_links()
            time.sleep(PING_GAP_S)

    def look_at_links(self) -> None:
        for name, link in self.links.items():
            up = link.up
            if self._was_up[name] and not up:
                self.drops[name].append(time.monotonic())
            self._was_up[name] = up


class Driver:
    """The second DEALER: Hello, requests, utilities."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:  # type: ignore[type-arg]
        self.sock = ctx.socket(zmq.DEALER)
        configure(self.sock)
        self.sock.setsockopt(zmq.IDENTITY, new_identity("drive"))
        self.sock.connect(address)
        self.inp, self.out = InputCodec(), OutputCodec()
        self.calls = itertools.count()

    def send(self, msg) -> None:  # type: ignore[no-untyped-def]
        self.sock.send(self.inp.encode(msg))

    def recv(self, timeout_s: float = 300.0):  # type: ignore[no-untyped-def]
        if not self.sock.poll(int(timeout_s * 1000)):
            raise TimeoutError("the engine did not answer")
        return self.out.decode(self.sock.recv())

    def hello(self) -> Ready:
        self.send(Hello("bench"))
        msg = self.recv()
        assert isinstance(msg, Ready), msg
        return msg

    def utility(self, method: str) -> UtilityResult:
        call = next(self.calls)
        self.send(UtilityRequest(call, method))
        while True:
            msg = self.recv()
            if isinstance(msg, UtilityResult) and msg.call_id == call:
                return msg

    def run(self, requests: dict[str, SamplingParams], prompt: list[int]) -> None:
        """Send every request and wait until each has finished."""
        for rid, params in requests.items():
            self.send(AddRequest(rid, ints(prompt), params))
        left = set(requests)
        while left:
            msg = self.recv()
            if isinstance(msg, StepOutputs):
                for fin in msg.finished:
                    left.discard(msg.req_ids[fin.index])


def phases(drive: Driver, idle_s: float) -> list[tuple[str, float, float]]:
    """Each phase's (name, start, end)."""
    prompt = [128000] + [1000 + k for k in range(40)]
    marks = []

    def phase(name: str, work) -> None:  # type: ignore[no-untyped-def]
        start = time.monotonic()
        work()
        marks.append((name, start, time.monotonic()))
        print(f"  {name}: {marks[-1][2] - start:.2f} s", flush=True)

    def constrained(schema: dict, rid: str) -> None:
        params = SamplingParams(max_tokens=16, temperature=0.0,
                                structured=StructuredOutput("json", json.dumps(schema)))
        drive.run({rid: params}, prompt)

    phase("idle", lambda: time.sleep(idle_s))
    phase("first request (first forward)",
          lambda: drive.run({"first": SamplingParams(max_tokens=16, temperature=0.0)}, prompt))
    phase("first constrained request (compiler built)", lambda: constrained(SCHEMA_A, "json-a"))
    phase("a new schema (compile only)", lambda: constrained(SCHEMA_B, "json-b"))
    phase("prefix-cache reset + stats",
          lambda: (drive.utility("reset_prefix_cache"), drive.utility("stats")))
    phase("16 streams x 64 tokens",
          lambda: drive.run({f"load{i}": SamplingParams(max_tokens=64, ignore_eos=True)
                             for i in range(16)}, prompt))
    phase("idle after", lambda: time.sleep(idle_s))
    return marks


def summary(pinger: Pinger, start: float, end: float) -> str:
    rtts = sorted(rtt for sent, rtt in pinger.samples if start <= sent <= end)
    drops = ", ".join(f"{sum(start <= t <= end for t in times)}"
                      for times in pinger.drops.values())
    if not rtts:
        return f"no sample  link drops {drops}"
    p99 = rtts[min(len(rtts) - 1, int(0.99 * len(rtts)))]
    return (f"n {len(rtts):4d}  p50 {1000 * statistics.median(rtts):7.1f} ms  "
            f"p99 {1000 * p99:7.1f} ms  max {1000 * rtts[-1]:7.1f} ms  link drops {drops}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tandem-tiny-llama")
    parser.add_argument("--busy", type=int, default=0, help="busy-loop processes beside it")
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--out", help="write the samples and phases here as JSON")
    args = parser.parse_args()
    spinners = [multiprocessing.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    folder = tempfile.mkdtemp(prefix="tandem-ping-")
    address = f"ipc://{folder}/engine.sock"
    started = time.monotonic()
    engine = subprocess.Popen([sys.executable, "-m", "engine_core", args.model, "--listen",
                               address, "--num-threads", "1", "--log-level", "warning"],
                              cwd=Path(__file__).resolve().parents[2])
    ctx = zmq.Context()
    try:
        drive = Driver(ctx, address)
        drive.hello()
        print(f"engine ready in {time.monotonic() - started:.1f} s (busy loops: {args.busy}, "
              f"load {os.getloadavg()[0]:.1f})", flush=True)
        pinger = Pinger(ctx, address)
        pinger.start()
        marks = phases(drive, args.idle_s)
        pinger.stopping.set()
        pinger.join(timeout=70)
        print(f"ping round trip, {args.busy} busy loop(s) beside the engine "
              f"(link drops: {', '.join(pinger.links)}):")
        for name, start, end in marks:
            print(f"  {name:45s} {end - start:6.2f} s  {summary(pinger, start, end)}")
        whole = (marks[0][1], marks[-1][2])
        print(f"  {'all':45s} {whole[1] - whole[0]:6.2f} s  {summary(pinger, *whole)}")
        if args.out:
            Path(args.out).write_text(json.dumps({"busy": args.busy, "phases": marks,
                                                  "samples": pinger.samples,
                                                  "link_drops": pinger.drops}))
    finally:
        engine.send_signal(signal.SIGTERM)
        try:
            engine.wait(timeout=30)
        except subprocess.TimeoutExpired:
            engine.kill()
        for p in spinners:
            p.kill()
        ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
