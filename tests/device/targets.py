"""Issue 39's targets, each judged beside its figure: a stage lists what it measured against
what the GPU should reach, and the summary prints one row per target. Only a GPU run judges
them (the dry run's figures are the CPU's, at a tiny size): there `met` is None."""

from __future__ import annotations

from typing import Any


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
