"""What the HTTP frontends sustain on their own: 1 frontend against 2 on one port, no model.

    .venv/bin/python tests/bench/frontend_only.py [--num-prompts 256] [--input-len 128]
        [--output-len 64] [--max-concurrency 64] [--frontends 1 2] [--repeats 1]
        [--no-echo-logprobs] [--workloads plain echo+lp5] [--engine-step-ms 0]
        [--frontend-args "--stream-interval 2"] [--frontend-repo DIR] [--floor]

The figures issue 27 is judged by (one frontend, 5 ms engine steps, 256 streams x 128 tokens,
64-token prompts; docs/benchmarks.md):

    .venv/bin/python tests/bench/frontend_only.py --num-prompts 256 --max-concurrency 256 \
        --input-len 64 --output-len 128 --engine-step-ms 5 --frontends 1 --repeats 3

A no-op engine (tests/bench/noop_engine.py: the real ZeroMQ protocol, every token sent at
once, one StepOutputs per frontend per loop iteration) stands in for the engine core, so every
limit measured is the frontends' (HTTP, tokenization, output processing, detokenization, SSE).
For each count in --frontends, that many `python -m frontend.server --reuse-port` processes
share one port (SO_REUSEPORT: the kernel spreads connections over them); every group runs
from the start, on its own port. The load generator of `tandem bench serve`
(`frontend.bench.run_benchmark`) runs in this process: random prompts of exactly --input-len
tokens, streamed completions of --output-len tokens (ignore_eos), all sent at once with at most
--max-concurrency in flight. Two workloads, each run against every group in turn:

- plain: streamed completions, nothing else;
- echo+lp5: `echo` with `logprobs: 5` (the benchmark's --echo --logprobs 5), which loads the
  prompt-logprob, detokenizer and text-offset path. TTFT then times the echoed prompt.

With no step time, requests seldom overlap in the engine, so a StepOutputs carries about one
request and a frontend handles one message per token (the rows/msg column); --engine-step-ms
spaces the steps as a real engine's forward passes would, and each message then carries many.

Per run it also prints what a frontend costs: its CPU time per streamed token (utime + stime
of its process from /proc over the timed round, divided by the completion tokens the round
streamed; with several frontends, their sum), the client's TPOT p50 next to the engine's step
interval (a frontend that keeps up streams at the step's pace), whether every character of
text the no-op engine's tokens make reached the client (`text`: the streamed text's length
against the length of the decoded outputs the engine was asked for), tokens per text chunk (above
1 when a frontend fell behind and merged steps), and each frontend's RSS after the run.
--frontend-repo runs the frontends from another checkout (the same engine, client and
interpreter), so that a before/after pair is measured in the same conditions. --floor runs
tests/bench/floor_frontend.py in their place: aiohttp streaming one chunk per token per stream
at the step's pace with none of Tandem's work, the floor under a frontend's CPU per token.

One unmeasured warm-up run per group (short outputs, same concurrency) comes first. Printed per
run: requests/s, streamed tokens/s, the ratio to 1 frontend, TTFT, ITL and end-to-end p50 (the
client's view; ITL is the gap between text chunks as read, ~0 with no engine step time since
the chunks then arrive in bursts), rows per StepOutputs the engine sent, and CPU use during the
timed round in percent of one core: each frontend, the engine, this process (the load generator) and
the rest of the machine. Read the ratio next to the CPU columns: on a 2-core box the load
generator, the engine and the frontends share two cores (with whatever else runs there), so a
second frontend can only add what the first left idle; on a bigger, quiet box the same ratio
shows how far frontends scale out. Child processes are stopped (SIGTERM, then SIGKILL after
10 s) whatever happens; their logs go to a temporary folder, kept and named only on failure.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import zmq

from frontend.bench import BenchConfig, BenchResult, DatasetConfig, Target, run_benchmark
from shared.messages import EngineStats, UtilityRequest, UtilityResult
from shared.transport import InputCodec, OutputCodec, configure

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
STARTUP_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 10.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class ChildFailed(RuntimeError):
    """A child process died or did not get ready in time."""


class Children:
    """Child processes with their log files; `stop_all` terminates, waits, then kills."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, args: Sequence[str], cwd: Path = REPO) -> subprocess.Popen[bytes]:
        with open(self.log_dir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, *args], cwd=cwd, stdout=log, stderr=subprocess.STDOUT
            )
        self.procs.append((name, proc))
        return proc

    def wait_ready(self, name: str, proc: subprocess.Popen[bytes], ready_file: Path) -> str:
        """The content of `ready_file` once the child created it; ChildFailed if it died."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not ready_file.exists():
            if proc.poll() is not None:
                raise ChildFailed(f"{name} exited with {proc.returncode}\n{self.log_tail(name)}")
            if time.monotonic() > deadline:
                raise ChildFailed(
                    f"{name} not ready in {STARTUP_TIMEOUT_S:g} s\n{self.log_tail(name)}"
                )
            time.sleep(0.05)
        return ready_file.read_text().strip()

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.log_dir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(f"  {name}| {line}" for line in text.splitlines()[-lines:])

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise ChildFailed(f"{name} exited with {proc.returncode}\n{self.log_tail(name)}")

    def stop(self, procs: Sequence[tuple[str, subprocess.Popen[bytes]]]) -> None:
        """SIGTERM all of `procs`, wait for each, SIGKILL those still alive after the wait."""
        for _, proc in procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for name, proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"  {name} (pid {proc.pid}) ignored SIGTERM; killing it", file=sys.stderr)
                proc.kill()
                proc.wait()
        self.procs = [entry for entry in self.procs if entry not in procs]

    def stop_all(self) -> None:
        self.stop(list(reversed(self.procs)))  # frontends first, the engine last


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """utime + stime of a live process (Linux /proc); 0.0 where unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    except (OSError, IndexError, ValueError):
        return 0.0


def box_cpu_seconds() -> float:
    """CPU seconds the whole machine has been busy (all processes, all cores; /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS
    except (OSError, ValueError):
        return 0.0


def rss_mb(pid: int) -> float:
    """VmRSS of a live process in MiB (Linux /proc); 0.0 where unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def engine_stats(address: str) -> EngineStats:
    """The no-op engine's "stats" utility (steps, rows, ...), over a DEALER of our own."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    try:
        configure(sock)
        sock.connect(address)
        sock.send(InputCodec().encode(UtilityRequest(0, "stats")))
        if not sock.poll(5000):
            return EngineStats()
        msg = OutputCodec().decode(sock.recv())
        return msg.stats if isinstance(msg, UtilityResult) and msg.stats else EngineStats()
    finally:
        sock.close(linger=0)
        ctx.term()


@dataclass(frozen=True)
class Row:
    workload: str
    frontends: int
    result: BenchResult
    rows_per_msg: float
    cpu_frontends: tuple[float, ...]  # percent of one core over the timed round, each
    cpu_engine: float
    cpu_client: float
    cpu_other: float  # the rest of the machine (other processes) over the same window
    cpu_us_per_token: float  # the frontends' CPU seconds over the round / streamed tokens, in µs
    text_ok: bool  # the streamed text has every character the engine's tokens decode to
    tokens_per_chunk: float  # streamed tokens over the text chunks that carried them
    rss_mb: tuple[float, ...]  # each frontend's VmRSS after the round


@dataclass(frozen=True)
class Workload:
    name: str
    echo: bool = False
    logprobs: int | None = None


PLAIN = Workload("plain")
ECHO_LP = Workload("echo+lp5", echo=True, logprobs=5)


def start_frontends(
    children: Children, count: int, engine_address: str, log_dir: Path, extra: Sequence[str],
    repo: Path = REPO, floor_step: float | None = None,
) -> tuple[int, list[tuple[str, subprocess.Popen[bytes]]]]:
    """`floor_step`: run tests/bench/floor_frontend.py instead, ticking every that many s."""
    port = free_port()
    started = []
    for i in range(count):
        name = f"frontend{count}-{i}"
        ready = log_dir / f"{name}.ready"
        module = ([str(HERE / "floor_frontend.py"), "--step-interval", str(floor_step)]
                  if floor_step is not None else ["-m", "frontend.server"])
        proc = children.start(
            name,
            [
                *module,
                "--engine",
                engine_address,
                "--port",
                str(port),
                "--reuse-port",
                "--ready-file",
                str(ready),
                "--shutdown-grace",
                "2",
                "--log-level",
                "warning",
                *extra,
            ],
            cwd=repo,
        )
        started.append((name, proc, ready))
    for name, proc, ready in started:
        children.wait_ready(name, proc, ready)
    return port, [(name, proc) for name, proc, _ in started]


def bench_config(
    args: argparse.Namespace,
    port: int,
    tokenizer: str,
    workload: Workload,
    *,
    num_prompts: int | None = None,
    output_len: int | None = None,
) -> BenchConfig:
    return BenchConfig(
        target=Target(f"http://127.0.0.1:{port}"),
        num_prompts=num_prompts or args.num_prompts,
        dataset=DatasetConfig(random_input_len=args.input_len,
                              random_output_len=output_len or args.output_len),
        ignore_eos=True,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        tokenizer=tokenizer,
        logprobs=workload.logprobs,
        echo=workload.echo,
        disable_tqdm=True,
    )


class CpuSampler:
    """A thread reading the CPU seconds of processes every `interval`, so that the CPU spent in
    any window of the run (the timed round inside `run_benchmark`) can be read afterwards."""

    def __init__(self, pids: dict[str, int | None], interval: float = 0.05) -> None:
        self.pids = pids  # None: this process; "box" is added: the whole machine
        self.interval = interval
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Self:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        now = time.perf_counter()
        cpu = {
            name: own_cpu_seconds() if pid is None else cpu_seconds(pid)
            for name, pid in self.pids.items()
        }
        cpu["box"] = box_cpu_seconds()
        self.samples.append((now, cpu))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def at(self, when: float) -> dict[str, float]:
        """CPU seconds per name at `when`, interpolated between the samples around it."""
        times = [t for t, _ in self.samples]
        i = min(max(bisect.bisect_left(times, when), 1), len(times) - 1)
        (t0, c0), (t1, c1) = self.samples[i - 1], self.samples[i]
        f = 0.0 if t1 <= t0 else min(max((when - t0) / (t1 - t0), 0.0), 1.0)
        return {name: c0[name] + f * (c1[name] - c0[name]) for name in c0}

    def percent(self, start: float, end: float) -> dict[str, float]:
        """CPU use in [start, end] per name, in percent of one core."""
        a, b = self.at(start), self.at(end)
        return {name: 100 * (b[name] - a[name]) / max(end - start, 1e-9) for name in a}


def expected_text_chars(config: BenchConfig) -> int:
    """The characters a run of `config` must stream in all: what the no-op engine's tokens for
    each prompt decode to (token k of a request is its prompt's token k, BOS left out, cycling;
    tests/bench/noop_engine.py), plus the prompt's own text with echo."""
    from frontend.bench import prepare_workload, round_seed
    from frontend.bench.workload import load_tokenizer

    tokenizer = load_tokenizer(str(config.tokenizer))
    workload = asyncio.run(prepare_workload(tokenizer, config, round_seed(config.seed, 1)))
    bos = getattr(tokenizer, "bos_token_id", None)
    total = 0
    for prompt in workload.prompts:
        ids = list(tokenizer.encode(prompt.text))
        source = [i for i in ids if i != bos] or ids
        generated = [source[k % len(source)] for k in range(prompt.output_len)]
        total += len(tokenizer.decode(generated, skip_special_tokens=True))
        if config.echo:
            total += len(tokenizer.decode(ids, skip_special_tokens=True))
    return total


def measure(
    args: argparse.Namespace,
    port: int,
    tokenizer: str,
    workload: Workload,
    engine: tuple[str, subprocess.Popen[bytes]],
    frontends: list[tuple[str, subprocess.Popen[bytes]]],
    expected_chars: int | None,
) -> Row:
    address, engine_proc = engine
    pids: dict[str, int | None] = {name: proc.pid for name, proc in frontends}
    pids |= {"engine": engine_proc.pid, "client": None}
    before = engine_stats(address)
    with CpuSampler(pids) as sampler:
        result = asyncio.run(run_benchmark(bench_config(args, port, tokenizer, workload)))
        ended = time.perf_counter()
    after = engine_stats(address)
    rss = tuple(rss_mb(proc.pid) for _, proc in frontends)
    # The timed round is the end of run_benchmark (loading the tokenizer and building the
    # prompts come first, untimed): CPU is read over that window only.
    summary = result.summary
    cpu = sampler.percent(ended - summary.duration_s, ended)
    fe_cpu_s = sum(cpu[name] for name, _ in frontends) / 100 * summary.duration_s
    streamed = sum(r.text_chars for r in result.requests)
    if expected_chars is not None and streamed != expected_chars:
        print(f"  {workload.name}: the client got {streamed} characters of text, "
              f"{expected_chars} expected", file=sys.stderr)
    messages = after.output_messages - before.output_messages
    rows = after.output_rows - before.output_rows
    if summary.failed:
        errors = ", ".join(f"{n}x {e}" for e, n in summary.errors.items())
        print(
            f"  {workload.name} with {len(frontends)} frontend(s): {summary.failed} failed: "
            f"{errors}",
            file=sys.stderr,
        )
    return Row(
        workload.name,
        len(frontends),
        result,
        rows / messages if messages else 0.0,
        tuple(cpu[name] for name, _ in frontends),
        cpu["engine"],
        cpu["client"],
        max(0.0, cpu["box"] - sum(v for name, v in cpu.items() if name != "box")),
        1e6 * fe_cpu_s / max(summary.output_tokens, 1),
        expected_chars is None or streamed == expected_chars,
        summary.output_tokens / max(1, sum(len(r.text_times) for r in result.requests)),
        rss,
    )


def ms(stats: Any, digits: int = 1) -> str:
    return "-" if stats is None else f"{stats.median:.{digits}f}"


def format_table(args: argparse.Namespace, rows: list[Row]) -> str:
    header = (
        f"{'workload':<9} {'frontends':>9} {'req/s':>7} {'tok/s':>7} {'vs 1 FE':>7} "
        f"{'TTFT p50 ms':>11} {'ITL p50 ms':>10} {'E2E p50 ms':>10} {'ok':>5} "
        f"{'rows/msg':>8} {'CPU% FE':>9} {'engine':>6} {'client':>6} {'other':>5} "
        f"{'FE us/tok':>9} {'TPOT p50':>8} {'step':>5} {'tok/chunk':>9} {'text':>4} "
        f"{'RSS MB':>7}"
    )
    lines = [
        (
            f"frontend-only: no-op engine, {args.num_prompts} requests, {args.input_len}-token "
            f"prompts, {args.output_len} output tokens, max concurrency {args.max_concurrency}, "
            f"streaming; {os.cpu_count()} CPUs"
        ),
        header,
        "-" * len(header),
    ]
    ones: dict[str, list[float]] = {}
    for row in rows:
        if row.frontends == 1:
            ones.setdefault(row.workload, []).append(row.result.summary.output_throughput)
    for row in rows:
        s = row.result.summary
        base = statistics.fmean(ones.get(row.workload) or [0.0])
        ratio = f"x{s.output_throughput / base:.2f}" if base and row.frontends != 1 else "-"
        lines.append(
            f"{row.workload:<9} {row.frontends:>9} {s.request_throughput:>7.1f} "
            f"{s.output_throughput:>7.0f} {ratio:>7} {ms(s.ttft_ms):>11} "
            f"{ms(s.itl_ms, 3):>10} {ms(s.e2el_ms):>10} {s.completed:>5} "
            f"{row.rows_per_msg:>8.2f} {'+'.join(f'{c:.0f}' for c in row.cpu_frontends):>9} "
            f"{row.cpu_engine:>6.0f} {row.cpu_client:>6.0f} {row.cpu_other:>5.0f} "
            f"{row.cpu_us_per_token:>9.1f} {ms(s.tpot_ms, 2):>8} {args.engine_step_ms:>5g} "
            f"{row.tokens_per_chunk:>9.2f} {'ok' if row.text_ok else 'LOST':>4} "
            f"{'+'.join(f'{m:.0f}' for m in row.rss_mb):>7}"
        )
    lines += [
        "vs 1 FE: streamed tokens/s over that of 1 frontend, same workload (mean of its runs).",
        "ITL: gaps between text chunks as the client reads them (~0 with no engine step time: "
        + "they come in bursts). With echo, TTFT times the echoed prompt.",
        f"CPU%: of one core ({os.cpu_count()} cores) during the timed round: each frontend, "
        + "the engine, this process, other processes. rows/msg: requests per StepOutputs.",
        "FE us/tok: the frontends' CPU time (utime+stime) per streamed token. TPOT p50 (ms) "
        + "against the engine's step (ms). tok/chunk: streamed tokens per text chunk (merging). "
        + "text: every character arrived. RSS: after the run.",
        f"load average before the run: {args.load_before}; CPU: {cpu_model()}",
    ]
    return "\n".join(lines)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def run(args: argparse.Namespace, log_dir: Path, children: Children) -> list[Row]:
    from engine_core.worker.default_model import DEFAULT, ensure_model

    model = str(ensure_model())
    engine_ready = log_dir / "engine.ready"
    engine_proc = children.start(
        "engine",
        [
            str(HERE / "noop_engine.py"),
            "--model",
            model,
            "--served-model-name",
            DEFAULT.name,
            "--ready-file",
            str(engine_ready),
            "--step-interval",
            str(args.engine_step_ms / 1000),
        ],
    )
    address = children.wait_ready("engine", engine_proc, engine_ready)
    workloads = [w for w in (PLAIN, ECHO_LP) if w.name in args.workloads]
    # Every group of frontends (one port each) runs from the start and the groups take turns
    # per workload, so that drift in the machine's other load hits them alike; an idle group
    # costs only its heartbeats.
    extra = args.frontend_args.split()
    floor_step = (args.engine_step_ms or 5.0) / 1000 if args.floor else None
    groups = [start_frontends(children, count, address, log_dir, extra, args.frontend_repo,
                              floor_step) for count in args.frontends]
    for port, _ in groups:
        warm = bench_config(
            args,
            port,
            model,
            PLAIN,
            num_prompts=min(args.num_prompts, 2 * args.max_concurrency),
            output_len=min(args.output_len, 8),
        )
        asyncio.run(run_benchmark(warm))
    expected = {w.name: None if args.floor else expected_text_chars(bench_config(args, 0, model, w))
                for w in workloads}  # (None: the floor frontend's text is its own, not checked)
    rows = []
    for _ in range(args.repeats):
        for workload in workloads:
            for port, frontends in groups:
                children.check_alive()
                row = measure(args, port, model, workload, (address, engine_proc), frontends,
                              expected[workload.name])
                rows.append(row)
                s = row.result.summary
                print(
                    f"  {workload.name:<9} {len(frontends)} frontend(s): "
                    f"{s.duration_s:6.2f} s, {s.request_throughput:7.1f} req/s, "
                    f"{s.output_throughput:8.0f} tok/s, {row.cpu_us_per_token:5.1f} us/tok, "
                    f"TPOT p50 {ms(s.tpot_ms, 2)} ms",
                    flush=True,
                )
    children.check_alive()
    return rows


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument(
        "--frontends",
        type=int,
        nargs="+",
        default=[1, 2],
        help="frontend counts to run, in order (ratios are against 1)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="measured runs per workload")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--engine-step-ms",
        type=float,
        default=0.0,
        help="least time between the no-op engine's steps (0: none; e.g. 20 to batch like a "
        "real engine, so that each StepOutputs carries many requests)",
    )
    parser.add_argument(
        "--no-echo-logprobs", action="store_true", help="skip the echo + logprobs 5 workload"
    )
    parser.add_argument(
        "--workloads", nargs="+", choices=[PLAIN.name, ECHO_LP.name],
        default=[PLAIN.name, ECHO_LP.name], help="the workloads to run (default: both)")
    parser.add_argument(
        "--frontend-repo", type=Path, default=REPO,
        help="run the frontends from this checkout of Tandem (e.g. `git worktree add /tmp/base "
             "main`), for before/after figures in the same conditions (default: this one)")
    parser.add_argument(
        "--floor", action="store_true",
        help="run tests/bench/floor_frontend.py in place of the frontends: one write per "
             "token per stream at the engine's step (5 ms if --engine-step-ms is 0), no "
             "engine, tokenizer or detokenizer; plain only, its text not checked")
    parser.add_argument(
        "--frontend-args", default="",
        help='more flags for every frontend, as one string (e.g. "--stream-interval 2")')
    args = parser.parse_args(argv)
    if args.floor:
        args.workloads = [PLAIN.name]  # it answers every request alike
    if args.no_echo_logprobs:
        args.workloads = [w for w in args.workloads if w != ECHO_LP.name]
    if not args.workloads:
        parser.error("no workload left to run")
    for name in ("num_prompts", "input_len", "output_len", "max_concurrency", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.engine_step_ms < 0:
        parser.error("--engine-step-ms must be at least 0")
    if any(n < 1 for n in args.frontends):
        parser.error("--frontends takes counts of at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.load_before = load_average()
    # SIGTERM -> SystemExit, so the finally below stops the children.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    log_dir = Path(tempfile.mkdtemp(prefix="tandem-frontend-bench-"))
    children = Children(log_dir)
    ok = False
    try:
        started = time.perf_counter()
        rows = run(args, log_dir, children)
        print()
        print(format_table(args, rows))
        print(f"total {time.perf_counter() - started:.0f} s")
        ok = all(r.result.summary.failed == 0 and r.text_ok for r in rows)
    except ChildFailed as exc:
        print(f"frontend_only: {exc}", file=sys.stderr)
    finally:
        children.stop_all()
        if ok:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            print(f"child logs kept in {log_dir}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
