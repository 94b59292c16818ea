"""The device check's floors (tests/device/roofline.py) against the figures issue 39 worked out
by hand for the Llama-3.2-1B shape on the H200, and its targets' verdicts."""

from __future__ import annotations

import pytest

from engine_core.worker.default_model import LLAMA32_1B_SHAPE
from tests.device.roofline import ModelShape, fraction
from tests.device.targets import all_met, target

CONFIG = {"hidden_size": LLAMA32_1B_SHAPE.hidden_size,
          "num_hidden_layers": LLAMA32_1B_SHAPE.num_layers,
          "num_attention_heads": LLAMA32_1B_SHAPE.num_heads,
          "num_key_value_heads": LLAMA32_1B_SHAPE.num_kv_heads,
          "intermediate_size": LLAMA32_1B_SHAPE.intermediate_size, "vocab_size": 128256}
SHAPE = ModelShape.from_config(CONFIG, "bfloat16")


def test_a_decode_step_at_batch_64_reads_what_the_issue_counted() -> None:
    assert SHAPE.weight_bytes / 1e9 == pytest.approx(2.47, abs=0.01)
    kv = SHAPE.decode_step_bytes(64, 256 + 128 / 2) - SHAPE.weight_bytes
    assert kv / 1e9 == pytest.approx(0.66, abs=0.02)
    assert 1e3 * SHAPE.decode_step_floor_s(64, 320) == pytest.approx(0.73, abs=0.01)
    assert 1e3 * SHAPE.decode_step_floor_s(1, 384) == pytest.approx(0.57, abs=0.01)


def test_the_c256_benchmark_floor_is_about_four_seconds() -> None:
    assert SHAPE.prefill_flops(1024, 1024) / 1e15 == pytest.approx(2.05, rel=0.05)
    assert SHAPE.decode_step_bytes(256, 1024 + 64) / 1e9 == pytest.approx(11.4, rel=0.03)
    floor = SHAPE.run_floor_s(1024, 256, 1024, 128)
    assert floor == pytest.approx(4.0, rel=0.05)
    assert 1024 * 128 / floor == pytest.approx(33_000, rel=0.05)
    assert fraction(floor, 2 * floor) == 0.5 and fraction(floor, 0.0) is None


def test_head_dim_set_apart_from_the_hidden_size_counts() -> None:
    qwen3 = ModelShape.from_config({**CONFIG, "head_dim": 128}, "bfloat16")
    assert qwen3.kv_bytes_per_token == 2 * SHAPE.kv_bytes_per_token
    assert qwen3.weight_bytes > SHAPE.weight_bytes


def test_targets_are_judged_only_where_asked() -> None:
    met = target("step", 1.0, "<=", 1.2, "ms", judged=True)
    missed = target("tok/s", 14_600, ">=", 23_000, "tok/s", judged=True)
    unjudged = target("step", 3.0, "<=", 1.2, "ms", judged=False)
    assert met["met"] is True and missed["met"] is False and unjudged["met"] is None
    assert all_met([met, unjudged]) is True and all_met([met, missed]) is False
    assert all_met([unjudged]) is None
