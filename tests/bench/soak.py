"""A soak: the whole server under mixed load for N minutes, looking for leaks and errors.

    .venv/bin/python tests/bench/soak.py [--minutes 10] [--concurrency 16] [--window-s 30]
        [--out FILE] [--seed 0] [--faults] [--fault-every-s 60]

Starts `tandem serve` (the default tiny model, `--api-server-count 2`, `--max-waiting-requests
64`, a free port) as a subprocess, then drives it for --minutes with --concurrency asyncio
aiohttp clients, each sending one request after another, drawn at random:

- /v1/completions and /v1/chat/completions, streamed or not, max_tokens 1-64, some with
  echo + logprobs (completions), some n=2, some with stop strings;
- ~5% streams the client drops after the first chunk or two (intentional disconnects);
- ~2% bad requests, which must get a 4xx;
- now and then /tokenize, /health, /metrics.

Every --window-s seconds it samples the RSS of the engine and of each frontend (VmRSS from
/proc, found through the process tree of the launcher's pid), requests done and failed in the
window (a status other than the one expected, any 5xx, a stream cut without [DONE] or carrying
an error event, a malformed answer, a client timeout), the TTFT p50 of the window's streams and
the engine's running/waiting from /metrics. After the load it waits for running and waiting to
return to 0 (and reads the KV-cache usage and the engine's step-error and lost-frontend
counters), prints a table per window and a summary, writes JSON with --out, stops the server
(SIGTERM to the launcher it started; SIGKILL to that pid only after 60 s) and checks that no
child of it is left. Exit status 1 on any unexpected error, leak, restart or orphan.

With --faults, every --fault-every-s seconds one fault, in turn:
- `frontend-kill`: SIGKILL one frontend. Its requests in flight may be cut (counted, not
  failures); a request that fails to connect, or is cut before any answer came (a request
  sent on a pooled connection to the dead frontend) within a minute of a kill, is sent again,
  up to twice, as the OpenAI SDK does; every other request must succeed. The launcher must
  start a replacement (the time until it serves is recorded) and the engine must abort the
  dead frontend's requests.
- `engine-pause-short`: SIGSTOP the engine for 1 s (within the frontends' liveness bound,
  1.25 s of silence): nothing may fail.
- `engine-pause-long`: SIGSTOP the engine for 5 s: the frontends declare it unavailable
  (requests then in flight fail with an error, new ones get 503) — expected failures while
  the fault lasts and up to 3 s after SIGCONT; the time until a request succeeds again is
  recorded.
- `engine-pause-stall`: SIGSTOP the engine for 15 s, longer than the stall floor (10 s) the
  launcher and the frontends judge a step loop by: failures as for the long pause, and the
  same engine process must serve again (a paused engine is not a stuck one; the launcher once
  killed it as stuck on SIGCONT).

The summary's `rss_engine_tail` is the engine's RssAnon (private memory, without mapped files'
pages, which the kernel drops under memory pressure) over the last 20 minutes (the last two
thirds of a shorter run): its spread, (max - min) / min, says whether memory levelled off.
Three series: each window's median and floor of a reading every second (the floor: what the
engine keeps beside the smallest step's working set, which a leak lifts), and one reading at
each window's end (which holds whatever the step running then allocated: a reading swings by up
to ~65 MB, 2.5%, on the tiny model's steps).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
STARTUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 120.0
SHORT_PAUSE_S = 1.0  # within the frontends' liveness bound: nothing may fail
LONG_PAUSE_S = 5.0  # beyond it: the engine is declared unavailable, then comes back
STALL_PAUSE_S = 15.0  # beyond the stall floor (shared.transport.DEFAULT_STALL_FLOOR_S, 10 s)
TAIL_S = 20 * 60.0  # the part of the run whose engine RSS must be flat
# A connection error before any answer is sent again, as the OpenAI SDK does (max_retries 2),
# within this long of a frontend kill (the client's pool may hold several dead connections to
# the killed frontend; aiohttp drops idle ones after 15 s)
CLIENT_RETRIES = 2
KILL_POOL_S = 60.0
PROBE_S = 1.0  # the engine's RssAnon is read this often (each window keeps its least)
OUTAGE_GRACE_S = 3.0  # after SIGCONT, failures still counted as the outage's
OUTAGE_BACKOFF_S = 1.0  # a client's wait after a 503 (the frontends send Retry-After: 1)
FAULT_KINDS = ("frontend-kill", "engine-pause-short", "engine-pause-long",
               "engine-pause-stall")

WORDS = ("the cat sat on a mat while seven quiet rivers ran under old stone bridges and "
         "nobody knew why the lamp was still burning at noon").split()
STOPS = ["\n", ".", " the", "and", "!"]
AUX = ("tokenize", "health", "metrics")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the process tree -------------------------------------------------------------------


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return sorted(kids)


def cmdline(pid: int) -> str:
    try:
        return (Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                .decode(errors="replace"))
    except OSError:
        return ""


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """A resident size of `pid` in MB: VmRSS, or RssAnon (its heap and other private memory,
    without the pages of mapped files such as libtorch's, which the kernel drops and reads
    again under memory pressure: another process's load moved VmRSS by 240 MB)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return 0.0


def server_pids(launcher: int) -> tuple[int | None, list[int]]:
    """(engine pid, frontend pids) among the launcher's children."""
    engine, frontends = None, []
    for pid in children_of(launcher):
        line = cmdline(pid)
        if "-m engine_core" in line:
            engine = pid
        elif "-m frontend.server" in line:
            frontends.append(pid)
    return engine, frontends


# --- /metrics ---------------------------------------------------------------------------


def metric(text: str, name: str) -> float | None:
    total = None
    for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([-+0-9.eEinfNa]+)$", text,
                         re.MULTILINE):
        total = (total or 0.0) + float(m.group(1))
    return total


# --- the load ---------------------------------------------------------------------------


@dataclass
class Window:
    index: int
    t_end_s: float = 0.0
    done: int = 0
    failed: int = 0
    disconnects: int = 0
    bad_4xx: int = 0
    streams: int = 0
    cut: int = 0  # in flight on a frontend that was killed
    retried: int = 0  # sent again after a connection error (a killed frontend's pooled socket)
    outage: int = 0  # failed while the engine was paused beyond the liveness bound
    ttfts: list[float] = field(default_factory=list)
    e2es: list[float] = field(default_factory=list)
    kinds: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    # sampled at the window's end
    rss_engine_mb: float = 0.0
    anon_engine_mb: float = 0.0  # RssAnon: what a leak would grow
    anon_floor_mb: float = 0.0  # the window's least RssAnon (read every PROBE_S)
    anon_median_mb: float = 0.0  # and its median reading
    anon_readings: list[float] = field(default_factory=list, repr=False)
    rss_frontends_mb: list[float] = field(default_factory=list)
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None

    def summary(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("ttfts")
        out.pop("e2es")
        out.pop("anon_readings")
        out["ttft_p50_ms"] = self.ttft_p50_ms()
        out["e2e_p50_ms"] = (round(statistics.median(self.e2es) * 1000, 1)
                             if self.e2es else None)
        out["failures"] = self.failures[:20]
        return out

    def ttft_p50_ms(self) -> float | None:
        return round(statistics.median(self.ttfts) * 1000, 1) if self.ttfts else None


class Failure(Exception):
    pass


@dataclass
class Attempt:
    """One try of one request: when it started and which frontend answered (its header)."""
    started: float
    frontend_pid: int | None = None

    def answered(self, resp: aiohttp.ClientResponse) -> None:
        header = resp.headers.get("X-Tandem-Frontend", "")
        self.frontend_pid = int(header.rsplit(":", 1)[1]) if ":" in header else None


@dataclass
class Faults:
    """What was injected and when, to tell a fault's expected casualties from failures."""
    killed: dict[int, float] = field(default_factory=dict)  # frontend pid -> when killed
    outages: list[list[float]] = field(default_factory=list)  # [start, end + grace]
    log: list[dict[str, Any]] = field(default_factory=list)

    def in_outage(self, t: float) -> bool:
        return any(start <= t <= end for start, end in self.outages)

    def excuse(self, attempt: Attempt, exc: Exception, retries_left: int) -> str | None:
        """"cut", "retry" or "outage" when a fault explains the failure; None otherwise."""
        pid = attempt.frontend_pid
        if pid in self.killed and attempt.started < self.killed[pid]:
            return "cut"  # in flight on the frontend that was killed
        connection = isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError))
        recent_kill = self.killed and attempt.started - max(self.killed.values()) < KILL_POOL_S
        if connection and pid is None and recent_kill and retries_left:
            return "retry"  # no answer yet: a pooled connection to the dead frontend
        clear = isinstance(exc, Failure) and (" 503 " in str(exc) or "error event" in str(exc))
        if clear and (self.in_outage(time.monotonic()) or self.in_outage(attempt.started)):
            return "outage"
        return None


class Load:
    def __init__(self, url: str, model: str, rng: random.Random) -> None:
        self.url = url
        self.model = model
        self.rng = rng
        self.window = Window(0)
        self.total_failures: list[str] = []
        self.faults = Faults()

    def text(self, lo: int, hi: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(lo, hi)))

    def fail(self, kind: str, why: str) -> None:
        self.window.failed += 1
        msg = f"{kind}: {why}"[:300]
        self.window.failures.append(msg)
        self.total_failures.append(msg)

    async def one(self, session: aiohttp.ClientSession) -> None:
        r = self.rng.random()
        if r < 0.02:
            kind, send = "bad", partial(self.bad, session, self.rng.randrange(5))
        elif r < 0.07:
            kind, send = "disconnect", partial(self.generate, session, *self.request(True),
                                               disconnect=True)
        elif r < 0.10:
            kind, send = "aux", partial(self.aux, session, self.rng.choice(AUX))
        else:
            stream = self.rng.random() < 0.5
            kind = "stream" if stream else "plain"
            send = partial(self.generate, session, *self.request(stream))
        self.window.kinds[kind] = self.window.kinds.get(kind, 0) + 1
        for retries_left in range(CLIENT_RETRIES, -1, -1):
            attempt = Attempt(time.monotonic())
            try:
                await send(attempt)
                self.window.done += 1
                return
            except (Failure, TimeoutError, aiohttp.ClientError) as e:
                why = self.faults.excuse(attempt, e, retries_left)
                if why == "retry":
                    self.window.retried += 1
                    continue
                if why == "cut":
                    self.window.cut += 1
                elif why == "outage":
                    self.window.outage += 1
                    await asyncio.sleep(OUTAGE_BACKOFF_S)  # as a client honouring Retry-After
                elif isinstance(e, Failure):
                    self.fail(kind, str(e))
                else:
                    self.fail(kind, f"{type(e).__name__}: {e}")
                return

    async def aux(self, session: aiohttp.ClientSession, which: str, attempt: Attempt) -> None:
        if which == "tokenize":
            async with session.post(f"{self.url}/tokenize",
                                    json={"model": self.model, "prompt": self.text(1, 40)}) as resp:
                attempt.answered(resp)
                body = await resp.read()
                if resp.status != 200 or "tokens" not in json.loads(body):
                    raise Failure(f"/tokenize {resp.status} {body[:200]!r}")
        else:
            async with session.get(f"{self.url}/{which}") as resp:
                attempt.answered(resp)
                body = await resp.read()
                if resp.status != 200:
                    raise Failure(f"/{which} {resp.status} {body[:200]!r}")

    async def bad(self, session: aiohttp.ClientSession, choice: int, attempt: Attempt) -> None:
        path = "/v1/completions"
        data: bytes | None = None
        body: dict[str, Any] = {"model": self.model, "prompt": "hi", "max_tokens": 4}
        if choice == 0:
            body["max_tokens"] = -1
        elif choice == 1:
            body["temperature"] = "hot"
        elif choice == 2:
            body["n"] = 0
        elif choice == 3:
            path = "/v1/chat/completions"
            body = {"model": self.model, "messages": "not a list"}
        else:
            data = b'{"model": "' + self.model.encode() + b'", "prompt": '  # cut JSON
        kwargs: dict[str, Any] = ({"data": data, "headers": {"Content-Type": "application/json"}}
                                  if data is not None else {"json": body})
        async with session.post(f"{self.url}{path}", **kwargs) as resp:
            attempt.answered(resp)
            text = await resp.read()
            if not 400 <= resp.status < 500:
                raise Failure(f"bad request #{choice} got {resp.status} {text[:200]!r}")
            self.window.bad_4xx += 1

    def request(self, stream: bool) -> tuple[str, dict[str, Any]]:
        """A random completions or chat request: (path, body)."""
        rng = self.rng
        body: dict[str, Any] = {"model": self.model, "max_tokens": rng.randint(1, 64),
                                "n": 2 if rng.random() < 0.15 else 1, "stream": stream,
                                "temperature": rng.choice([0.0, 0.8])}
        if rng.random() < 0.2:
            body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
        if rng.random() < 0.4:
            path = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": self.text(1, 60)}]
            if rng.random() < 0.15:
                body["logprobs"] = True
                body["top_logprobs"] = 2
        else:
            path = "/v1/completions"
            body["prompt"] = self.text(1, 120)
            if rng.random() < 0.2:
                body["echo"] = True
                body["logprobs"] = rng.choice([0, 1, 5])
        return path, body

    async def generate(self, session: aiohttp.ClientSession, path: str, body: dict[str, Any],
                       attempt: Attempt, disconnect: bool = False) -> None:
        rng = self.rng
        n, stream = body["n"], body["stream"]
        t0 = time.monotonic()
        async with session.post(f"{self.url}{path}", json=body) as resp:
            attempt.answered(resp)
            if resp.status != 200:
                text = await resp.read()
                raise Failure(f"{path} {resp.status} {text[:200]!r}")
            if not stream:
                data = json.loads(await resp.read())
                choices = data.get("choices") or []
                if len(choices) != n or any(c.get("finish_reason") is None for c in choices):
                    raise Failure(f"{path} malformed answer {str(data)[:200]}")
                if body.get("echo") and any(c.get("logprobs") is None for c in choices):
                    raise Failure(f"{path} echo+logprobs without logprobs")
                self.window.e2es.append(time.monotonic() - t0)
                return
            self.window.streams += 1
            first = None
            chunks = 0
            done = False
            finished: set[int] = set()
            cut_after = rng.randint(1, 2) if disconnect else None
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    raise Failure(f"{path} error event {str(event)[:200]}")
                for c in event.get("choices", []):
                    if c.get("finish_reason") is not None:
                        finished.add(c.get("index", 0))
                if first is None:
                    first = time.monotonic() - t0
                    self.window.ttfts.append(first)
                chunks += 1
                if cut_after is not None and chunks >= cut_after:
                    resp.close()  # drop the connection mid-stream
                    self.window.disconnects += 1
                    return
            if not done:
                raise Failure(f"{path} stream ended without [DONE] after {chunks} chunks")
            if cut_after is not None:  # the stream ended before the client could drop it
                self.window.disconnects += 1
            if len(finished) != n:
                raise Failure(f"{path} stream finished {len(finished)} of {n} choices")
            self.window.e2es.append(time.monotonic() - t0)


# --- faults -----------------------------------------------------------------------------


async def fresh_get(url: str, path: str, timeout_s: float = 2.0) -> tuple[int, int | None]:
    """(status, answering frontend pid) on a new connection; (0, None) when none answered."""
    connector = aiohttp.TCPConnector(force_close=True)
    try:
        async with aiohttp.ClientSession(connector=connector) as s, s.get(
                f"{url}{path}", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            attempt = Attempt(0.0)
            attempt.answered(resp)
            await resp.read()
            return resp.status, attempt.frontend_pid
    except (TimeoutError, aiohttp.ClientError):
        return 0, None


async def until(check: Any, timeout_s: float) -> float | None:
    """Seconds until `await check()` is true (polled every 0.1 s), None past the timeout."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if await check():
            return round(time.monotonic() - start, 2)
        await asyncio.sleep(0.1)
    return None


async def inject(kind: str, faults: Faults, url: str, model: str, launcher: int,
                 t0: float) -> dict[str, Any]:
    """Inject one fault; what it did and how long the server took to serve again."""
    engine, frontends = server_pids(launcher)
    entry: dict[str, Any] = {"kind": kind, "at_s": round(time.monotonic() - t0, 1)}
    if kind == "frontend-kill":
        victim = frontends[0]
        faults.killed[victim] = time.monotonic()
        os.kill(victim, signal.SIGKILL)

        async def replaced() -> bool:
            pid = (await fresh_get(url, "/health"))[1]
            return pid is not None and pid not in frontends

        entry["frontend"] = victim
        entry["replacement_serving_s"] = await until(replaced, 60)
        return entry
    assert engine is not None
    pause = {"engine-pause-short": SHORT_PAUSE_S, "engine-pause-long": LONG_PAUSE_S,
             "engine-pause-stall": STALL_PAUSE_S}[kind]
    outage = [time.monotonic(), float("inf")]
    if kind != "engine-pause-short":
        faults.outages.append(outage)
    os.kill(engine, signal.SIGSTOP)
    await asyncio.sleep(pause)
    os.kill(engine, signal.SIGCONT)
    outage[1] = time.monotonic() + OUTAGE_GRACE_S

    async def serves() -> bool:
        body = {"model": model, "prompt": "are you back", "max_tokens": 2}
        connector = aiohttp.TCPConnector(force_close=True)
        try:
            async with aiohttp.ClientSession(connector=connector) as s, s.post(
                    f"{url}/v1/completions", json=body,
                    timeout=aiohttp.ClientTimeout(total=5)) as resp:
                await resp.read()
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    entry["pause_s"] = pause
    entry["serving_again_after_resume_s"] = await until(serves, 60)
    entry["same_engine"] = server_pids(launcher)[0] == engine
    return entry


def rss_tail(windows: list[Window], run_s: float) -> dict[str, float]:
    """The engine's RssAnon over the run's last TAIL_S (its last two thirds if shorter): the
    windows' floors (min, max, spread_pct) and the readings at their ends (sample_*)."""
    seconds = min(TAIL_S, run_s * 2 / 3)
    tail = [w for w in windows if w.t_end_s >= run_s - seconds]
    floors = [w.anon_floor_mb for w in tail if w.anon_floor_mb] or [0.0]
    medians = [w.anon_median_mb for w in tail if w.anon_median_mb] or [0.0]
    samples = [w.anon_engine_mb for w in tail] or [0.0]

    def spread(values: list[float]) -> float:
        return round(100 * (max(values) - min(values)) / min(values), 2) if min(values) else 0.0

    return {"seconds": seconds, "min": min(floors), "max": max(floors),
            "spread_pct": spread(floors), "median_min": min(medians),
            "median_max": max(medians), "median_spread_pct": spread(medians),
            "sample_min": min(samples),
            "sample_max": max(samples), "sample_spread_pct": spread(samples)}


# --- the run ----------------------------------------------------------------------------


async def scrape(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/metrics") as resp:
        return (await resp.read()).decode()


async def wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {proc.returncode}")
            try:
                async with session.get(f"{url}/health",
                                       timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status == 200:
                        return
            except (TimeoutError, aiohttp.ClientError):
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"not healthy within {STARTUP_TIMEOUT_S:g} s")


async def drive(args: argparse.Namespace, url: str, launcher: int) -> dict[str, Any]:
    rng = random.Random(args.seed)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=args.concurrency * 2)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async with session.get(f"{url}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        load = Load(url, model, rng)
        engine0, frontends0 = server_pids(launcher)
        print(f"model {model!r}; launcher {launcher}, engine {engine0}, frontends {frontends0}",
              flush=True)
        start = time.monotonic()
        end = start + args.minutes * 60
        windows: list[Window] = []
        restarts: list[str] = []

        async def client() -> None:
            while time.monotonic() < end:
                await load.one(session)

        async def injector() -> None:
            for i in itertools.count():
                await asyncio.sleep(args.fault_every_s)
                if time.monotonic() > end - args.fault_every_s / 2:
                    return
                entry = await inject(FAULT_KINDS[i % len(FAULT_KINDS)], load.faults, url,
                                     model, launcher, start)
                load.faults.log.append(entry)
                print(f"fault: {entry}", flush=True)

        async def memory_probe() -> None:
            while time.monotonic() < end:
                w, engine = load.window, server_pids(launcher)[0]
                mb = round(rss_mb(engine, "RssAnon"), 1) if engine else 0.0
                if mb:
                    w.anon_readings.append(mb)
                    w.anon_floor_mb = min(w.anon_readings)
                await asyncio.sleep(PROBE_S)

        async def sampler() -> None:
            while True:
                await asyncio.sleep(min(args.window_s, max(0.0, end - time.monotonic())))
                w = load.window
                load.window = Window(w.index + 1)
                w.t_end_s = round(time.monotonic() - start, 1)
                engine, frontends = server_pids(launcher)
                if engine != engine0 or (frontends != frontends0 and not load.faults.killed):
                    restarts.append(f"at {w.t_end_s} s: engine {engine}, frontends {frontends}")
                w.rss_engine_mb = round(rss_mb(engine), 1) if engine else 0.0
                w.anon_engine_mb = round(rss_mb(engine, "RssAnon"), 1) if engine else 0.0
                if w.anon_readings:
                    w.anon_median_mb = round(statistics.median(w.anon_readings), 1)
                w.rss_frontends_mb = [round(rss_mb(p), 1) for p in frontends]
                try:
                    text = await scrape(session, url)
                    w.running = metric(text, "vllm:num_requests_running")
                    w.waiting = metric(text, "vllm:num_requests_waiting")
                    w.kv_usage = metric(text, "vllm:kv_cache_usage_perc")
                except (TimeoutError, aiohttp.ClientError) as e:
                    load.fail("sample", f"/metrics: {e}")
                windows.append(w)
                print(row(w), flush=True)
                if time.monotonic() >= end - 0.5:
                    return

        print(HEADER, flush=True)
        tasks = [asyncio.create_task(client()) for _ in range(args.concurrency)]
        if args.faults:
            tasks.append(asyncio.create_task(injector()))
        await asyncio.gather(sampler(), memory_probe(), *tasks)
        # whatever finished after the last sample (clients finishing their last request)
        tail = load.window
        windows[-1].done += tail.done
        windows[-1].failed += tail.failed
        windows[-1].failures += tail.failures
        for counter in ("cut", "retried", "outage"):
            setattr(windows[-1], counter, getattr(windows[-1], counter) + getattr(tail, counter))

        # drained: running and waiting back to 0
        drain_t0 = time.monotonic()
        final: dict[str, float | None] = {}
        while True:
            text = await scrape(session, url)
            final = {name: metric(text, name) for name in (
                "vllm:num_requests_running", "vllm:num_requests_waiting",
                "vllm:kv_cache_usage_perc", "tandem:engine_step_errors_total",
                "tandem:frontends_lost_total", "vllm:num_preemptions_total",
                "tandem:requests_rejected_total")}
            if (final["vllm:num_requests_running"] == 0
                    and final["vllm:num_requests_waiting"] == 0
                    and final["vllm:kv_cache_usage_perc"] == 0):
                break
            if time.monotonic() - drain_t0 > DRAIN_TIMEOUT_S:
                break
            await asyncio.sleep(0.5)
        drain_s = round(time.monotonic() - drain_t0, 2)
    return {"model": model, "windows": windows, "final": final, "drain_s": drain_s,
            "restarts": restarts, "failures": load.total_failures, "faults": load.faults.log}


HEADER = (f"{'t s':>6} {'done':>6} {'fail':>5} {'disc':>5} {'4xx':>4} {'fault':>5} {'ttft50':>7} "
          f"{'e2e50':>7} {'run':>4} {'wait':>4} {'kv%':>5} {'engMB':>7} {'anonMB':>7} {'floor':>7} "
          f"{'frontends MB':>16}")


def row(w: Window) -> str:
    ttft = w.ttft_p50_ms()
    e2e = statistics.median(w.e2es) * 1000 if w.e2es else None
    kv = f"{w.kv_usage * 100:5.1f}" if w.kv_usage is not None else "    -"
    return (f"{w.t_end_s:>6.0f} {w.done:>6} {w.failed:>5} {w.disconnects:>5} {w.bad_4xx:>4} "
            f"{w.cut + w.retried + w.outage:>5} "
            f"{(f'{ttft:.0f}' if ttft is not None else '-'):>7} "
            f"{(f'{e2e:.0f}' if e2e is not None else '-'):>7} "
            f"{w.running if w.running is not None else '-':>4} "
            f"{w.waiting if w.waiting is not None else '-':>4} {kv} "
            f"{w.rss_engine_mb:>7.1f} {w.anon_engine_mb:>7.1f} {w.anon_floor_mb:>7.1f} "
            f"{' '.join(f'{x:.1f}' for x in w.rss_frontends_mb):>16}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--faults", action="store_true",
                        help="inject a fault every --fault-every-s (frontend kill, short and "
                             "long engine pause, in turn)")
    parser.add_argument("--fault-every-s", type=float, default=60.0)
    args = parser.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_dir = Path(tempfile.mkdtemp(prefix="tandem-soak-"))
    log_path = log_dir / "serve.log"
    cmd = [sys.executable, "-m", "frontend.cli", "serve", "--port", str(port),
           "--api-server-count", "2", "--max-waiting-requests", "64", "--log-level", "warning",
           "--disable-log-stats"]
    print(f"starting: tandem {' '.join(cmd[3:])} (log {log_path})", flush=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    problems: list[str] = []
    result: dict[str, Any] = {}
    orphans: list[int] = []
    try:
        asyncio.run(wait_healthy(url, proc))
        result = asyncio.run(drive(args, url, proc.pid))
    finally:
        kids = children_of(proc.pid)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                problems.append(f"the launcher ignored SIGTERM for {STOP_TIMEOUT_S:g} s")
                proc.kill()
                proc.wait()
        else:
            problems.append(f"the launcher had exited with {proc.returncode}")
        time.sleep(0.5)
        orphans = [p for p in kids if Path(f"/proc/{p}").exists() and cmdline(p)]
        if orphans:
            problems.append(f"children left after the launcher exited: {orphans}")
        print(f"launcher exit status {proc.returncode}", flush=True)

    windows: list[Window] = result["windows"]
    final = result["final"]
    first, last = windows[0], windows[-1]
    fe_first = first.rss_frontends_mb
    fe_last = last.rss_frontends_mb
    fe_max = [max(w.rss_frontends_mb[i] for w in windows if len(w.rss_frontends_mb) > i)
              for i in range(len(fe_first))]
    summary = {
        "minutes": args.minutes, "concurrency": args.concurrency, "window_s": args.window_s,
        "seed": args.seed,
        "requests_done": sum(w.done for w in windows),
        "requests_failed": sum(w.failed for w in windows),
        "intentional_disconnects": sum(w.disconnects for w in windows),
        "cut_by_frontend_kill": sum(w.cut for w in windows),
        "retried_after_frontend_kill": sum(w.retried for w in windows),
        "failed_in_engine_outage": sum(w.outage for w in windows),
        "faults": result["faults"],
        "expected_4xx": sum(w.bad_4xx for w in windows),
        "kinds": {k: sum(w.kinds.get(k, 0) for w in windows)
                  for k in ("plain", "stream", "disconnect", "bad", "aux")},
        "rss_engine_mb": {"first": first.rss_engine_mb, "last": last.rss_engine_mb,
                          "max": max(w.rss_engine_mb for w in windows)},
        "rss_engine_tail": rss_tail(windows, args.minutes * 60),
        "rss_frontends_mb": {"first": fe_first, "last": fe_last, "max": fe_max},
        "ttft_p50_ms": {"first": first.ttft_p50_ms(), "last": last.ttft_p50_ms(),
                        "min": min((w.ttft_p50_ms() or 1e9) for w in windows),
                        "max": max((w.ttft_p50_ms() or 0) for w in windows)},
        "final_metrics": final, "drain_s": result["drain_s"],
        "restarts": result["restarts"], "launcher_exit": proc.returncode, "orphans": orphans,
        "uptime_load": os.getloadavg(),
    }
    if summary["requests_failed"]:
        problems.append(f"{summary['requests_failed']} unexpected failures: "
                        f"{result['failures'][:10]}")
    if final.get("vllm:num_requests_running") != 0 or final.get("vllm:num_requests_waiting") != 0:
        problems.append(f"engine did not drain: running {final.get('vllm:num_requests_running')}"
                        f", waiting {final.get('vllm:num_requests_waiting')}")
    if final.get("vllm:kv_cache_usage_perc") != 0:
        problems.append(f"KV cache not empty after drain: {final.get('vllm:kv_cache_usage_perc')}")
    if final.get("tandem:engine_step_errors_total"):
        problems.append(f"engine step errors: {final['tandem:engine_step_errors_total']}")
    kills = [f for f in result["faults"] if f["kind"] == "frontend-kill"]
    if (final.get("tandem:frontends_lost_total") or 0) != len(kills):
        problems.append(f"frontends lost: {final.get('tandem:frontends_lost_total')}, "
                        f"killed: {len(kills)}")
    for f in result["faults"]:
        if f.get("replacement_serving_s", 0) is None:
            problems.append(f"frontend {f['frontend']} was not replaced within 60 s")
        if f.get("serving_again_after_resume_s", 0) is None:
            problems.append(f"no request served within 60 s after the {f['kind']} ended")
        if f.get("same_engine") is False:
            problems.append(f"the engine was replaced after the {f['kind']} at {f['at_s']} s")
    if result["restarts"]:
        problems.append(f"processes replaced during the soak: {result['restarts']}")
    if proc.returncode not in (0, -signal.SIGTERM):
        problems.append(f"launcher exit status {proc.returncode}")
    summary["problems"] = problems

    print("\nsummary")
    print(f"  requests: {summary['requests_done']} done, {summary['requests_failed']} failed; "
          f"{summary['intentional_disconnects']} intentional disconnects, "
          f"{summary['expected_4xx']} expected 4xx; by kind {summary['kinds']}")
    r = summary["rss_engine_mb"]
    print(f"  engine RSS MB: first {r['first']}, last {r['last']}, max {r['max']} "
          f"({r['last'] - r['first']:+.1f})")
    tail = summary["rss_engine_tail"]
    print(f"  engine RssAnon MB over the last {tail['seconds']:.0f} s: windows' medians "
          f"{tail['median_min']}-{tail['median_max']} (spread {tail['median_spread_pct']:.2f}%), "
          f"floors {tail['min']}-{tail['max']} (spread {tail['spread_pct']:.2f}%), at the "
          f"windows' ends {tail['sample_min']}-{tail['sample_max']} "
          f"(spread {tail['sample_spread_pct']:.2f}%)")
    for i in range(len(fe_first)):
        print(f"  frontend {i} RSS MB: first {fe_first[i]}, "
              f"last {fe_last[i] if i < len(fe_last) else '-'}, max {fe_max[i]}")
    if result["faults"]:
        print(f"  faults: {len(result['faults'])}; requests cut on a killed frontend "
              f"{summary['cut_by_frontend_kill']}, sent again after a connection error "
              f"{summary['retried_after_frontend_kill']}, failed while the engine was paused "
              f"beyond the liveness bound {summary['failed_in_engine_outage']}")
        for f in result["faults"]:
            print(f"    {f}")
    t = summary["ttft_p50_ms"]
    print(f"  TTFT p50 ms: first window {t['first']}, last {t['last']}, "
          f"range {t['min']}-{t['max']}")
    print(f"  after the load (drain {result['drain_s']} s): {final}")
    print(f"  load average now {summary['uptime_load']}")
    for p in problems:
        print(f"  PROBLEM: {p}")
    if args.out:
        args.out.write_text(json.dumps({"summary": summary,
                                        "windows": [w.summary() for w in windows]}, indent=1))
    if not problems:
        print("  no unexpected error, no leak")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
