"""Long-context questions built offline: 1k to 8k tokens of documents from the stdlib's own documentation.

A document is one held-out stdlib module's documentation (its docstring, then each documented public function's
and class's signature and docstring; read with `ast`, never imported). Held-out means the instruction prompts'
split (`instructions.is_heldout`), so no document comes from a module a drafter trained on (a few short docstrings
are shared word for word between stdlib modules, e.g. posixpath's and ntpath's basename). A question of length L asks
about one function of one document ("single-doc") or compares two functions of two documents ("multi-doc", in
the spirit of LongBench's two groups); its context is the asked document(s) among other held-out documents,
seeded, filled until the prompt holds as many target tokens as fit under L (counted by the caller's `count`,
the target's tokenizer). Category "single-doc@2k": the eval report gives its figures per category, so per bucket.

`split="train"` builds the same kind of questions over the *training* modules instead (none held out), for
drafters trained at the context they serve: the target answers them (`draftforge generate`) and a drafter trains
on the rows. The two splits never share a module, the training split drops any part whose docstring a held-out
document holds too (the copies above), and each file is checked for the other split's documents before it is
written.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from draftforge.data.instructions import _SKIP, _module_name, is_heldout
from draftforge.errors import DataError

LENGTHS = (1024, 2048, 4096, 8192)
GROUPS = ("single-doc", "multi-doc")
SPLITS = ("heldout", "train")
DOC_MAX_CHARS = 16000  # a module's documentation read at most this far (~4k tokens)
HEADER = "Read the following documentation of Python modules, then answer the question after it.\n\n"


@dataclass(frozen=True)
class Document:
    module: str
    parts: tuple[tuple[str, str], ...]  # (documented name, text); the first part is the module's ("", docstring)

    def cut(self, count: Callable[[str], int], limit: int) -> tuple[str, tuple[str, ...]]:
        """(text, askable names) of the leading parts that fit in `limit` tokens (the module part always)."""
        text, names = self.parts[0][1], []
        for name, part in self.parts[1:]:
            if count(text + part) > limit:
                break
            text += part
            names.append(name)
        return text, tuple(names)


def bucket_name(length: int) -> str:
    return f"{length // 1024}k" if length % 1024 == 0 else str(length)


def parse_lengths(text: str) -> tuple[int, ...]:
    """'1k,2k,8192' -> (1024, 2048, 8192)."""
    out = []
    for part in str(text).split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            out.append(int(part[:-1]) * 1024 if part.endswith("k") else int(part))
        except ValueError:
            raise DataError(f"--lengths expects token counts like 1k,2k,4k,8k, got {part!r}") from None
    if not out or min(out) < 256:
        raise DataError(f"--lengths needs counts of at least 256 tokens, got {text!r}")
    twice = sorted({n for n in out if out.count(n) > 1})
    if twice:  # the same bucket twice wrote each of its questions twice, under one id
        raise DataError(f"--lengths names {', '.join(bucket_name(n) for n in twice)} twice, got {text!r}")
    return tuple(out)


def _document(module: str, path: Path) -> Document | None:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None
    parts = [("", f"## Module {module}\n\n{(ast.get_docstring(tree) or '').strip()[:1500]}\n")]
    size = len(parts[0][1])
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or not doc.isascii() or len(doc) < 40:
            continue
        kind = "class" if isinstance(node, ast.ClassDef) else "def"
        args = "" if kind == "class" else "(" + ast.unparse(node.args) + ")"
        part = f"\n{kind} {module}.{node.name}{args}\n    {doc.strip()[:1500]}\n"
        if size + len(part) > DOC_MAX_CHARS:
            break
        parts.append((node.name, part))
        size += len(part)
    return Document(module, tuple(parts)) if len(parts) >= 3 else None


def _doc_text(name: str, part: str) -> str:
    """A part's docstring alone, without its module-qualified heading: the text two modules can share word for
    word (posixpath's and ntpath's basename)."""
    return part.split("\n", 2)[2].strip() if name else part.split("\n\n", 1)[-1].strip()


def _without_heldout_text(doc: Document, heldout: set[str]) -> Document | None:
    """A training document without the parts whose docstring a held-out document holds too (the module's own
    docstring then keeps its heading only); None when fewer than two functions are left to ask about."""
    parts = [(n, p) for n, p in doc.parts if not n or _doc_text(n, p) not in heldout]
    if _doc_text(*parts[0]) in heldout:
        parts[0] = ("", f"## Module {doc.module}\n\n\n")
    return Document(doc.module, tuple(parts)) if len(parts) >= 3 else None


@functools.lru_cache(maxsize=4)
def _documents(root: str, split: str = "heldout") -> tuple[Document, ...]:
    if split == "train":  # no text a held-out question asks about, even where a training module repeats it
        heldout = {_doc_text(n, p) for d in _documents(root, "heldout") for n, p in d.parts} - {""}
        return tuple(d for d in (_without_heldout_text(d, heldout) for d in _documents(root, "train-all")) if d)
    base, found = Path(root), []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP and not d.startswith(("_", ".")))
        for name in sorted(f for f in filenames if f.endswith(".py")):
            module = _module_name(base, Path(dirpath) / name)
            wanted = module and is_heldout(module) == (split == "heldout")  # "train-all": unfiltered train
            doc = _document(module, Path(dirpath) / name) if wanted else None
            if doc is not None:
                found.append(doc)
    return tuple(sorted(found, key=lambda d: d.module))


def stdlib_documents(root: str | Path | None = None, split: str = "heldout") -> list[Document]:
    """The held-out (or, split="train", the training) modules' documents of the stdlib at `root` (default: this
    Python's), in a fixed order."""
    if split not in SPLITS:
        raise DataError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    return list(_documents(str(root or sysconfig.get_paths()["stdlib"]), split))


def _question(group: str, names: list[str]) -> str:
    if group == "single-doc":
        return (f"Question: using only the documentation above, explain what `{names[0]}` does, what its "
                "arguments mean, and when you would use it.")
    return (f"Question: using only the documentation above, compare `{names[0]}` and `{names[1]}`: what does "
            "each do, and in which situation would you pick one over the other?")


def build_longctx(count: Callable[[str], int], lengths=LENGTHS, per_bucket: int = 6, *, seed: int = 0,
                  root=None, context: int | None = None, new_tokens: int = 128, split: str = "heldout") -> list[dict]:
    """`per_bucket` questions per length and group, as prompt rows ({prompt_id, category, messages, documents,
    asked, length, split}); each prompt's `count` is at most its length, and at most `context - new_tokens` (the
    answer must fit in the target's context too). A length beyond the target's context is refused. Deterministic
    for a given stdlib, count, seed and split; the train split's ids start `longctx-train-`."""
    docs = stdlib_documents(root, split)
    if len(docs) < 4:
        raise DataError(f"only {len(docs)} {split} stdlib modules have documentation to ask about; need 4")
    count = functools.lru_cache(maxsize=None)(count)  # each document is counted once, whatever rows it fills
    rows = []
    for length in lengths:
        if context is not None and length > context:
            raise DataError(f"a {length}-token question is beyond the target's context of {context} tokens; ask for "
                            f"lengths up to {context} (--lengths)")
        if context is not None and context - new_tokens < length // 2:
            raise DataError(f"a {bucket_name(length)}-token question would hold at most {max(context - new_tokens, 0)} "
                            f"tokens: {new_tokens} of the target's {context} are kept for the answer "
                            "(--max-new-tokens); ask for fewer new tokens or shorter lengths")
        for group in GROUPS:
            for i in range(per_bucket):
                rng = random.Random(f"{seed}:{length}:{group}:{i}")
                limit = min(length, context - new_tokens) if context else length
                row = _row(count, docs, limit, length, group, i, rng)
                if split == "train":
                    row["prompt_id"] = row["prompt_id"].replace("longctx-", "longctx-train-", 1)
                rows.append({**row, "split": split})
    return rows


def _row(count, docs: list[Document], limit: int, bucket: int, group: str, index: int, rng: random.Random) -> dict:
    """A question of bucket `bucket` whose prompt holds at most `limit` tokens. Each document is cut to a third of
    the limit, so even a 1k context holds several; the asked names are drawn from what the cut kept.

    A document costs what it adds to a prompt: `count` measures a whole prompt (a chat template's tokens
    included), so a document's own count less that of an empty prompt. Charging each document the template
    too left 1k prompts 11-17% short of their length with SmolLM2's template (some 30 tokens a document)."""
    empty = count("")

    def cost(text: str) -> int:
        return count(text) - empty

    cut = {d.module: d.cut(cost, limit // 3) for d in docs}
    askable, need = [d for d in docs if cut[d.module][1]], 1 if group == "single-doc" else 2
    if len(askable) < need:
        raise DataError(f"cannot fit the asked documents and the question under {limit} tokens: at a third of it, "
                        f"{len(askable)} document(s) keep a function to ask about ({group} needs {need}); ask for "
                        "longer lengths")
    asked = rng.sample(askable, need)
    question = _question(group, [f"{d.module}.{rng.choice(cut[d.module][1])}" for d in asked])
    others = [d for d in docs if d not in asked]
    rng.shuffle(others)
    budget = limit - count(HEADER + "\n\n" + question)
    used = sum(cost(cut[d.module][0]) for d in asked)
    fillers = []
    for doc in others:  # fill by per-document costs; the whole prompt is counted after
        need = cost(cut[doc.module][0])
        if used + need <= budget:
            fillers.append(doc)
            used += need
    order = list(fillers)
    for doc in asked:  # the asked documents at seeded places among the others
        order.insert(rng.randrange(len(order) + 1), doc)
    text = _prompt([cut[d.module][0] for d in order], question)
    while count(text) > limit:
        if not fillers:
            raise DataError(f"cannot fit the asked documents and the question under {limit} tokens")
        order.remove(fillers.pop())
        text = _prompt([cut[d.module][0] for d in order], question)
    return {"prompt_id": f"longctx-{group}-{bucket_name(bucket)}-{index}", "category": f"{group}@{bucket_name(bucket)}",
            "messages": [{"role": "user", "content": text}], "length": bucket,
            "documents": [d.module for d in order], "asked": [d.module for d in asked]}


def _prompt(texts: list[str], question: str) -> str:
    return HEADER + "\n".join(texts) + "\n\n" + question


def check_heldout(rows: list[dict]) -> None:
    """DataError naming the first document of a row that is not in its row's split (`split`, default heldout): a
    training document in a held-out question would leak, and a held-out one in a training question too."""
    for row in rows:
        split = row.get("split", "heldout")
        leaked = [m for m in row["documents"] if is_heldout(m) != (split == "heldout")]
        if leaked:
            other = "training" if split == "heldout" else "held-out"
            raise DataError(f"{row['prompt_id']}: document {leaked[0]} is in the {other} split; a {split} "
                            f"long-context question may hold {split} documents only")


def write_longctx(path, rows: list[dict]) -> Path:
    from draftforge.fsutil import atomic_write_text

    check_heldout(rows)
    path = Path(path)  # a unique temp name beside it: a user's OUT.tmp is never touched
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path
