"""The frontend's Python path per streamed token, in one process, without sockets.

    .venv/bin/python tests/bench/frontend_path.py [--streams 256] [--input-len 64]
        [--output-len 128] [--rounds 5] [--workloads plain echo+lp5] [--repo DIR]

`frontend_only.py` measures a whole frontend process against the no-op engine over loopback
TCP; its CPU per token moves by ±2 µs from run to run with how much the frontend merges and
what else the 2 cores do, which hides any change below ~1 µs. This script times the same
Python code with nothing else around it, on the tokenizer of the embedded default model:

- `request`: per request, decoding, checking, tokenizing and planning a body
  (`ServingCompletions.read`) with a random prompt of --input-len tokens;
- `stream`: per streamed token, engine frames (`StepOutputs` as msgpack bytes, one per step
  for all streams) through `EngineClient._handle`/`_notify` into each request's `ChoiceRun`
  and `EventPump`, out as chunk bytes to a transport that only counts them: one token per
  chunk (no merging), the client keeping up;

for two workloads, plain and echo + logprobs 5 (the prompt's logprobs arrive with the first
step, as the engine sends them). The garbage collector is set as a frontend sets it
(`frontend.memory.settle_gc`). Printed: the least over --rounds rounds after a first, warming
one (token strings and byte pieces cached, as in a frontend that has served a while).
--repo DIR imports the frontend from another checkout (e.g. `git worktree add /tmp/base main`)
for a before/after pair; run the two in turn, more than once.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


class CountingSSE:
    """An SSEWriter's surface for EventPump, writing nowhere."""

    def __init__(self) -> None:
        self.writes = 0
        self.bytes = 0

    def encode(self, payload: Any) -> bytes:
        return payload  # chunks_of gives bytes already

    def can_write_now(self) -> bool:
        return True

    def write_now(self, payloads: list[bytes]) -> None:
        self.writes += 1
        self.bytes += sum(map(len, payloads))

    async def send_all(self, payloads: list[bytes]) -> None:
        self.write_now(payloads)


def prompts(tokenizer: Any, count: int, length: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    vocab = len(tokenizer)
    return [tokenizer.decode([rng.randrange(1000, vocab - 1000) for _ in range(length)])
            for _ in range(count)]


def engine_frames(rids: list[str], prompt_lens: list[int], steps: int, echo: bool,
                  seed: int) -> list[bytes]:
    """What an engine sends: one StepOutputs per step for every stream, the last finishing.
    Tokens and alternatives are drawn from 8000 ids, which the first round caches (a frontend
    that has served a while has its frequent tokens' strings and bytes cached)."""
    import numpy as np

    from shared.messages import Finished, FinishReason
    from shared.step_outputs import Logprobs, pack_step
    from shared.transport import OutputCodec

    gen, codec, n = np.random.default_rng(seed), OutputCodec(), len(rids)
    frames = []
    for step in range(steps):
        tokens = gen.integers(1000, 9000, n, dtype=np.int32)
        logprobs = lp_k = prompt = None
        if echo:
            logprobs = Logprobs(-gen.random(n, np.float32), np.ones(n, np.int32),
                                gen.integers(1000, 9000, (n, 5), dtype=np.int32),
                                np.sort(-gen.random((n, 5), np.float32), axis=1))
            lp_k = np.full(n, 5, np.int32)
            if step == 0:
                prompt = {i: Logprobs(-gen.random(p - 1, np.float32), np.ones(p - 1, np.int32),
                                      gen.integers(1000, 9000, (p - 1, 5), dtype=np.int32),
                                      np.sort(-gen.random((p - 1, 5), np.float32), axis=1))
                          for i, p in enumerate(prompt_lens)}
        finished = [Finished(i, FinishReason.LENGTH) for i in range(n)] if step == steps - 1 else []
        frames.append(codec.encode(pack_step(rids, tokens, logprobs=logprobs, lp_k=lp_k,
                                             prompt_logprobs=prompt, finished=finished)))
    return frames


async def one_round(served: Any, bodies: list[bytes], steps: int, echo: bool,
                    seed: int) -> tuple[float, float]:
    """(µs per request to read and plan, µs per streamed token through the stream path)."""
    from frontend.engine.client import EngineClient
    from frontend.memory import settle_gc
    try:
        from frontend.openai.completions.endpoint import ChunkTemplate, ServingCompletions
        from frontend.openai.serving.choices import ChoiceRun, EventPump
    except ImportError:  # a checkout before frontend/openai/ had packages
        from frontend.openai.completions import ChunkTemplate, ServingCompletions  # type: ignore
        from frontend.openai.serving import ChoiceRun, EventPump  # type: ignore

    client = EngineClient("tcp://127.0.0.1:9")  # never connected: nothing is sent
    client._healthy = True
    client._send = lambda msg: None  # type: ignore[method-assign]
    serving = ServingCompletions(client, served)  # type: ignore[arg-type]
    settle_gc()
    started = time.perf_counter()
    plans = [serving.read(body)[1] for body in bodies]
    per_request = (time.perf_counter() - started) / len(bodies)
    tasks = []
    for plan in plans:
        run = ChoiceRun(client, plan.choices)  # type: ignore[arg-type]
        run.start()
        template = ChunkTemplate(plan.id, plan.created, plan.model, echo)
        chunks_of = getattr(template, "chunks_of", None) or (  # (a checkout before it had one)
            lambda index, delta, template=template: [] if delta.is_empty
            else [template.chunk(index, delta)])
        pump = EventPump(run, CountingSSE(), chunks_of)  # type: ignore[arg-type]
        tasks.append(asyncio.create_task(pump.run()))
    rids = [plan.choices[0].request_id for plan in plans]
    frames = engine_frames(rids, [len(p.prompts[0]) for p in plans], steps, echo, seed)
    for _ in range(3):
        await asyncio.sleep(0)  # every pump parks, waiting for its first outputs
    settle_gc()
    started = time.perf_counter()
    for frame in frames:
        client._handle(frame)
        client._notify()
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    per_token = (time.perf_counter() - started) / (len(bodies) * steps)
    return per_request * 1e6, per_token * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds (after a warm one)")
    parser.add_argument("--repo", type=Path, default=REPO, help="the checkout to import")
    parser.add_argument("--workloads", nargs="+", choices=["plain", "echo+lp5"],
                        default=["plain", "echo+lp5"])
    args = parser.parse_args()
    sys.path.insert(0, str(args.repo.resolve()))
    from engine_core.worker.default_model import ensure_model
    from frontend.bench.workload import load_tokenizer
    try:
        from frontend.openai.serving.served_model import ServedModel
    except ImportError:  # a checkout before frontend/openai/ had packages
        from frontend.openai.served_model import ServedModel  # type: ignore

    tokenizer = load_tokenizer(str(ensure_model()))
    served = ServedModel(tokenizer, "m", 8192, len(tokenizer))
    texts = prompts(tokenizer, args.streams, args.input_len, seed=0)
    import frontend
    from tests.bench.frontend_only import cpu_model

    print(f"{args.streams} streams x {args.output_len} tokens, {args.input_len}-token prompts; "
          f"frontend from {Path(frontend.__file__).parents[1]}; {cpu_model()}, "
          f"load {os.getloadavg()[0]:.2f}")
    for name, extra in (("plain", {}), ("echo+lp5", {"echo": True, "logprobs": 5})):
        if name not in args.workloads:
            continue
        bodies = [json.dumps({"model": "m", "prompt": text, "max_tokens": args.output_len,
                              "stream": True, **extra}).encode() for text in texts]
        rounds = [asyncio.run(one_round(served, bodies, args.output_len, bool(extra), seed))
                  for seed in range(args.rounds + 1)][1:]
        request, token = min(r[0] for r in rounds), min(r[1] for r in rounds)
        print(f"  {name:<9} request {request:6.0f} us ({request / args.output_len:4.2f} us a "
              f"streamed token)   stream {token:5.2f} us a token   "
              f"(all rounds: {', '.join(f'{r[1]:.2f}' for r in rounds)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
