"""Constrained (JSON schema) against free requests, in-process, in one run.

    .venv/bin/python tests/bench/structured_throughput.py [--model DIR] [--num-requests 64]
        [--input-len 64] [--output-len 128] [--concurrency 16] [--threads N]

Three engines run in one process, each its own workload on the same prompts: every request
free, every request constrained by SCHEMA (compiled in advance), and every other request
constrained ("mixed"). Each has `--concurrency` as its max_num_seqs and all its requests added
at once (temperature 1.0, ignore_eos: a grammar's end still finishes a constrained request).
They step in lockstep, one step each in turn (the order rotating), so other jobs on a shared
machine slow the three alike and their ratios hold, while absolute figures do not.

Each engine keeps its own clocks (the wall-clock and the process's CPU time of its steps
alone). Reported per workload, on both clocks: output tokens per second; the mean time per
output token (TPOT, a request's first token to its last) of its requests (the free ones, for
mixed), which counts the prefills of the requests that replace those a grammar ended early; and
the median time of a step of `--concurrency` decodes and nothing else, the cost of the grammar
work alone. Then the ratios the targets are about: constrained / free throughput, and free
requests beside constrained ones / all free. Also reported: the time to compile the first
constraint (the tokenizer's table built with it) and then a schema not seen before.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from engine_core.config import EngineConfig
from engine_core.engine import EngineCore
from engine_core.worker.default_model import ensure_model
from shared.messages import SamplingParams, StructuredOutput
from shared.step_outputs import unpack_step

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}}}
CONSTRAINT = StructuredOutput("json", json.dumps(SCHEMA), True)


@dataclass
class Workload:
    """One engine, and its own clocks: the wall-clock and CPU time of its steps alone."""

    name: str
    core: EngineCore
    constrained: set[int]
    tokens: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    stamps: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # per token
    full_decodes: list[tuple[float, float]] = field(default_factory=list)  # steps of max rows

    def add(self, prompts: list[list[int]], output_len: int) -> None:
        for i, prompt in enumerate(prompts):
            self.core.add_request(f"{self.name}-{i}", prompt, SamplingParams(
                max_tokens=output_len, temperature=1.0, seed=i, ignore_eos=True,
                structured=CONSTRAINT if i in self.constrained else None))

    def step(self, rows: int) -> None:
        """One step; a step of `rows` decodes and nothing else is kept in `full_decodes`."""
        running = self.core.scheduler.running
        full = len(running) == rows and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in running)
        wall, cpu = time.perf_counter(), time.process_time()
        outputs = self.core.step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        self.wall_s, self.cpu_s = self.wall_s + wall, self.cpu_s + cpu
        if full:
            self.full_decodes.append((wall, cpu))
        for out in outputs.values():
            for row in unpack_step(out):
                if row.token_id is not None:
                    self.tokens += 1
                    self.stamps.setdefault(row.request_id, []).append((self.wall_s, self.cpu_s))

    def throughput(self, cpu: bool) -> float:
        return self.tokens / (self.cpu_s if cpu else self.wall_s)

    def decode_step(self, cpu: bool) -> float:
        """The median time of its steps of max_num_seqs decodes."""
        return statistics.median(step[cpu] for step in self.full_decodes)

    def tpot(self, constrained: bool, cpu: bool) -> float:
        """The mean time per output token (first to last) of its free or constrained requests."""
        chosen = {f"{self.name}-{i}" for i in self.constrained}
        return statistics.mean((t[-1][cpu] - t[0][cpu]) / (len(t) - 1)
                               for rid, t in self.stamps.items()
                               if (rid in chosen) == constrained and len(t) > 1)


def compile_latency(core: EngineCore) -> tuple[float, float]:
    """Seconds to compile CONSTRAINT on a fresh compiler (its tokenizer table built first), then
    a schema it has not seen."""
    other = StructuredOutput("json", json.dumps({**SCHEMA, "required": ["name"]}), True)
    spent = []
    for constraint in (CONSTRAINT, other):
        start = time.perf_counter()
        grammar = core.grammars.grammar_for(constraint)
        grammar.wait(120)
        assert grammar.error is None, grammar.error
        spent.append(time.perf_counter() - start)
    return spent[0], spent[1]


def run_lockstep(workloads: list[Workload], rows: int) -> None:
    turn = 0
    while any(w.core.has_work for w in workloads):
        for w in workloads[turn % 3:] + workloads[:turn % 3]:
            if w.core.has_work:
                w.step(rows)
        turn += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="model folder (default: the embedded tiny Llama)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's own choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = args.model or str(ensure_model())
    blocks = args.concurrency * (-(-(args.input_len + args.output_len) // 16) + 1)
    n = args.num_requests
    workloads = [Workload(name, EngineCore(EngineConfig(
        model=model, max_num_seqs=args.concurrency, num_kv_blocks=blocks,
        num_threads=torch.get_num_threads())), chosen)
        for name, chosen in (("free", set()), ("constrained", set(range(n))),
                             ("mixed", set(range(1, n, 2))))]
    first, new = compile_latency(workloads[1].core)
    compile_latency(workloads[2].core)
    print(f"model {model}: {n} requests x {args.input_len} in + {args.output_len} out, "
          f"concurrency {args.concurrency}, torch threads {torch.get_num_threads()}\n"
          f"compile: first constraint {first * 1e3:.0f} ms (tokenizer table included), "
          f"then a new schema {new * 1e3:.0f} ms")
    rng = random.Random(0)
    vocab = workloads[0].core.facts.vocab_size
    prompts = [[rng.randrange(1000, vocab - 1000) for _ in range(args.input_len)]
               for _ in range(n)]
    for w in workloads:  # warm-up, not counted
        w.add(prompts[:args.concurrency], 16)
    run_lockstep(workloads, args.concurrency)
    for w in workloads:
        w.tokens, w.wall_s, w.cpu_s = 0, 0.0, 0.0
        w.stamps.clear()
        w.full_decodes.clear()
        w.add(prompts, args.output_len)
    run_lockstep(workloads, args.concurrency)
    report(*workloads)


def report(free: Workload, constrained: Workload, mixed: Workload) -> None:
    print(f"\n{'':12}{'tokens':>7}{'tok/s':>7}{'TPOT':>7}{'step':>7}"
          f"{'CPU tok/s':>11}{'TPOT':>7}{'step':>7}")
    for w in (free, constrained, mixed):
        con = w is constrained
        print(f"{w.name:12}{w.tokens:7}" + "".join(
            f"{w.throughput(cpu):{11 if cpu else 7}.0f}{w.tpot(con, cpu) * 1e3:7.2f}"
            f"{w.decode_step(cpu) * 1e3:7.2f}" for cpu in (False, True)))
    print("(TPOT: mean per request, of its free requests for mixed; step: median of the steps of"
          " max_num_seqs decodes; ms)")
    for cpu, clock in ((False, "wall clock"), (True, "CPU time")):
        print(f"{clock}: constrained / free throughput "
              f"{constrained.throughput(cpu) / free.throughput(cpu):.3f}; free requests beside "
              f"constrained / all free: TPOT {mixed.tpot(False, cpu) / free.tpot(False, cpu):.3f}"
              f", decode step {mixed.decode_step(cpu) / free.decode_step(cpu):.3f}")


if __name__ == "__main__":
    main()
