"""The package's import graph: no circle between any two modules, and no arrow back up the layers.

Layers, bottom up (a module may import its own layer and those below): base utilities; the recipe schema and
the task registry; models (and the SmolLM2 fetcher, the kernels); data (sources, packing, prompts, caches); the
decoding harness; the harvest jobs, which drive it; eval and train; the demo; the command line. Function-level imports count too: a lazy import is still a dependency.

So do imports made through strings, as an edge from the module that holds the string: every "draftforge.x:attr"
string constant (the task registry's builder/config/check, the top-level PUBLIC table), every literal
`import_module("draftforge.x")`, and the CLI's COMMANDS table ("module" or "module:prefix"). Such a string
must name a module that exists (a dangling one is what a file move leaves behind).

The top-level package is two things. Its body (`__version__`, the table) is layer 0 and imports nothing of
draftforge, so `from draftforge import __version__` is fine anywhere. Its lazy PUBLIC table is the node
"draftforge:PUBLIC" on the top layer with the command line: it exists for users and reaches every layer, so
no module of the package may import a public name through it (`from draftforge import load_target` or
`draftforge.load_target` inside the package is an arrow up); import it from its home module instead.

One kind of upward string is allowed (ALLOWED_UP): the task registry (layer 1) names each built-in task's
builder, config and check in draftforge.train (layer 6). It only names them: a name is resolved on use, after
both ends are loaded, so it adds no import-time dependency and no circle, and the registry stays complete
without importing train because nothing but draftforge/tasks.py registers a task (checked below). What it
does cost: resolving a task's config or check (recipe.py, at recipe validation) imports draftforge.train.<task>.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import draftforge
from tests.fixtures.imports import in_circles

PACKAGE = Path(draftforge.__file__).parent
FACADE = "draftforge:PUBLIC"  # the lazy table of draftforge/__init__.py
LAYERS = {
    "errors": 0, "options": 0, "fsutil": 0, "hfcompat": 0, "argcheck": 0, "runtime": 0, "loading": 0, "testbed": 0,
    "deprecation": 0,
    "recipe": 1, "tasks": 1, "export": 1,
    "models": 2, "smollm2": 2, "kernels": 2,
    "data": 3,
    "decode": 4,
    "harvest": 5,
    "eval": 6, "train": 6,
    "demo": 7,
}
TOP = 8  # the command line and the PUBLIC table
# (module holding the strings, prefix of the modules they may name above it)
ALLOWED_UP = {("draftforge.tasks", "draftforge.train.")}
STRING = re.compile(r"draftforge(\.\w+)*:\w*")  # "draftforge.x.y:attr" (the CLI's "module:prefix" too)


def _name(path: Path) -> str:
    return ".".join(("draftforge", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")


MODULES = {_name(p): p for p in PACKAGE.rglob("*.py")}


def absolute(node: ast.ImportFrom, here: str | None, modules) -> str | None:
    """The module a `from ... import` reads, relative imports (`from .x import y`, level > 0) resolved against the
    importing module `here` (a package when other modules sit under its name)."""
    if not node.level:
        return node.module
    if here is None:
        return None
    package = here.split(".") if any(m.startswith(here + ".") for m in modules) else here.split(".")[:-1]
    base = package[:len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else [])) or None


def named_modules(node: ast.AST, modules, here: str | None = None) -> set[str]:
    """The draftforge modules an import statement names (`from draftforge.x import y`: x.y when y is a module),
    relative ones included."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    module = absolute(node, here, modules) if isinstance(node, ast.ImportFrom) else None
    if module is not None and module.startswith("draftforge"):
        if module == "draftforge":
            return {"draftforge"} | {f"draftforge.{a.name}" for a in node.names} & set(modules)
        named = {f"{module}.{a.name}" for a in node.names} & set(modules)
        return named or ({module} & set(modules))
    return set()


def through_facade(node: ast.AST) -> bool:
    """`from draftforge import <public name>` or `draftforge.<public name>`."""
    if isinstance(node, ast.ImportFrom) and node.module == "draftforge":
        return any(a.name in draftforge.PUBLIC for a in node.names)
    return (isinstance(node, ast.Attribute) and node.attr in draftforge.PUBLIC and isinstance(node.value, ast.Name)
            and node.value.id == "draftforge")


def string_imports(tree: ast.AST) -> set[str]:
    """The module names of a module's import strings: "draftforge.x:attr" constants and literal
    import_module("draftforge.x") arguments."""
    found = {n.value for n in ast.walk(tree)
             if isinstance(n, ast.Constant) and isinstance(n.value, str) and STRING.fullmatch(n.value)}
    for n in ast.walk(tree):
        if (isinstance(n, ast.Call) and n.args and isinstance(n.args[0], ast.Constant)
                and isinstance(n.args[0].value, str) and n.args[0].value.startswith("draftforge")
                and getattr(n.func, "attr", getattr(n.func, "id", None)) in ("import_module", "__import__")):
            found.add(n.args[0].value)
        if (isinstance(n, ast.Call) and getattr(n.func, "id", None) == "moved_module" and len(n.args) == 2
                and isinstance(n.args[1], ast.Constant)):  # a shim left at a moved module's old path
            found.add(n.args[1].value)
    return {s.partition(":")[0] for s in found}


def table_strings() -> dict[str, set[str]]:
    """Import strings read from the tables themselves (whatever builds them): holder -> module names."""
    from draftforge import tasks
    from draftforge.cli import COMMANDS

    registered = {s for info in tasks._TASKS.values() for s in (info.builder, info.config, info.check)
                  if isinstance(s, str) and s.startswith("draftforge")}
    return {"draftforge.cli": {spec.partition(":")[0] for spec, _ in COMMANDS.values()},
            "draftforge.tasks": {s.partition(":")[0] for s in registered},
            FACADE: {s.partition(":")[0] for s in draftforge.PUBLIC.values()}}


def graph_of(sources: dict[str, str]) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(imports, string imports) of modules given by name -> source text: module -> the modules it reaches.
    The top-level package's strings are its PUBLIC table's, so they belong to FACADE."""
    imports = {m: set() for m in sources} | {FACADE: set()}
    strings = {m: set() for m in imports}
    for module, text in sources.items():
        tree = ast.parse(text)
        for node in ast.walk(tree):
            imports[module] |= named_modules(node, sources, here=module)
            if through_facade(node):
                imports[module].add(FACADE)
        strings[FACADE if module == "draftforge" else module] |= string_imports(tree)
    return imports, strings


def layer(module: str) -> int | None:
    if module == FACADE:
        return TOP
    if module == "draftforge":
        return 0
    top = module.split(".")[1]
    return TOP if top.startswith(("cli", "__main__")) else LAYERS.get(top)


def is_shim(module: str) -> bool:
    """A moved module's old name, kept for one release: its body is a docstring, the import of moved_module and
    the one call (draftforge/deprecation.py). It points wherever the module went, so it is exempt from layering."""
    path = MODULES.get(module)
    if path is None:
        return False
    body = [n for n in ast.parse(path.read_text()).body
            if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    return (len(body) == 2 and isinstance(body[0], ast.ImportFrom) and body[0].module == "draftforge.deprecation"
            and isinstance(body[1], ast.Expr) and getattr(body[1].value.func, "id", None) == "moved_module")


def allowed_up(module: str, named: str) -> bool:
    return is_shim(module) or any(module == holder and named.startswith(prefix) for holder, prefix in ALLOWED_UP)


def arrows_up(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((m, d) for m, deps in edges.items() for d in deps
                  if None not in (layer(m), layer(d)) and layer(d) > layer(m) and not allowed_up(m, d))


def _package() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    imports, strings = graph_of({m: p.read_text() for m, p in MODULES.items()})
    for holder, names in table_strings().items():
        strings[holder] |= names
    return imports, strings


def test_no_arrow_back_up_the_layers():
    imports, strings = _package()
    assert arrows_up(imports) == []
    unplaced = sorted({m.split(".")[1] for m in imports if "." in m and layer(m) is None})
    assert unplaced == [], "give each new top-level module a layer"


def test_import_strings_name_modules_that_exist_and_respect_the_layers():
    imports, strings = _package()
    assert strings["draftforge.tasks"] and strings["draftforge.cli"] and strings[FACADE]  # the tables were seen
    assert sorted((m, s) for m, names in strings.items() for s in names if s not in MODULES) == []
    assert arrows_up(strings) == []
    assert imports["draftforge"] == set()  # the top-level body imports nothing: it is layer 0


def test_only_the_registry_registers_a_task():
    """What makes the registry's upward names harmless: no module of draftforge.train registers anything when
    imported, so the registry is complete without importing them."""
    callers = sorted(m for m, p in MODULES.items() for n in ast.walk(ast.parse(p.read_text()))
                     if isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", "")) == "register_task")
    assert callers == ["draftforge.tasks"]


def test_no_import_circle_anywhere():
    imports, strings = _package()
    # an allowed upward name is resolved on use, after both ends are loaded, so it closes no import circle
    graph = {m: imports[m] | {s for s in strings[m] if not allowed_up(m, s)} for m in imports}
    packages = {m for m in graph if (PACKAGE / Path(*m.split(".")[1:]) / "__init__.py").is_file() or m == "draftforge"}
    assert in_circles({m: deps - packages for m, deps in graph.items() if m not in packages}) == []  # __init__s re-export


def test_the_checks_see_a_string_or_a_public_name_pointing_up():
    """Synthetic modules: the checks report what they are for."""
    imports, strings = graph_of({
        "draftforge.recipe": 'BUILDER = "draftforge.eval.runner:run_eval"\n',  # a string up: layer 1 -> 4
        "draftforge.data.rows": 'import importlib\nimportlib.import_module("draftforge.train.loop")\n',
        "draftforge.models.x": "import draftforge\nLOAD = draftforge.load_target\n",  # through the PUBLIC table
        "draftforge.decode.y": "from draftforge import __version__, build_decoder\n",
        "draftforge.tasks": 'A = "draftforge.train.lm:build"\nB = "draftforge.eval.runner:run_eval"\n',
        "draftforge.eval.runner": "", "draftforge.train.loop": "", "draftforge.train.lm": "",
    })
    assert arrows_up(strings) == [("draftforge.data.rows", "draftforge.train.loop"),
                                  ("draftforge.recipe", "draftforge.eval.runner"),
                                  ("draftforge.tasks", "draftforge.eval.runner")]  # the registry names train only
    assert arrows_up(imports) == [("draftforge.decode.y", FACADE), ("draftforge.models.x", FACADE)]
    # relative imports: from a module and from a package's __init__, one and two levels up
    relative, _ = graph_of({"draftforge.data.rows": "from ..train import loop\nfrom .prompts import x\n",
                            "draftforge.data": "from . import rows\nfrom ..eval.runner import run_eval\n",
                            "draftforge.data.prompts": "", "draftforge.train": "", "draftforge.train.loop": "",
                            "draftforge.eval.runner": ""})
    assert relative["draftforge.data.rows"] == {"draftforge.train.loop", "draftforge.data.prompts"}
    assert relative["draftforge.data"] == {"draftforge.data.rows", "draftforge.eval.runner"}
    assert arrows_up(relative) == [("draftforge.data", "draftforge.eval.runner"),
                                   ("draftforge.data.rows", "draftforge.train.loop")]
    assert in_circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == ["a", "b"]
