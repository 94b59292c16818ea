"""The product's modules and what each imports, read from the source (for the layout tests)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("frontend", "engine_core", "shared")  # pyproject's packages


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(package: str) -> dict[str, set[str]]:
    """Every module of `package` -> every module name it imports, at any depth of its code
    (`from a.b import c` names both a.b and a.b.c: c may be a module)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path in sorted((REPO / package).rglob("*.py")):
        name = module_name(path)
        graph[name]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                graph[name].add(node.module)
                graph[name].update(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                graph[name].update(a.name for a in node.names)
    return graph


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")
