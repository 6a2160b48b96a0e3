"""Instruction and code-completion prompts made offline from the Python standard library on this machine.

Each public module, function and class of the stdlib (read with `ast`, never imported) becomes
prompts in four categories: coding, explanation, writing, qa. E.g. "Explain what
`textwrap.dedent` does and give an example." Code-completion prompts (`build_code_prompts`) are
HumanEval-shaped: a public module-level function's own `def` line and docstring, as raw text the
target continues with a body; HumanEval's hand-written problems are not stdlib functions, so the two
never share a prompt. The split is by top-level module: a module's prompts are all held out or all
training, chosen by a hash of its name, so the held-out set (for eval) and the training set (for the
target's own responses, SFT) never share a module.
Deterministic for a given stdlib; the committed held-out file was cut from CPython 3.11.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from draftforge.errors import DataError

CATEGORIES = ("coding", "explanation", "writing", "qa")
HELDOUT_FILE = Path(__file__).resolve().parents[2] / "data" / "prompts" / "instructions_heldout.jsonl"
HELDOUT_PERCENT = 20  # share of top-level modules whose prompts are held out
# tests, GUIs, build/packaging helpers and joke modules make poor instructions
_SKIP = {"test", "tests", "idlelib", "tkinter", "turtledemo", "turtle", "lib2to3", "ensurepip", "distutils",
         "site-packages", "dist-packages", "__pycache__", "antigravity", "this", "__phello__", "config-3",
         "pydoc_data", "venv", "msilib", "encodings", "xxsubtype", "__future__", "__hello__"}
_MAX_ITEMS_PER_FILE = 12


@dataclass(frozen=True)
class Item:
    """One documented stdlib object: `kind` is module / function / class."""

    module: str  # dotted module path, e.g. "email.utils"
    name: str  # "" for the module itself
    kind: str
    summary: str  # first sentence of the docstring
    args: str = ""


def _first_sentence(doc: str | None) -> str:
    if not doc:
        return ""
    para = " ".join(doc.strip().split("\n\n")[0].split())
    sentence = re.split(r"(?<=[.!?])\s", para, maxsplit=1)[0].strip()
    ok = 20 <= len(sentence) <= 200 and sentence.isascii() and not sentence.startswith((">>>", "..", "%", "("))
    return sentence if ok else ""


def _module_name(root: Path, path: Path) -> str | None:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if not parts or any(p.startswith("_") or p in _SKIP or "-" in p for p in parts):
        return None
    return ".".join(parts)


def _args(node) -> str:
    names = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs if a.arg not in ("self", "cls")]
    return ", ".join(names)


def _file_items(root: Path, path: Path) -> list[Item]:
    module = _module_name(root, path)
    if module is None:
        return []
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    items = []
    if summary := _first_sentence(ast.get_docstring(tree)):
        items.append(Item(module, "", "module", summary))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            if summary := _first_sentence(ast.get_docstring(node)):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                items.append(Item(module, node.name, kind, summary, "" if kind == "class" else _args(node)))
    return items[:_MAX_ITEMS_PER_FILE]


def stdlib_items(root: str | Path | None = None) -> list[Item]:
    """Documented public modules, functions and classes of the stdlib at `root`, in a fixed order."""
    return list(_stdlib_items(str(root or sysconfig.get_paths()["stdlib"])))


@functools.lru_cache(maxsize=4)
def _stdlib_items(root: str) -> tuple[Item, ...]:
    root = Path(root)
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP and not d.startswith(("_", ".")))
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return tuple(item for path in sorted(files) for item in _file_items(root, path))


def is_heldout(module: str) -> bool:
    """Whether a module's prompts are held out; decided by its top-level name only."""
    top = module.split(".")[0]
    return int(hashlib.sha256(top.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def feeds_heldout_prompts(source: str) -> bool:
    """Whether the stdlib file at POSIX relative path `source` holds text of a module whose instruction and
    long-context prompts are held out (`instructions.is_heldout`, by top-level name). A private implementation
    file counts as its public module: `_pydecimal.py` as `decimal`, `_collections_abc.py` as `collections`."""
    top = source.split("/", 1)[0].removesuffix(".py")
    names = {top, top.lstrip("_"), top.lstrip("_").split("_")[0]}
    names |= {n[2:] for n in list(names) if n.startswith("py") and len(n) > 2}
    return any(is_heldout(n) for n in names if n)


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:] if text[1:2].islower() else text


def item_prompts(item: Item) -> list[tuple[str, str]]:
    """(category, prompt text) pairs for one stdlib object."""
    mod, doc = item.module, item.summary.rstrip(".")
    if item.kind == "module":
        return [("qa", f"Summarize the purpose of the `{mod}` module in Python's standard library."),
                ("writing", f"Write a short, friendly introduction to the `{mod}` module for a beginner. "
                            f"Its documentation begins: \"{item.summary}\""),
                ("explanation", f"Explain when you would use the `{mod}` module, with one small example.")]
    full = f"{mod}.{item.name}"
    if item.kind == "class":
        return [("explanation", f"Explain what the `{full}` class is for and show how to create and use one."),
                ("qa", f"What does the `{item.name}` class in `{mod}` represent? ({doc}.)"),
                ("coding", f"Write a small Python example that uses `{full}`, with comments.")]
    signature = f"{item.name}({item.args})"
    return [("explanation", f"Explain what `{full}` does and give an example."),
            ("coding", f"Write a Python function `{signature}` that does the following: {_lower_first(doc)}. "
                       "Include a docstring."),
            ("writing", f"Write a clear docstring for a function `{signature}` whose job is: {_lower_first(doc)}."),
            ("qa", f"Which function in the `{mod}` module does this: \"{item.summary}\"? Show a call.")
            if len(item.name) % 2 else ("qa", f"What arguments does `{full}` take, and what does it return?")]


def _rows(items: list[Item], split: str) -> list[dict]:
    # some docstrings are copied between modules (posixpath / ntpath): the training split drops those
    def key(item):
        return item.summary.rstrip(".").lower()

    heldout_docs = {key(item) for item in items if is_heldout(item.module)}
    rows = []
    for item in items:
        if is_heldout(item.module) != (split == "heldout"):
            continue
        if split == "train" and key(item) in heldout_docs:
            continue
        for category, text in item_prompts(item):
            rows.append({"category": category, "module": item.module,
                         "messages": [{"role": "user", "content": text}]})
    return rows


def _round_robin_by_module(rows: list[dict]) -> list[dict]:
    """One row per top-level module per round (sorted), so a prefix of the list is varied."""
    by_module: dict[str, list[dict]] = {}
    for row in rows:
        by_module.setdefault(row["module"].split(".")[0], []).append(row)
    queues = [by_module[m] for m in sorted(by_module)]
    out = []
    while any(queues):
        out += [q.pop(0) for q in queues if q]
    return out


def build_instruction_prompts(split: str, n: int | None = None, *, root=None, seed: int = 0) -> list[dict]:
    """Prompt rows {"prompt_id", "category", "module", "messages"} of one split ("heldout" or "train").

    heldout: `n` rows balanced over the four categories, spread across modules.
    train: every training row (or the first `n`) in a seeded shuffle.
    """
    if split not in ("heldout", "train"):
        raise DataError(f"instruction split must be 'heldout' or 'train', got {split!r}")
    if n is not None and n < 1:  # rows[:0] would be no prompts, and `if n` below would read 0 as "all"
        raise DataError(f"the number of prompts (-n) must be >= 1, got {n}; leave it out for the whole split")
    rows = _rows(stdlib_items(root), split)
    if not rows:
        raise DataError(f"no {split} instruction prompts could be made from the stdlib at {root or 'this Python'}")
    random.Random(seed).shuffle(rows)
    if split == "heldout":
        per_category = {c: _round_robin_by_module([r for r in rows if r["category"] == c]) for c in CATEGORIES}
        k = -(-(n or len(rows)) // len(CATEGORIES))
        rows = [r for i in range(k) for c in CATEGORIES if i < len(per_category[c]) for r in [per_category[c][i]]]
    rows = rows[:n] if n else rows
    return [{"prompt_id": f"{split}-{i:05d}", **row} for i, row in enumerate(rows)]


CODE_MAX_LINES = 30  # a header + docstring longer than this makes a poor completion prompt


def _code_header(lines: list[str], node: ast.FunctionDef) -> str | None:
    """The function's `def` line(s) and docstring as written, dedented; None when it is not a clean prompt
    (decorated, no body after the docstring, or too long)."""
    body = node.body
    if node.decorator_list or len(body) < 2 or not isinstance(body[0], ast.Expr):
        return None
    end = body[0].end_lineno
    if end - node.lineno + 1 > CODE_MAX_LINES:
        return None
    text = "".join(lines[node.lineno - 1:end])
    indent = len(text) - len(text.lstrip(" "))
    return "".join(line[indent:] for line in text.splitlines(keepends=True)).rstrip() + "\n"


@functools.lru_cache(maxsize=4)
def _code_items(root: str) -> tuple[tuple[str, str, str], ...]:
    """(module, function name, header + docstring) of every public module-level documented function."""
    root_path, out = Path(root), []
    for dirpath, dirnames, filenames in os.walk(root_path):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP and not d.startswith(("_", ".")))
        for name in sorted(f for f in filenames if f.endswith(".py")):
            path = Path(dirpath) / name
            module = _module_name(root_path, path)
            try:
                source = path.read_text(encoding="utf-8") if module else ""
                tree = ast.parse(source)
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            lines = source.splitlines(keepends=True)
            for node in tree.body:
                if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and ast.get_docstring(node):
                    if header := _code_header(lines, node):
                        out.append((module, node.name, header))
    return tuple(sorted(out))


def build_code_prompts(split: str, n: int | None = None, *, root=None, seed: int = 0,
                       exclude: frozenset[str] = frozenset()) -> list[dict]:
    """Code-completion rows {"prompt_id", "category": "code", "module", "prompt"} of one split, in a seeded
    shuffle spread over modules: a stdlib function's header and docstring, to be continued with its body.
    Functions named in `exclude` are left out (the CLI passes HumanEval's entry points: statistics.median
    would otherwise teach the drafter HumanEval's `median`)."""
    if split not in ("heldout", "train"):
        raise DataError(f"code prompt split must be 'heldout' or 'train', got {split!r}")
    if n is not None and n < 1:
        raise DataError(f"the number of prompts (-n) must be >= 1, got {n}; leave it out for the whole split")
    items = _code_items(str(root or sysconfig.get_paths()["stdlib"]))
    # posixpath / ntpath share functions word for word: a held-out header is never a training one too
    seen = {header for module, _, header in items if is_heldout(module)} if split == "train" else set()
    rows = []
    for module, name, header in items:
        if is_heldout(module) == (split == "heldout") and header not in seen and name not in exclude:
            seen.add(header)  # posixpath / ntpath share functions
            rows.append({"category": "code", "module": module, "function": name, "prompt": header})
    if not rows:
        raise DataError(f"no {split} code prompts could be made from the stdlib at {root or 'this Python'}")
    random.Random(seed).shuffle(rows)
    rows = _round_robin_by_module(rows)[:n] if n else _round_robin_by_module(rows)
    return [{"prompt_id": f"code-{split}-{i:05d}", **row} for i, row in enumerate(rows)]


def write_instruction_prompts(path: str | Path, split: str, n: int | None = None, *, kind: str = "instructions",
                              **kwargs) -> Path:
    """Write `build_instruction_prompts` (kind "instructions") or `build_code_prompts` (kind "code") as JSONL
    (temp file + rename, usual permissions); returns the path."""
    build = {"instructions": build_instruction_prompts, "code": build_code_prompts}[kind]
    rows = build(split, n, **kwargs)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as e:  # --out under a file, a directory named like the file, no permission, ...
        raise DataError(f"cannot write the prompts to {path}: {e.strerror or e}; give --out a file path in a "
                        "writable directory") from None
    finally:
        if tmp.parent.is_dir():
            tmp.unlink(missing_ok=True)
    return path


def heldout_path(cache_dir=None) -> Path:
    """The committed held-out file; without a checkout (an installed wheel) it is built once into the cache."""
    if HELDOUT_FILE.is_file():
        return HELDOUT_FILE
    from draftforge.smollm2 import cache_root

    path = cache_root(cache_dir) / "prompts" / HELDOUT_FILE.name
    return path if path.is_file() else write_instruction_prompts(path, "heldout", 80)
