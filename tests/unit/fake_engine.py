"""A fake engine core for frontend tests: a real ZeroMQ ROUTER in a thread, no model.

It answers Hello with Ready, ping/stats utilities, and "generates" deterministically: token k
of a request is its prompt's token k (BOS left out), cycling, one token per step, with fake
logprobs (the sampled token first in its top-k, rank 1). It honours max_tokens (0: prefill
only, finish "length", prompt logprobs if asked), stop_token_ids, EOS unless ignore_eos, and
aborts; prompts longer than `error_prompt_len` finish with "error". `stop()` kills it
(silence, as a dead process would be); `added`/`aborted` record what the frontend sent.

For data-parallel tests it has a rank, answers pings with its queue's load (`load`, when set,
stands in for it), and with `kv_events` publishes each added prompt's full blocks as a real
engine's block manager would (BlockStored with the shared hash chain, vLLM's wire format).
"""

from __future__ import annotations

import ctypes
import json
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from shared.block_hash import chain_hashes
from shared.kv_events import BlockStored, parse_kv_events_config
from shared.kv_publisher import KvEventPublisher
from shared.messages import (
    AbortRequest,
    AddRequest,
    EngineLoad,
    EngineStats,
    Finished,
    FinishReason,
    Hello,
    Ready,
    StepOutputs,
    StopRequest,
    UtilityRequest,
    UtilityResult,
    read_ints,
)
from shared.step_outputs import Logprobs, pack_step
from shared.transport import InputCodec, OutputCodec, configure

BOS = 128000
EOS = 128001


def sse_events(body: str) -> list[Any]:
    """A streamed response body as its events: the JSON payloads, then the string "[DONE]"."""
    events = [e for e in body.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] if e == "data: [DONE]" else json.loads(e[6:]) for e in events]


@lru_cache(maxsize=1)
def tokenizer_folder() -> str:
    """The default model's tokenizer, written once per test session."""
    from engine_core.worker.default_model import DEFAULT, write_tokenizer

    folder = Path(tempfile.mkdtemp(prefix="tandem-tok-"))
    write_tokenizer(DEFAULT, folder)
    return str(folder)


@lru_cache(maxsize=4)
def cached_tokenizer(path: str) -> Any:
    """The frontend's own tokenizer loader, loading each folder once per session."""
    from frontend.text.tokenizer_loader import load_tokenizer

    return load_tokenizer(path)


def frontend_config(engine: FakeEngine, **overrides: Any) -> Any:
    """A FrontendConfig for `engine` with quick liveness checks, for aiohttp_client tests."""
    from frontend.server import FrontendConfig

    settings = {"heartbeat_interval": 0.1, "silence_timeout": 0.5, "handshake_timeout": 5.0}
    return FrontendConfig(engine_address=engine.address, **(settings | overrides))


async def production_client(aiohttp_client: Any, config: Any) -> Any:
    """An aiohttp test client of a frontend served with the server settings production uses
    (`runner_options`: timeouts, the access log)."""
    from aiohttp.test_utils import TestServer

    from frontend.server import init_app, runner_options

    server = TestServer(init_app(config, cached_tokenizer))
    options = runner_options(config)
    del options["handler_cancellation"]  # the test server sets it too
    await server.start_server(**options)
    return await aiohttp_client(server)


@dataclass
class _Running:
    identity: bytes
    add: AddRequest
    source: list[int]
    generated: int = 0
    started: bool = False


@dataclass
class _Step:
    req_ids: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    lp_k: list[int] = field(default_factory=list)
    lp_sampled: list[float] = field(default_factory=list)
    lp_top: list[list[int]] = field(default_factory=list)
    lp_top_vals: list[list[float]] = field(default_factory=list)
    prompt_logprobs: dict[int, Logprobs] = field(default_factory=dict)
    finished: list[Finished] = field(default_factory=list)

    def message(self) -> StepOutputs:
        width = max(self.lp_k, default=0)
        top = np.zeros((len(self.tokens), max(width, 0)), np.int32)
        vals = np.zeros(top.shape, np.float32)
        for i, (ids, v) in enumerate(zip(self.lp_top, self.lp_top_vals)):
            top[i, : len(ids)], vals[i, : len(v)] = ids, v
        logprobs = Logprobs(np.float32(self.lp_sampled), np.ones(len(self.tokens), np.int32),
                            top, vals)
        return pack_step(self.req_ids, self.tokens, logprobs=logprobs, lp_k=self.lp_k,
                         prompt_logprobs=self.prompt_logprobs, finished=self.finished)


class FakeEngine:
    def __init__(
        self,
        *,
        max_model_len: int = 256,
        step_delay: float = 0.002,
        error_prompt_len: int | None = None,
        model: str = "fake-model",
        rank: int = 0,
        kv_events: bool = False,
        block_size: int = 16,
    ) -> None:
        self.ready = Ready(model, tokenizer_folder(), max_model_len, 128256, [EOS], BOS, 1,
                           data_parallel_rank=rank, block_size=block_size)
        self.load: int | None = None  # the queue length pings report (None: what runs)
        # True: pings go unanswered while the socket stays up (a busy or stuck engine)
        self.silent = False
        self.step_delay = step_delay
        self.error_prompt_len = error_prompt_len
        self.added: list[AddRequest] = []
        self.aborted: list[str] = []
        self.running: dict[str, _Running] = {}
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        configure(self._sock)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._in, self._out = InputCodec(), OutputCodec()
        self.events: KvEventPublisher | None = None
        if kv_events:
            folder = tempfile.mkdtemp(prefix="tandem-kv-")
            config = parse_kv_events_config(
                f'{{"enable_kv_cache_events": true, "endpoint": "ipc://{folder}/pub", '
                f'"replay_endpoint": "ipc://{folder}/replay"}}')
            self.events = KvEventPublisher(config, rank, self._ctx)
            self.ready.kv_events_endpoint = self.events.endpoint
            self.ready.kv_events_replay = self.events.replay_endpoint

    def start(self) -> FakeEngine:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Go silent at once, like a killed process."""
        self._stopping.set()
        self._thread.join()
        self._sock.close(linger=0)
        if self.events is not None:
            self.events.close()
        self._ctx.term()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            if self._sock.poll(int(self.step_delay * 1000) or 1):
                while self._sock.poll(0):
                    identity, frame = self._sock.recv_multipart()
                    self._handle(identity, self._in.decode(frame))
            if self.running:
                self._step()
                time.sleep(self.step_delay)

    def _send(self, identity: bytes, msg: Any) -> None:
        self._sock.send_multipart([identity, self._out.encode(msg)])

    def _handle(self, identity: bytes, msg: Any) -> None:
        if isinstance(msg, Hello):
            self._send(identity, self.ready)
        elif isinstance(msg, AddRequest):
            self.added.append(msg)
            prompt = read_ints(msg.prompt_token_ids)
            source = [t for t in prompt if t != BOS] or prompt
            self.running[msg.request_id] = _Running(identity, msg, source)
            self._publish_blocks(prompt)
        elif isinstance(msg, (AbortRequest, StopRequest)):  # Stop: aborted for a stop string
            self.aborted.extend(msg.request_ids)
            for rid in msg.request_ids:
                self.running.pop(rid, None)
        elif isinstance(msg, UtilityRequest):
            if msg.method == "stats":
                stats = EngineStats(running=len(self.running), num_requests=len(self.running))
                self._send(identity, UtilityResult(msg.call_id, stats))
            elif msg.method == "ping" and self.silent:
                pass
            elif msg.method == "ping":
                load = EngineLoad(len(self.running) if self.load is None else self.load)
                self._send(identity, UtilityResult(msg.call_id, load=load))
            else:
                self._send(identity, UtilityResult(msg.call_id, error=f"unknown {msg.method}"))

    def _publish_blocks(self, prompt: list[int]) -> None:
        if self.events is None:
            return
        size = self.ready.block_size
        hashes = chain_hashes(prompt, size)
        if hashes:
            self.events.publish([BlockStored(hashes, None, prompt[:len(hashes) * size], size,
                                             None, "GPU", None)])

    def _step(self) -> None:
        steps: dict[bytes, _Step] = {}
        for rid, req in list(self.running.items()):
            step = steps.setdefault(req.identity, _Step())
            row = len(step.req_ids)
            step.req_ids.append(rid)
            finish = self._advance(req, step, row)
            if finish is not None:
                step.finished.append(finish)
                del self.running[rid]
        for identity, step in steps.items():
            self._send(identity, step.message())

    def _advance(self, req: _Running, step: _Step, row: int) -> Finished | None:
        params = req.add.params
        prompt_len = len(read_ints(req.add.prompt_token_ids))
        if not req.started and params.prompt_logprobs is not None:
            step.prompt_logprobs[row] = fake_prompt_logprobs(req.add)
        req.started = True
        if self.error_prompt_len is not None and prompt_len > self.error_prompt_len:
            self._no_token(step)
            message = f"prompt of {prompt_len} tokens can never fit"
            return Finished(row, FinishReason.ERROR, message=message)
        if params.max_tokens == 0:
            self._no_token(step)
            return Finished(row, FinishReason.LENGTH)
        token = req.source[req.generated % len(req.source)]
        req.generated += 1
        step.tokens.append(token)
        k = -1 if params.logprobs is None else params.logprobs
        step.lp_k.append(k)
        step.lp_sampled.append(-0.25 * (req.generated % 4) if k >= 0 else 0.0)
        step.lp_top.append([(token + j) % 128000 for j in range(max(k, 0))])
        step.lp_top_vals.append([-0.25 * (req.generated % 4) - j for j in range(max(k, 0))])
        if token in params.stop_token_ids:
            return Finished(row, FinishReason.STOP, stop_token_id=token)
        if token == EOS and not params.ignore_eos:
            return Finished(row, FinishReason.STOP)
        return Finished(row, FinishReason.LENGTH) if req.generated >= params.max_tokens else None

    @staticmethod
    def _no_token(step: _Step) -> None:
        step.tokens.append(-1)
        step.lp_k.append(-1)
        step.lp_sampled.append(0.0)
        step.lp_top.append([])
        step.lp_top_vals.append([])


def fake_prompt_logprobs(add: AddRequest) -> Logprobs:
    """Prompt token i (1..P-1) gets logprob -i/10, rank 1, top-k led by the token itself."""
    prompt = np.asarray(read_ints(add.prompt_token_ids))[1:]
    k = add.params.prompt_logprobs or 0
    rows = np.arange(len(prompt))
    return Logprobs(
        (-(rows + 1) / 10).astype(np.float32),
        np.ones(len(prompt), np.int32),
        ((prompt[:, None] + np.arange(k)) % 128000).astype(np.int32),
        (-(rows[:, None] + 1) / 10 - np.arange(k)).astype(np.float32),
    )


def serve_as_a_process(hold_s: float) -> None:
    """`python -m tests.unit.fake_engine HOLD_S`: a fake engine in a process of its own, which
    prints its address. On SIGUSR1 its main thread holds the GIL for HOLD_S in one C call, as a
    tokenizer's load does in a real engine: its Python answers nothing meanwhile, while the
    process runs and its ZeroMQ threads (written in C) keep answering."""
    engine = FakeEngine(step_delay=0.01).start()
    libc = ctypes.PyDLL(None)  # a PyDLL's calls keep the GIL
    signal.signal(signal.SIGUSR1, lambda *_: libc.usleep(int(hold_s * 1_000_000)))
    print(engine.address, flush=True)
    while True:
        time.sleep(1.0)


if __name__ == "__main__":
    serve_as_a_process(float(sys.argv[1]))
