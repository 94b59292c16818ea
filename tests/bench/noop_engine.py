"""A no-op engine core for frontend benchmarks: the real ZeroMQ protocol, tokens at once.

    .venv/bin/python tests/bench/noop_engine.py [--listen tcp://127.0.0.1:0] [--model DIR]
        [--ready-file F] [--step-interval S]

It binds a ROUTER like `engine_core.process`, answers Hello with Ready (the tokenizer is the
model folder, by default the embedded tiny Llama of
`engine_core.worker.default_model.ensure_model()`; vocab, BOS, EOS and context length come from
its config.json), and "generates" with no model:
token k of a request is its prompt's token k (BOS left out), cycling, so detokenized text is
real text of the benchmark's vocabulary. Each loop iteration is one step: it takes every frame
waiting, then sends one StepOutputs per frontend with one token for every running request of
that frontend. Nothing waits between steps (unless --step-interval), so a request's tokens
leave as fast as the loop runs and the frontends alone limit the throughput.

Honoured: max_tokens (0: nothing sampled, finish "length"), stop_token_ids, EOS unless
ignore_eos (neither before min_tokens), logprobs (the sampled token first in its top-k, rank 1)
and prompt_logprobs (once, in the request's first step), abort and stop, the "ping" and "stats"
utilities ("stats" also counts steps, messages and rows sent, for rows per message). Outputs are
precomputed per request at AddRequest (numpy), so a step costs one small loop over its rows.

With --ready-file, the bound address is written there once listening (with tcp port 0 the OS
picks the port). SIGTERM/SIGINT stop it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq

from shared.messages import (
    AbortRequest,
    AddRequest,
    EngineStats,
    Finished,
    FinishReason,
    Hello,
    MetricsReport,
    Ready,
    StepOutputs,
    StopRequest,
    UtilityRequest,
    UtilityResult,
)
from shared.step_outputs import Logprobs, pack_step
from shared.transport import InputCodec, OutputCodec, configure

TOP_ID_MODULUS = 128000  # fake top-k ids stay below the Llama 3 special tokens


@dataclass(eq=False)
class _Request:
    """One running request and every output it will ever produce, precomputed."""

    rid: str
    owner: bytes
    tokens: list[int]  # what it emits, one per step; empty for max_tokens 0
    finish: FinishReason  # reason sent with the last token
    stop_token_id: int | None
    k: int  # -1: no logprobs
    sampled: list[float]
    top_ids: np.ndarray  # int32 [len(tokens), k]
    top_vals: np.ndarray  # float32 [len(tokens), k]
    prompt_lp: Logprobs | None  # sent in the first step
    pos: int = 0


def plan_request(add: AddRequest, owner: bytes, bos: int | None, eos: list[int]) -> _Request:
    """Everything `add` will produce: tokens (cut at a stop token), logprobs, prompt logprobs."""
    params = add.params
    prompt = np.frombuffer(add.prompt_token_ids, dtype="<i4")
    source = prompt[prompt != bos] if bos is not None else prompt
    if len(source) == 0:
        source = prompt if len(prompt) else np.asarray([1000], dtype=np.int32)
    tokens = np.resize(source, max(params.max_tokens, 0)).astype(np.int32)
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
    finish, stop_token_id = FinishReason.LENGTH, None
    if stops and len(tokens):
        hits = np.isin(tokens, sorted(stops))
        hits[: params.min_tokens] = False
        if hits.any():
            last = int(np.argmax(hits))
            tokens = tokens[: last + 1]
            finish = FinishReason.STOP
            if int(tokens[last]) in params.stop_token_ids:
                stop_token_id = int(tokens[last])
    k = -1 if params.logprobs is None else params.logprobs
    n = len(tokens)
    sampled = (-0.25 * (np.arange(1, n + 1) % 4)).astype(np.float32)
    width = max(k, 0)
    top_ids = ((tokens[:, None] + np.arange(width, dtype=np.int32)) % TOP_ID_MODULUS).astype(
        np.int32
    )
    top_vals = (sampled[:, None] - np.arange(width, dtype=np.float32)).astype(np.float32)
    prompt_lp = None
    if params.prompt_logprobs is not None:
        rest = prompt[1:]
        pk = params.prompt_logprobs
        lps = (-(np.arange(len(rest)) + 1) / 10).astype(np.float32)
        p_ids = (rest[:, None] + np.arange(pk, dtype=np.int32)) % TOP_ID_MODULUS
        p_vals = lps[:, None] - np.arange(pk, dtype=np.float32)
        prompt_lp = Logprobs(lps, np.ones(len(rest), dtype=np.int32), p_ids.astype(np.int32),
                             p_vals.astype(np.float32))
    return _Request(
        add.request_id,
        owner,
        tokens.tolist(),
        finish,
        stop_token_id,
        k,
        sampled.tolist(),
        top_ids,
        top_vals,
        prompt_lp,
    )


class NoopEngine:
    """The ROUTER and the loop; `run()` blocks until `stop()` (from a thread or a signal)."""

    def __init__(self, listen: str, ready: Ready, step_interval: float = 0.0) -> None:
        self.ready = ready
        self.step_interval = step_interval
        self.running: dict[str, _Request] = {}
        self.stats = EngineStats()
        self._stopping = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        configure(self._sock)
        self._sock.bind(listen)
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._in, self._out = InputCodec(), OutputCodec()

    def stop(self) -> None:
        self._stopping.set()

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

    def run(self) -> None:
        next_step = 0.0
        while not self._stopping.is_set():
            wait_ms = 100  # idle: block, but wake to notice stop()
            if self.running:
                wait_ms = max(0, int((next_step - time.perf_counter()) * 1000))
            if self._sock.poll(wait_ms):
                self._drain()
            if self.running and time.perf_counter() >= next_step:
                next_step = time.perf_counter() + self.step_interval
                self._step()

    def _drain(self) -> None:
        while True:
            try:
                owner, frame = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self._in.decode(frame)
            except msgspec.DecodeError:  # dropped, as the real engine does
                continue
            self._handle(owner, msg)

    def _send(self, owner: bytes, msg: Any) -> None:
        self._sock.send_multipart([owner, self._out.encode(msg)])

    def _handle(self, owner: bytes, msg: Any) -> None:
        if isinstance(msg, AddRequest):
            self.stats.request_prompt_tokens += len(msg.prompt_token_ids) // 4
            self.running[msg.request_id] = plan_request(
                msg, owner, self.ready.bos_token_id, self.ready.eos_token_ids
            )
        elif isinstance(msg, (AbortRequest, StopRequest)):
            reason = FinishReason.STOP if isinstance(msg, StopRequest) else FinishReason.ABORT
            for rid in msg.request_ids:
                if self.running.pop(rid, None) is not None:
                    _count(self.stats.finished, reason)
        elif isinstance(msg, Hello):
            self._send(owner, self.ready)
        elif isinstance(msg, UtilityRequest):
            if msg.method == "ping":
                self._send(owner, UtilityResult(msg.call_id))
            elif msg.method == "stats":
                stats = msgspec.structs.replace(
                    self.stats, running=len(self.running), num_requests=len(self.running))
                self._send(owner, UtilityResult(msg.call_id, stats))
            else:
                self._send(owner, UtilityResult(msg.call_id, error=f"unknown {msg.method!r}"))
        elif isinstance(msg, MetricsReport):
            pass  # latency histograms: not kept here

    def _step(self) -> None:
        by_owner: dict[bytes, list[_Request]] = {}
        for req in self.running.values():
            by_owner.setdefault(req.owner, []).append(req)
        for owner, reqs in by_owner.items():
            self._send(owner, self._message(reqs))
        self.stats.steps += 1
        self.stats.output_messages += len(by_owner)

    def _message(self, reqs: list[_Request]) -> StepOutputs:
        """One step of `reqs` (one frontend's running requests) as columnar StepOutputs."""
        n = len(reqs)
        tokens = np.full(n, -1, np.int32)
        lp_k = np.full(n, -1, np.int32)
        width = max((req.k for req in reqs), default=0)
        lps = Logprobs(np.zeros(n, np.float32), np.ones(n, np.int32),
                       np.zeros((n, max(width, 0)), np.int32),
                       np.zeros((n, max(width, 0)), np.float32))
        prompt_lps: dict[int, Logprobs] = {}
        finished: list[Finished] = []
        for row, req in enumerate(reqs):
            if req.prompt_lp is not None:
                prompt_lps[row], req.prompt_lp = req.prompt_lp, None
            pos = req.pos
            if pos < len(req.tokens):  # else max_tokens 0: nothing sampled
                tokens[row] = req.tokens[pos]
                if req.k >= 0:
                    lp_k[row] = req.k
                    lps.logprobs[row] = req.sampled[pos]
                    lps.top_ids[row, : req.k] = req.top_ids[pos]
                    lps.top_logprobs[row, : req.k] = req.top_vals[pos]
                req.pos = pos = pos + 1
            if pos >= len(req.tokens):
                finished.append(Finished(row, req.finish, req.stop_token_id))
                del self.running[req.rid]
                _count(self.stats.finished, req.finish)
        self.stats.output_rows += n
        self.stats.generation_tokens += int((tokens >= 0).sum())
        return pack_step([req.rid for req in reqs], tokens, logprobs=lps, lp_k=lp_k,
                         prompt_logprobs=prompt_lps, finished=finished)


def _count(counts: dict[FinishReason, int], reason: FinishReason) -> None:
    counts[reason] = counts.get(reason, 0) + 1


def ready_for(model: str, name: str, max_model_len: int | None = None) -> Ready:
    """Ready for a model folder: its config.json's vocab, BOS, EOS and context length."""
    config = json.loads((Path(model) / "config.json").read_text())
    eos = config.get("eos_token_id")
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return Ready(
        model=name,
        tokenizer=model,
        max_model_len=max_model_len or int(config.get("max_position_embeddings", 2048)),
        vocab_size=int(config["vocab_size"]),
        eos_token_ids=eos_ids,
        bos_token_id=config.get("bos_token_id"),
        engine_pid=os.getpid(),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--listen", default="tcp://127.0.0.1:0", help="ROUTER address")
    parser.add_argument("--model", help="model folder (default: the embedded tiny Llama)")
    parser.add_argument("--served-model-name", help="default: the model folder's name")
    parser.add_argument("--max-model-len", type=int, help="default: the model's")
    parser.add_argument("--ready-file", help="write the bound address here once listening")
    parser.add_argument(
        "--step-interval", type=float, default=0.0, help="seconds between steps (0: none)"
    )
    args = parser.parse_args(argv)
    name = args.served_model_name
    if args.model is None:
        from engine_core.worker.default_model import DEFAULT, ensure_model

        args.model, name = str(ensure_model()), name or DEFAULT.name
    ready = ready_for(args.model, name or Path(args.model).name, args.max_model_len)
    engine = NoopEngine(args.listen, ready, args.step_interval)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: engine.stop())
    if args.ready_file:
        tmp = f"{args.ready_file}.tmp"
        Path(tmp).write_text(engine.address)
        os.replace(tmp, args.ready_file)
    try:
        engine.run()
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
