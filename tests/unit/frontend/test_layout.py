"""The frontend's packages and their import order (docs/architecture.md): read from the source.

`engine/` and `text/` import nothing else of the frontend. `openai/` imports them and the two
leaf modules every API raises and limits with (`errors`, `http_limits`), never the top
(`server`, `cli`...). Inside `openai/`, bottom up: `protocol/` (the shared schemas), then
`reasoning/` and `tools/`, then `serving/` (what the APIs share), then the APIs:
`completions/`, `chat/`, `responses/`, `tokens/`, `embeddings/`, siblings that never import
each other. A module imports only its own package and packages below it; no module sits at
`openai/`'s root; no circle anywhere in the frontend.
"""

from __future__ import annotations

from tests.unit.layout import imports, within

OPENAI = "frontend.openai"
RANK = {"protocol": 0, "reasoning": 1, "tools": 1, "serving": 2,
        "completions": 3, "chat": 3, "responses": 3, "tokens": 3, "embeddings": 3}
APIS = [name for name, rank in RANK.items() if rank == max(RANK.values())]
LEAVES = ("frontend.errors", "frontend.http_limits")  # import nothing of openai/ (checked)


def frontend_imports() -> dict[str, set[str]]:
    """Every frontend module -> the frontend modules it imports."""
    graph = imports("frontend")
    return {m: {t for t in targets if t in graph and t != m} for m, targets in graph.items()}


def openai_package(module: str) -> str:
    """`frontend.openai.chat.endpoint` -> "chat"; "" for the root's own modules."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else ""


def test_every_openai_module_sits_in_a_known_package() -> None:
    wrong = [m for m in frontend_imports() if within(m, OPENAI) and m != OPENAI
             and openai_package(m) not in RANK]
    assert not wrong, wrong


def test_engine_and_text_import_nothing_else_of_the_frontend() -> None:
    for package in ("frontend.engine", "frontend.text"):
        wrong = [(m, t) for m, targets in frontend_imports().items() if within(m, package)
                 for t in targets if not within(t, "frontend.engine")
                 and not within(t, "frontend.text")]
        assert not wrong, wrong


def test_openai_imports_below_it_and_the_leaves_only() -> None:
    below = ("frontend.engine", "frontend.text", OPENAI, *LEAVES)
    wrong = [(m, t) for m, targets in frontend_imports().items() if within(m, OPENAI)
             for t in targets if not any(within(t, b) for b in below)]
    assert not wrong, wrong
    leaves = [(m, t) for m in LEAVES for t in frontend_imports()[m] if within(t, OPENAI)]
    assert not leaves, leaves


def test_no_openai_package_imports_one_beside_or_above_it() -> None:
    wrong = [(m, t) for m, targets in frontend_imports().items() if within(m, OPENAI)
             for t in targets if within(t, OPENAI) and t != OPENAI
             and openai_package(t) != openai_package(m)
             and RANK[openai_package(t)] >= RANK[openai_package(m)]]
    assert not wrong, wrong


def test_the_apis_are_siblings_over_serving() -> None:
    """Each API plans and answers through `serving/` (the test above keeps them apart)."""
    graph = frontend_imports()
    for api in APIS:
        uses = {openai_package(t) for m, targets in graph.items()
                if within(m, f"{OPENAI}.{api}") for t in targets if within(t, OPENAI)}
        assert "serving" in uses, api


def test_no_import_circle() -> None:
    graph = frontend_imports()
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
