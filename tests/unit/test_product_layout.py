"""The product's three halves and the size of its folders, read from the source.

`frontend/` never imports `engine_core/` and the reverse; both import `shared/`, which imports
neither (docs/architecture.md). No folder of the product holds more than 12 modules (its
`__init__.py` aside): past that, it is two packages.
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests.unit.layout import PRODUCT, REPO, imports, within

MAX_MODULES = 12
NEVER = {"frontend": ("engine_core",), "engine_core": ("frontend",),
         "shared": ("frontend", "engine_core")}


def test_no_product_folder_holds_more_than_twelve_modules() -> None:
    counts = Counter(path.parent.relative_to(REPO).as_posix()
                     for package in PRODUCT for path in (REPO / package).rglob("*.py")
                     if path.name != "__init__.py")
    assert counts and max(counts.values()) <= MAX_MODULES, counts.most_common(3)


@pytest.mark.parametrize("half", PRODUCT)
def test_the_halves_do_not_import_each_other(half: str) -> None:
    wrong = sorted((module, target) for module, targets in imports(half).items()
                   for target in targets for other in NEVER[half] if within(target, other))
    assert not wrong, wrong
