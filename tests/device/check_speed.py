"""The engine in-process against a bare forward loop of the same model, and a profile of its
decode steps, each beside its roofline (tests/device/roofline.py) and issue 39's targets.

Throughput, as tests/bench/engine_throughput.py measures it (all requests added at once, greedy,
ignore_eos), at the device's dtype: the engine (with its CUDA graphs, the default; eager,
--enforce-eager; and with graphs and overlapped steps, --async-scheduling) against the bare
loop of tests/device/graph_loop.py (transformers' model with a static KV cache, one batched
prefill then one forward + argmax per token, its decode step captured once as a graph and
replayed; the same loop eagerly). The graph loop is the anchor only where its replays give the
eager loop's tokens (`graph_loop.replays_eager`, checked in float32 and in the device's dtype);
else the eager loop is. Every side gets a warm-up first. For each engine, per decode-only step:
the host's time before it waits for the device, and the time it waits (`StepClock`).

Profile: `batch` requests prefilled, then decode-only steps timed without the profiler and a
few under torch.profiler: the GPU's busy time and kernel launches per step, the share of a
decode step spent outside GPU kernels; then a few mixed steps (a new prompt's prefill beside
the decodes, which the engine runs eagerly today) for their host time.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity
from torch.profiler import profile as torch_profile

from engine_core.engine import EngineCore
from engine_core.layers.host_link import Download
from shared.messages import SamplingParams, StepOutputs
from tests.bench.engine_throughput import make_prompts
from tests.device.context import VARIANTS, Context, EngineRunError, sampled
from tests.device.graph_loop import replay_check, replays_eager, timed_loop
from tests.device.roofline import ModelShape, fraction
from tests.device.targets import all_met, target

DTYPE = "bfloat16"  # the GPU's serving dtype; the dry run runs it too, on the CPU
TARGET_RATIO = 0.9


def throughput(ctx: Context) -> dict[str, Any]:
    s = ctx.sizes
    engines: dict[str, dict[str, Any]] = {}
    for variant in VARIANTS:
        core = ctx.engine(DTYPE, variant)
        vocab = core.facts.vocab_size
        warm = make_prompts(s.batch, s.input_len, vocab, seed=11)
        prompts = make_prompts(s.batch, s.input_len, vocab, seed=12)  # new to the prefix cache
        drive(core, warm, 4, "warm")
        engines[variant] = drive(core, prompts, s.output_len, "tp")
        engines[variant]["graph_replays"] = _graph_replays(core) or 0
        ctx.release(DTYPE)  # one engine's KV cache at a time
    baselines, used = bare_loops(ctx, warm, prompts)
    base = baselines[used]
    shape = ModelShape.of_model(ctx.model, DTYPE)
    for figures in (*engines.values(), *(b for b in baselines.values() if "tok_s" in b)):
        figures["roofline"] = loop_roofline(shape, s.batch, s.input_len, s.output_len, figures)
    ratios = {v: e["tok_s"] / base["tok_s"] for v, e in engines.items()}
    engine = engines["graphs"]
    anchored = used == "hf_static_graph"
    cuda = ctx.device == "cuda"
    targets = [target("the graph loop replays the eager loop", float(anchored), ">=", 1.0,
                      "yes/no", cuda),
               target("engine tok/s over the graph loop's (best variant)",
                      max(ratios.values()) if anchored else None, ">=", TARGET_RATIO, "×",
                      cuda)]
    return {"dtype": DTYPE, "batch": s.batch, "input_len": s.input_len,
            "output_len": s.output_len, "engine": engine, "engine_eager": engines["eager"],
            "engine_async": engines["async"], "baselines": baselines, "baseline_used": used,
            "ratio": ratios["graphs"], "ratio_eager": ratios["eager"],
            "ratio_async": ratios["async"],
            "decode_ratio": engine["decode_tok_s"] / base["decode_tok_s"],
            "targets": targets, "passed": all_met(targets)}


def bare_loops(ctx: Context, warm: list[list[int]],
               prompts: list[list[int]]) -> tuple[dict[str, dict[str, Any]], str]:
    """The bare loop eagerly and from its graph, in the device's dtype, and the check that
    the graph replays the eager loop (also in float32: `graph_loop.replays_eager`); which of
    the two is the anchor."""
    s = ctx.sizes
    model = ctx.hf_model(DTYPE)
    timed_loop(model, warm, 2, graphs=False)  # warm-up
    eager, eager_tokens = timed_loop(model, prompts, s.output_len, graphs=False)
    baselines: dict[str, dict[str, Any]] = {"hf_static_eager": eager}
    try:
        graph, graph_tokens = timed_loop(model, prompts, s.output_len, graphs=True)
        baselines["hf_static_graph"] = graph
        graph["replay"] = replay_check(model, prompts, s.output_len - 1,
                                       (eager_tokens, graph_tokens))
        ctx.release(DTYPE)
        graph["replay_float32"] = replay_check(ctx.hf_model("float32"), prompts,
                                               s.output_len - 1)
        graph["replays_eager"] = replays_eager(graph["replay_float32"], graph["replay"])
    except Exception as exc:  # recorded; the eager loop still gives a ratio
        baselines.setdefault("hf_static_graph", {})["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        ctx.release()
    used = ("hf_static_graph" if baselines["hf_static_graph"].get("replays_eager")
            else "hf_static_eager")
    return baselines, used


def loop_roofline(shape: ModelShape, batch: int, input_len: int, output_len: int,
                  figures: dict[str, Any]) -> dict[str, Any]:
    """A run's figures against its floor: the decode step at its mean context over the memory
    bandwidth, the whole run (prefill at the FLOP peak, then the decode steps)."""
    step_floor = shape.decode_step_floor_s(batch, input_len + output_len / 2)
    run_floor = shape.run_floor_s(batch, batch, input_len, output_len)
    decode_tok_s = figures["decode_tok_s"]
    step_s = batch / decode_tok_s if decode_tok_s else 0.0
    return {"decode_step_ms": 1e3 * step_s, "decode_step_floor_ms": 1e3 * step_floor,
            "decode_fraction": fraction(step_floor, step_s),
            "run_floor_tok_s": batch * output_len / run_floor,
            "run_fraction": fraction(run_floor, batch * output_len / figures["tok_s"])}


class StepClock:
    """Per step of an engine: the host's time until it waits for the device (the download
    of the step's tokens, `Download.wait`) and the time inside that wait."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self._wait = 0.0

    def __enter__(self) -> StepClock:
        self._real = Download.wait
        clock = self

        def timed_wait(download: Download) -> Any:
            start = time.perf_counter()
            try:
                return clock._real(download)
            finally:
                clock._wait += time.perf_counter() - start

        Download.wait = timed_wait  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        Download.wait = self._real  # type: ignore[method-assign]

    def step(self, core: EngineCore) -> tuple[dict[bytes, StepOutputs], float, float]:
        """One engine step: its outputs, host seconds before the wait, seconds waiting."""
        self._wait = 0.0
        start = time.perf_counter()
        outputs = core.step()
        wall = time.perf_counter() - start
        return outputs, wall - self._wait, self._wait


def drive(core: EngineCore, prompts: list[list[int]], output_len: int,
          tag: str) -> dict[str, Any]:
    """Run `prompts` to the end; tokens/s over the whole run and over the decode-only part
    (from the step after which every request had its first token), and the decode steps'
    median host and wait times. Every request must get its `output_len` tokens and no step
    may fail (else EngineRunError: the stage fails)."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    errors = core.stats().step_errors
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        core.add_request(f"{tag}{i}", prompt, params)
    started: set[str] = set()
    generated = steps = at_decode = 0
    decode_start = None
    hosts: list[float] = []
    waits: list[float] = []
    with StepClock() as clock:
        while core.has_work:
            outputs, host, wait = clock.step(core)
            generated += sampled(outputs, started if decode_start is None else None)
            steps += 1
            if decode_start is not None:
                hosts.append(host)
                waits.append(wait)
            if decode_start is None and len(started) == len(prompts):
                decode_start, at_decode = time.perf_counter(), generated
    end = time.perf_counter()
    errors = core.stats().step_errors - errors
    if errors or generated != len(prompts) * output_len:
        raise EngineRunError(f"{tag}: {generated} of {len(prompts) * output_len} tokens, "
                             f"{errors} failed step(s)")
    decode_s = end - (decode_start or end)
    return {"steps": steps, "seconds": end - start, "tokens": generated,
            "tok_s": generated / (end - start),
            "decode_tok_s": (generated - at_decode) / decode_s if decode_s else 0.0,
            "decode_host_ms": 1e3 * float(np.median(hosts)) if hosts else 0.0,
            "decode_wait_ms": 1e3 * float(np.median(waits)) if waits else 0.0}


def profile(ctx: Context) -> dict[str, Any]:
    s = ctx.sizes
    core = ctx.engine(DTYPE)
    vocab = core.facts.vocab_size
    prompts = make_prompts(s.batch, s.input_len, vocab, seed=13)
    params = SamplingParams(max_tokens=2 * s.timed_steps + s.profile_steps + s.mixed_steps + 4,
                            temperature=0.0, ignore_eos=True)
    errors = core.stats().step_errors
    for i, prompt in enumerate(prompts):
        core.add_request(f"prof{i}", prompt, params)
    started: set[str] = set()
    while len(started) < len(prompts):
        sampled(core.step(), started)
    core.step()  # a first decode-only step, untimed
    with StepClock() as clock:
        split = [clock.step(core)[1:] for _ in range(s.timed_steps)]
    walls = [_timed_step(core) for _ in range(s.timed_steps)]
    cuda = ctx.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        profiled = [_timed_step(core) for _ in range(s.profile_steps)]
    mixed = mixed_steps(core, make_prompts(s.mixed_steps, s.input_len, vocab, seed=14))
    while core.has_work:
        core.step()
    if core.stats().step_errors != errors:
        raise EngineRunError(f"{core.stats().step_errors - errors} engine step(s) failed")
    figures = step_figures(prof.key_averages(), walls, profiled, s.profile_steps)
    figures["host_ms"] = 1e3 * float(np.median([h for h, _ in split]))
    figures["wait_ms"] = 1e3 * float(np.median([w for _, w in split]))
    # the walls' median step: the prompt, the prefill's token, the untimed step, the split
    context = s.input_len + 2 + s.timed_steps + s.timed_steps // 2
    floor_s = ModelShape.of_model(ctx.model, DTYPE).decode_step_floor_s(s.batch, context)
    figures |= {"context": context, "floor_ms": 1e3 * floor_s,
                "roofline_fraction": fraction(1e3 * floor_s, figures["wall_ms"]), **mixed}
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=40, max_name_column_width=70)
    header = "\n".join(f"{k}: {v}" for k, v in figures.items())
    (ctx.out / "profile.txt").write_text(
        f"{s.profile_steps} decode steps at batch {s.batch}, {DTYPE} on {ctx.device}\n"
        f"{header}\n\n{table}\n")
    targets = [
        target(f"decode step at batch {s.batch}", figures["wall_ms"], "<=", 1.2, "ms", cuda),
        target("decode step over its memory roofline", figures["roofline_fraction"], ">=",
               0.6, "×", cuda),
        target("GPU kernels a decode step", figures.get("kernels_per_step"), "<=", 200, "",
               cuda),
        target("decode step outside GPU kernels", figures.get("outside_gpu_share"), "<=", 0.1,
               "share", cuda),
        target("host time of a mixed step (prefill + decodes)", figures["mixed_host_ms"], "<=",
               2.5, "ms", cuda)]
    return {"batch": s.batch, "steps": s.profile_steps, **figures, "targets": targets,
            "passed": all_met(targets)}


def mixed_steps(core: EngineCore, prompts: list[list[int]]) -> dict[str, Any]:
    """Steps that take a new prompt's whole prefill beside the running decodes, one prompt a
    step: their host time before the wait, their wall time, and how many graph replays they
    made (none while mixed steps run eagerly)."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    replays = _graph_replays(core)
    hosts, walls = [], []
    with StepClock() as clock:
        for i, prompt in enumerate(prompts):
            core.add_request(f"mixed{i}", prompt, params)
            start = time.perf_counter()
            _, host, _ = clock.step(core)
            walls.append(time.perf_counter() - start)
            hosts.append(host)
    after = _graph_replays(core)
    return {"mixed_steps": len(prompts), "mixed_host_ms": 1e3 * float(np.median(hosts)),
            "mixed_wall_ms": 1e3 * float(np.median(walls)),
            "mixed_graph_replays": None if replays is None or after is None else after - replays}


def _graph_replays(core: EngineCore) -> int | None:
    """The runner's graph replays so far, where it counts them."""
    graphs = getattr(core.runner, "graphs", None)
    replays = getattr(graphs, "replays", None)
    return sum(replays.values()) if isinstance(replays, dict) else None


def _timed_step(core: EngineCore) -> float:
    start = time.perf_counter()
    core.step()  # returns host data: the step's device work is done
    return time.perf_counter() - start


def step_figures(events: Any, walls: list[float], profiled: list[float],
                 steps: int) -> dict[str, float]:
    """Per decode step: wall time (without and with the profiler), the CPU's own op time, and
    the GPU's busy time (kernels, copies) with the share of the step outside kernels."""
    wall_ms = 1e3 * float(np.median(walls)) if walls else 0.0
    figures = {"wall_ms": wall_ms, "profiled_wall_ms": 1e3 * float(np.median(profiled))}
    device = [e for e in events if e.device_type == DeviceType.CUDA]
    if not device:
        return figures
    def busy_ms(chosen: list[Any]) -> float:
        return sum(e.self_device_time_total for e in chosen) / 1e3 / steps
    kernels = [e for e in device if not e.key.startswith(("Memcpy", "Memset"))]
    figures["gpu_busy_ms"] = busy_ms(device)
    figures["gpu_kernel_ms"] = busy_ms(kernels)
    figures["kernels_per_step"] = sum(e.count for e in kernels) / steps
    figures["outside_gpu_share"] = 1 - figures["gpu_kernel_ms"] / wall_ms if wall_ms else 1.0
    return figures
