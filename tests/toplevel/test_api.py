"""The public API (draftforge.PUBLIC, docs/api.md): every name resolves lazily to its home module's object, the
page documents every name and its examples run, and the imports of draftforge in tests/ and benchmarks/ are
public names or fall under one of a few stated reasons."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import time
import types
import warnings
from collections import Counter
from pathlib import Path

import pytest

import draftforge

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "api.md"
SLOW = "<!-- slow -->"  # put on the line before a ```python block of the page that takes more than a second or two


def _doc_blocks() -> list[tuple[int, str, bool]]:
    """(line, code, slow) of every ```python block of docs/api.md."""
    text = DOC.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(2), bool(m.group(1)))
            for m in re.finditer(r"(<!-- slow -->\n)?```python\n(.*?)```", text, re.S)]


BLOCKS = _doc_blocks()


def test_every_public_name_resolves_to_its_home_object():
    assert draftforge.__all__ == list(draftforge.PUBLIC)
    for name, spec in draftforge.PUBLIC.items():
        module, _, attr = spec.partition(":")
        assert getattr(draftforge, name) is getattr(importlib.import_module(module), attr), name
    assert set(draftforge.PUBLIC) <= set(dir(draftforge))
    with pytest.raises(AttributeError, match="no attribute 'SpeculativeDecoder'"):
        draftforge.SpeculativeDecoder  # noqa: B018  (internal: not in the table)


def test_import_draftforge_stays_light():
    code = "import sys, draftforge; from draftforge import __version__; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_the_page_documents_every_public_name():
    text = DOC.read_text()
    table = {n for row in re.findall(r"^\| \[.*", text, re.M) for n in re.findall(r"`(\w+)`", row)}
    assert table == set(draftforge.PUBLIC)


# ---------------------------------------------------------------- the page's examples


@pytest.fixture(scope="module")
def page():
    """The page's examples run in order in one module namespace; what they register is taken out afterwards."""
    from draftforge import decode, tasks
    from draftforge.decode import methods

    saved = [(d, dict(d)) for d in (methods.METHODS, methods.OPTIONS, tasks._TASKS)]
    state = {"module": types.ModuleType("draftforge_api_page"), "ran": -1}
    sys.modules["draftforge_api_page"] = state["module"]
    yield state
    del sys.modules["draftforge_api_page"]
    for registry, before in saved:
        registry.clear()
        registry.update(before)
    assert decode.METHODS == methods.method_names()


def _run(state, i: int) -> float:
    line, code, _ = BLOCKS[i]
    start = time.perf_counter()
    exec(compile("\n" * (line - 1) + code, str(DOC), "exec"), state["module"].__dict__)  # errors name the page's line
    state["ran"] = i
    return time.perf_counter() - start


@pytest.mark.parametrize("i", [pytest.param(i, id=f"line{b[0]}", marks=[pytest.mark.slow] if b[2] else [])
                               for i, b in enumerate(BLOCKS)])
def test_the_pages_examples_run(page, i):
    for k in range(page["ran"] + 1, i):  # the blocks before it, when it runs alone (-k); slow ones define nothing
        if not BLOCKS[k][2]:
            _run(page, k)
    if i == 0:
        _run(page, 0)  # the models: the first block also pays for importing torch and transformers
        return
    seconds = _run(page, i)
    if 'plain = build_decoder("ar", target)' in BLOCKS[i][1]:  # the page's lossless oracle: its own "ar"; tie it to
        _assert_plain_is_generate(page["module"].__dict__)   # transformers' generate() here
    if seconds > 5 and not BLOCKS[i][2]:  # a hint for the suite's speed, not a check: timings flake under load
        warnings.warn(f"the example at docs/api.md:{BLOCKS[i][0]} took {seconds:.1f} s: consider marking it slow")


# ---------------------------------------------------------------- draftforge's internals in tests/ and benchmarks/

TOPS = ("decode", "data", "harvest", "eval", "train", "models", "kernels")
PACKAGE = Path(draftforge.__file__).parent
# (where, imported module prefixes, why): the first row that matches an import of an internal name is its reason.
# "own" = the draftforge package a test folder is named after (tests/decode/ -> draftforge.decode).
REASONS = (
    ("tests/", "own", "a test package tests its namesake's internals: tests/decode/ imports draftforge.decode.*, "
                      "tests/train/ draftforge.train.*, ..., tests/toplevel/ the one-file modules (draftforge.cli, "
                      "draftforge.runtime, ...)"),
    ("tests/", ("draftforge.recipe", "draftforge.tasks", "draftforge.train", "draftforge.cli", "draftforge.demo",
                "draftforge.export", "draftforge.testbed"),
     "the recipe, the command line, training runs and exports are interfaces through files and commands, not "
     "through the Python API: tests drive them as the CLI does"),
    ("tests/", ("draftforge.models", "draftforge.hfcompat", "draftforge.loading", "draftforge.kernels"),
     "tests build their tiny models, checkpoints and exports with the model code"),
    ("tests/", ("draftforge.decode", "draftforge.data", "draftforge.harvest", "draftforge.eval"),
     "tests that cross packages check one package against another's oracle (eval and train tests build real "
     "decoders, harvests and prompt files; fixtures hold the shared helpers)"),
    ("benchmarks/", ("draftforge.",), "benchmarks time the internals themselves (decode steps, kernels, data "
                                      "pipelines) and drive the eval runner and recipes as the CLI does"),
)


def internal_imports() -> list[tuple[str, str, str]]:
    """(file, module, name) of every import of draftforge in tests/ and benchmarks/ that is not a public name
    (`from draftforge import <public>`, or a public name from its home module; `import draftforge`)."""
    found = []
    for path in sorted(p for d in ("tests", "benchmarks") for p in (ROOT / d).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "draftforge":
                for a in node.names:
                    if node.module == "draftforge" and a.name in {*draftforge.PUBLIC, "__version__"}:
                        continue
                    if draftforge.PUBLIC.get(a.name) != f"{node.module}:{a.name}":  # `from draftforge import cli`
                        found.append((rel, node.module if node.module != "draftforge" else f"draftforge.{a.name}",
                                      a.name))
            elif isinstance(node, ast.Import):
                found += [(rel, a.name, "") for a in node.names if a.name.startswith("draftforge.")]
    return found


def reason_for(path: str, module: str) -> int | None:
    for k, (where, prefixes, _) in enumerate(REASONS):
        if prefixes == "own":
            folder = path.split("/")[1] if path.startswith("tests/") else None
            ok = (module.startswith(f"draftforge.{folder}") if folder in TOPS else
                  folder == "toplevel" and (PACKAGE / f"{module.split('.')[1]}.py").is_file())
        else:
            ok = path.startswith(where) and any(module == p or module.startswith(p.rstrip(".") + ".")
                                                or p.endswith(".") and module.startswith(p) for p in prefixes)
        if ok:
            return k
    return None


def test_internals_in_tests_and_benchmarks_have_a_stated_reason(capsys):
    found = internal_imports()
    unexplained = sorted({(f, m) for f, m, _ in found if reason_for(f, m) is None})
    assert unexplained == [], "import the public name (docs/api.md) or state a reason in REASONS"
    counts = Counter(reason_for(f, m) for f, m, _ in found)
    assert set(counts) == set(range(len(REASONS))), "a reason that explains no import goes"
    with capsys.disabled():
        print("\ninternal draftforge imports in tests/ and benchmarks/ by reason:",
              ", ".join(f"{REASONS[k][0]}#{k}: {counts[k]}" for k in sorted(counts)))


def test_the_reasons_check_can_fail():
    assert reason_for("tests/decode/test_x.py", "draftforge.decode.engine") == 0
    assert reason_for("tests/decode/test_x.py", "draftforge.runtime") is None  # no reason covers it
    assert reason_for("scripts/x.py", "draftforge.decode.engine") is None


def _assert_plain_is_generate(ns):
    import torch

    x = torch.tensor([list(ns["prompt"])])
    want = ns["target_model"].generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=12)
    assert ns["plain"].tokens == want[0, x.shape[1]:].tolist()
