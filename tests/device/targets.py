"""Issue 39's targets, each judged beside its figure: a stage lists what it measured against
what the GPU should reach, and the summary prints one row per target. Only a GPU run judges
them (the dry run's figures are the CPU's, at a tiny size): there `met` is None."""

from __future__ import annotations

from typing import Any

# issue 43's fp8 weights (tests/device/check_fp8.py): the fp8 engine over bf16's, same build
FP8_DECODE_STEP_RATIO = 0.65  # a decode step at batch 64: fp8's time over bf16's, at most
FP8_OUTPUT_TOK_S_RATIO = 1.3  # output tok/s at 256 at once, 1024 + 128: at least
FP8_ARGMAX_AGREEMENT = 0.9  # fp8's greedy tokens at bf16's argmax (teacher-forced): at least


def target(name: str, value: float | None, op: str, bound: float, unit: str,
           judged: bool) -> dict[str, Any]:
    """`value` against `bound` (`op`: "<=" or ">="); met is None when not judged or not
    measured."""
    met = None
    if judged and value is not None:
        met = value <= bound if op == "<=" else value >= bound
    return {"name": name, "value": value, "op": op, "bound": bound, "unit": unit, "met": met}


def all_met(targets: list[dict[str, Any]]) -> bool | None:
    """True when every judged target is met, False when one is not, None when none was."""
    judged = [t["met"] for t in targets if t["met"] is not None]
    return all(judged) if judged else None
