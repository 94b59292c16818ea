"""The engine's packages and their import order (docs/architecture.md): read from the source.

Layers, bottom up: `layers/` and `structured/` (import nothing else of the engine), `sample/`
and `models/` (the model files, on `layers/`), `sched/` and `lora/` (the adapters' slots, on
`models/`), `worker/`, then the root's step
pipeline and process. A module imports only its own
package, packages below it, and the root's `config` (a leaf that imports nothing); no circle.
Sampling reads one `SamplingBatch`, never the scheduler: `sample/` imports nothing of `sched/`.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import engine_core

ROOT = Path(engine_core.__file__).parent
RANK = {"quant": -1, "layers": 0, "structured": 0, "sample": 1, "models": 1, "spec": 1,
        "sched": 2, "lora": 2, "worker": 3, "": 4}
LEAF = "engine_core.config"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in RANK) else ""


def engine_imports() -> dict[str, set[str]]:
    """Every engine module -> the engine modules it imports, at any depth of its code."""
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        graph[name]
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def test_every_module_sits_in_a_known_package() -> None:
    packages = {_package(m) for m in engine_imports()}
    assert packages <= set(RANK), packages - set(RANK)


def test_the_root_holds_at_most_eight_modules_and_packages_at_most_a_dozen() -> None:
    counts: dict[str, int] = defaultdict(int)
    for path in ROOT.rglob("*.py"):
        if path.stem not in ("__init__", "__main__"):
            counts[_package(_module_name(path))] += 1
    assert counts[""] <= 8, counts
    assert max(counts.values()) <= 12, counts


def test_no_package_imports_one_above_it() -> None:
    wrong = [(m, t) for m, targets in engine_imports().items() for t in targets
             if t != LEAF and _package(t) != _package(m)
             and RANK[_package(t)] >= RANK[_package(m)]]
    assert not wrong, wrong


def test_sampling_imports_nothing_of_the_scheduler() -> None:
    wrong = [(m, t) for m, targets in engine_imports().items() for t in targets
             if _package(m) == "sample" and _package(t) == "sched"]
    assert not wrong, wrong
    assert RANK["sample"] < RANK["sched"]


def test_the_config_leaf_imports_nothing_of_the_engine() -> None:
    assert not engine_imports()[LEAF]


def test_no_import_circle() -> None:
    graph = engine_imports()
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, " -> ".join((*path, module))
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, (*path, module))
        done.add(module)

    for module in sorted(graph):
        visit(module, ())
