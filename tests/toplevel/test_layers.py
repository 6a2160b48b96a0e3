"""The package's import graph: no circle between any two modules, and no arrow back up the layers.

Layers, bottom up (a module may import its own layer and those below): base utilities; the recipe schema and
the task registry; models (and the SmolLM2 fetcher); data and the decoding harness; eval and train; the demo;
the command line. Function-level imports count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import draftforge
from tests.fixtures.imports import in_circles

PACKAGE = Path(draftforge.__file__).parent
LAYERS = {
    "errors": 0, "options": 0, "fsutil": 0, "hfcompat": 0, "argcheck": 0, "runtime": 0, "loading": 0, "testbed": 0,
    "recipe": 1, "tasks": 1, "export": 1,
    "models": 2, "smollm2": 2, "kernels": 2,
    "data": 3, "decode": 3,
    "eval": 4, "train": 4,
    "demo": 5,
}


def _name(path: Path) -> str:
    return ".".join(("draftforge", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")


def _graph() -> dict[str, set[str]]:
    modules = {_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: set() for m in modules}
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("draftforge"):
                named = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
                graph[module] |= named or ({node.module} & set(modules))
    return graph


def _layer(module: str) -> int | None:
    top = module.split(".")[1] if "." in module else ""
    return 6 if top.startswith(("cli", "__main__")) else LAYERS.get(top)


def test_no_arrow_back_up_the_layers():
    up = [(m, d) for m, deps in _graph().items() for d in deps
          if None not in (_layer(m), _layer(d)) and _layer(d) > _layer(m)]
    assert up == []
    unplaced = sorted({m.split(".")[1] for m in _graph() if "." in m and _layer(m) is None})
    assert unplaced == [], "give each new top-level module a layer"


def test_no_import_circle_anywhere():
    graph = _graph()
    packages = {m for m in graph if (PACKAGE / Path(*m.split(".")[1:]) / "__init__.py").is_file() or m == "draftforge"}
    assert in_circles({m: deps - packages for m, deps in graph.items() if m not in packages}) == []  # __init__s re-export
