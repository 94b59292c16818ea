"""The device check's dry run: `make gpu-check` without a GPU runs every stage on the CPU at a
tiny size, so the one-command check stays ready for when a GPU is lent (docs/gpu.md). Through
the same shell wrapper the device runs, in its own process (the check sets torch's threads and
a SIGALRM time guard)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine_core.worker.default_model import cache_root
from tests.device.gpu_check import DRY_SIZES, STAGES

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path, str]:
    out = tmp_path_factory.mktemp("gpu-check")
    models = os.environ.get("TANDEM_TEST_CACHE") or tmp_path_factory.getbasetemp() / "models"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable,
           "TANDEM_CACHE": str(cache_root())}  # the LM head's compiled kernels, as elsewhere
    done = subprocess.run(["bash", str(ROOT / "tests/device/gpu_check.sh"), "--dry-run",
                           "--cache", str(models)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=420, check=False)
    return done.returncode, out, done.stdout + done.stderr


def test_every_stage_runs_and_parity_holds(dry_run: tuple[int, Path, str]) -> None:
    code, out, log = dry_run
    assert code == 0, log[-4000:]
    stages = json.loads((out / "gpu_check.json").read_text())["stages"]
    assert list(stages) == list(STAGES)
    assert all(record["ok"] for record in stages.values()), stages
    assert stages["kernels"]["passed"] and not stages["kernels"]["fallbacks"]
    assert set(stages["kernels"]["kernels"]) == {"flash_varlen", "triton_decode", "write_kv",
                                                 "add_rms_norm", "silu_mul", "rope_cache"}
    assert stages["parity_fp32"]["passed"] and stages["parity_fp32"]["chunked_prefills"] > 0
    assert stages["parity_bf16"]["passed"]
    structured = stages["structured"]
    assert structured["passed"] and structured["finished"]["stop"] > 0
    # the speed's rows stay to the end: every step after the prefill decodes the whole batch
    assert structured["full_steps"] >= DRY_SIZES.structured_new_tokens - 3
    throughput = stages["throughput"]
    for variant in ("engine", "engine_eager", "engine_async"):
        assert throughput[variant]["tokens"] == DRY_SIZES.batch * DRY_SIZES.output_len
        assert 0 < throughput[variant]["roofline"]["decode_step_floor_ms"]
    # the GPU's code paths rehearsed: graphs (their stand-in) replayed, but not when eager
    assert throughput["engine_async"]["graph_replays"] > 0
    assert throughput["engine_eager"]["graph_replays"] == 0
    spec = stages["spec"]  # the copying model copies, and n-gram drafts were accepted
    assert int(spec["chain_tokens_followed"].split("/")[0]) >= 16
    assert 0 < spec["spec_accepted_tokens"] <= spec["spec_draft_tokens"]
    assert len(spec["targets"]) == 2 and spec["batch_tok_s"]["ngram"] > 0
    fp8 = stages["fp8"]  # the GPU's fp8 products (torch._scaled_mm) rehearsed on the CPU
    assert fp8["engines"]["fp8"]["linear"] == "scaled_mm"
    assert fp8["engines"]["bf16"]["linear"] != "scaled_mm"
    for engine in fp8["engines"].values():
        assert engine["batch"]["tokens"] == DRY_SIZES.fp8_batch * DRY_SIZES.fp8_output_len
        assert engine["decode_step_ms"] > 0
    assert fp8["scored_tokens"] == DRY_SIZES.fp8_prompts * DRY_SIZES.fp8_new_tokens
    assert 0.5 <= fp8["argmax_agreement"]["fp8"] <= 1 and len(fp8["targets"]) == 3
    lora = stages["lora"]  # both batches decoded every step, the adapters loaded once each
    assert lora["decode_steps"] == {"base": DRY_SIZES.lora_output_len - 1,
                                    "mixed": DRY_SIZES.lora_output_len - 1}
    assert lora["adapter_loads"] == 4 and len(lora["targets"]) == 1


def test_the_graph_loop_replays_the_eager_loop(dry_run: tuple[int, Path, str]) -> None:
    """The anchor's capture, through the stand-in that replays its recorded ops as a graph
    does: the eager loop's tokens exactly, free running and step by step, in both dtypes."""
    _, out, _ = dry_run
    throughput = json.loads((out / "gpu_check.json").read_text())["stages"]["throughput"]
    graph = throughput["baselines"]["hf_static_graph"]
    assert throughput["baseline_used"] == "hf_static_graph" and graph["replays_eager"]
    for check in (graph["replay"], graph["replay_float32"]):
        assert check["graph"] == "trace stand-in"
        assert check["free_running_agreement"] == 1.0 and check["lockstep_agreement"] == 1.0
        assert check["max_rel_logit_error"] == 0.0
    assert graph["replay"]["dtype"] == "bfloat16" and graph["replay_float32"]["dtype"] == "float32"


def test_profile_and_serve_record_their_floors_and_targets(
        dry_run: tuple[int, Path, str]) -> None:
    _, out, _ = dry_run
    stages = json.loads((out / "gpu_check.json").read_text())["stages"]
    profile = stages["profile"]
    assert profile["floor_ms"] > 0 and profile["roofline_fraction"] > 0
    assert profile["mixed_steps"] == DRY_SIZES.mixed_steps and profile["mixed_host_ms"] > 0
    assert {t["name"] for t in profile["targets"]} >= {
        f"decode step at batch {DRY_SIZES.batch}", "GPU kernels a decode step",
        "host time of a mixed step (prefill + decodes)"}
    serve = stages["serve"]
    assert list(serve["runs"]) == [run.name for run in DRY_SIZES.serve_runs]
    for run in DRY_SIZES.serve_runs:
        figures = serve["runs"][run.name]
        assert figures["completed"] == run.prompts and figures["failed"] == 0
        assert figures["floor_output_tok_s"] > 0 and figures["tpot_floor_ms"] > 0
        assert len(figures["targets"]) == len(run.targets)
    # the CPU's figures are not the GPU's: nothing is judged against the GPU's targets
    assert all(t["met"] is None for s in stages.values() for t in s.get("targets", []))
    assert set(json.loads((out / "bench_serve.json").read_text())) == {
        run.name for run in DRY_SIZES.serve_runs}


def test_it_leaves_the_files_the_device_run_brings_back(dry_run: tuple[int, Path, str]) -> None:
    _, out, _ = dry_run
    names = {path.name for path in out.iterdir()}
    assert {"gpu_check.json", "gpu_check.md", "gpu_check.log", "profile.txt", "serve.log",
            "bench.txt", "bench_serve.json"} <= names
    assert len(names) <= 8  # what the device tool brings back from $OUT
    summary = (out / "gpu_check.md").read_text()
    assert "| serve | ok |" in summary and "CPU dry run" in summary
    assert "| profile | GPU kernels a decode step |" in summary
    assert "decode steps at batch" in (out / "profile.txt").read_text()


def test_a_module_that_does_not_import_stops_the_run_first(tmp_path: Path) -> None:
    """Every module the check needs is imported before anything runs: one missing (here
    xgrammar, shadowed by a broken stand-in) with no wheels to install it from ends the run
    at once, naming it."""
    if list((ROOT / ".device/wheels").glob("*.whl")):
        pytest.skip("carried wheels present: the script would install them")
    (tmp_path / "xgrammar.py").write_text("raise ImportError('not on this machine')\n")
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(tmp_path),
           "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", str(ROOT / "tests/device/gpu_check.sh"), "--dry-run"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "xgrammar" in done.stderr and not (tmp_path / "out").exists()
