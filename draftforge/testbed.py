"""The offline testbed: a corpus, tokenizer and prompts made from the Python standard library on this machine.

Nothing is downloaded. The corpus is the stdlib's own `*.py` source; files are split into
train / held-out by a hash of their relative path, so the split is the same on every machine
and every Python version that ships the file. The tiny Llama target (preset "tiny-target")
is pre-trained on the train split by the `pretrain` task; held-out prompts come from files
it never saw.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import shutil
import sysconfig
import warnings
from dataclasses import dataclass
from pathlib import Path

from draftforge.errors import DataError, RecipeError
from draftforge.fsutil import temp_dir_beside

HELDOUT_PERCENT = 10
MAX_FILE_BYTES = 200_000
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
SPECIAL_TOKENS = {"pad_token": "<|pad|>", "bos_token": "<|bos|>", "eos_token": "<|eos|>"}
TARGET_PRESET = "tiny-target"  # LLAMA_PRESETS key of the testbed target (draftforge.models.student)
PROMPT_MIN_CHARS, PROMPT_MAX_CHARS = 100, 400
PROMPTS_FILE = Path(__file__).resolve().parents[1] / "data" / "prompts" / "testbed_heldout.jsonl"
# The committed prompts file was cut from this interpreter's stdlib; elsewhere the same code
# still works but may pick different functions (files change between Python releases).
PROMPTS_PYTHON_VERSION = "3.11.7"

# Role-less template: the tiny target is a code-completion model, so an SFT pair is simply
# prompt text followed by its continuation. With no role markers an SFT'd drafter sees the
# same text as a raw prompt at evaluation time (no markers the target never produces).
# The same *text* is not the same *ids*, though: re-tokenizing prompt + continuation merges
# the prompt's trailing indentation into the next word and runs of "\n" the target emitted
# one by one, so the demo distils through `format: tokens` rows instead (demo.write_distill_data).
# {% generation %} marks the assistant span so `return_assistant_tokens_mask=True` yields the loss mask.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% endfor %}"
)


@dataclass(frozen=True)
class TestbedPaths:
    """Where the testbed's pieces live (under `testbed_dir()` unless stated)."""

    __test__ = False  # not a pytest test class despite the name

    root: Path
    tokenizer: Path  # save_pretrained dir of the BPE tokenizer
    corpus_train: Path  # JSONL {"text", "source"} of the train split
    corpus_heldout: Path  # JSONL {"text", "source"} of the held-out split
    target: Path  # export dir of the pre-trained tiny target (made by the `pretrain` task)
    prompts: Path  # JSONL {"prompt", "source"} of held-out prompts (committed under data/)


def testbed_dir() -> Path:
    """$DRAFTFORGE_TESTBED, else ~/.cache/draftforge/testbed."""
    env = os.environ.get("DRAFTFORGE_TESTBED")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "draftforge" / "testbed"


def testbed_paths(root=None) -> TestbedPaths:
    root = Path(root) if root is not None else testbed_dir()
    prompts = PROMPTS_FILE if PROMPTS_FILE.is_file() else root / "prompts_heldout.jsonl"
    return TestbedPaths(root=root, tokenizer=root / "tokenizer", corpus_train=root / "corpus_train.jsonl",
                        corpus_heldout=root / "corpus_heldout.jsonl", target=root / "target", prompts=prompts)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relative_path: str) -> str:
    """'heldout' for ~HELDOUT_PERCENT% of files chosen by a hash of the POSIX relative path, else 'train'."""
    bucket = int.from_bytes(hashlib.sha256(relative_path.encode("utf-8")).digest()[:8], "big") % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


@functools.lru_cache(maxsize=4)
def _python_files(root: str) -> tuple[str, ...]:
    """Sorted POSIX relative paths of usable `*.py` files under `root` (scanned once per process)."""
    found = []
    for path in Path(root).rglob("*.py"):
        rel = path.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts[:-1]) or not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            continue
        found.append(rel.as_posix())
    return tuple(sorted(found))


def corpus_files(split: str = "train", root=None, max_files: int | None = None) -> list[Path]:
    """Sorted stdlib `*.py` files of `split` ("train", "heldout" or "all"), at most `max_files` of them."""
    if split not in ("train", "heldout", "all"):
        raise DataError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    root = Path(root) if root is not None else stdlib_root()
    files = [root / rel for rel in _python_files(str(root)) if split == "all" or split_of(rel) == split]
    if not files:
        raise DataError(f"no Python source files found under {root} for split {split!r}")
    return files[:max_files] if max_files is not None else files


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def write_corpus_jsonl(out_path, split: str = "train", max_files: int | None = None, *, exclude=None) -> Path:
    """One JSONL row {"text", "source"} per corpus file, ready for draftforge.data's local .jsonl source.

    `exclude(source) -> bool` leaves out files by their relative path: the SmolLM2 pipelines pass
    `draftforge.data.instructions.feeds_heldout_prompts`, since this corpus's own train/held-out split is by file
    and knows nothing of the instruction and long-context prompts' split, which is by module (a drafter
    pre-trained on the plain train split had read 25 of the 27 held-out long-context documents verbatim)."""
    root, out_path = stdlib_root(), Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for path in corpus_files(split, max_files=max_files):
            source = path.relative_to(root).as_posix()
            if exclude is not None and exclude(source):
                continue
            f.write(json.dumps({"text": _read(path), "source": source}) + "\n")
    tmp.replace(out_path)
    return out_path


def _tokenizer_settings(vocab_size: int, files: list[Path]) -> dict:
    root = stdlib_root()
    listing = "\n".join(f"{p.relative_to(root).as_posix()}:{p.stat().st_size}" for p in files)
    return {"format": 1, "vocab_size": vocab_size, "special_tokens": SPECIAL_TOKENS,
            "chat_template": CHAT_TEMPLATE, "files_sha256": hashlib.sha256(listing.encode()).hexdigest()}


def train_tokenizer(out_dir, vocab_size: int = 2048, max_files: int | None = None):
    """Byte-level BPE trained on the train split, as a PreTrainedTokenizerFast; reused when settings match."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise RecipeError(f"vocab_size: {vocab_size} is below the 256 byte tokens + {len(SPECIAL_TOKENS)} specials "
                          "that a byte-level BPE needs")
    out_dir = Path(out_dir)
    files = corpus_files("train", max_files=max_files)
    settings = _tokenizer_settings(vocab_size, files)
    settings_path = out_dir / "draftforge_tokenizer.json"
    if settings_path.is_file() and json.loads(settings_path.read_text()) == settings:
        return PreTrainedTokenizerFast.from_pretrained(out_dir)

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS.values()),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator((_read(p) for p in files), trainer=trainer, length=len(files))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, **SPECIAL_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE

    # Save beside, then rename, so a concurrent or killed build never leaves a half tokenizer.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = temp_dir_beside(out_dir)
    tokenizer.save_pretrained(tmp_dir)
    (tmp_dir / settings_path.name).write_text(json.dumps(settings, indent=2) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    try:
        tmp_dir.rename(out_dir)
    except OSError:  # another process finished the same build first: keep theirs
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if not (settings_path.is_file() and json.loads(settings_path.read_text()) == settings):
            raise
    return PreTrainedTokenizerFast.from_pretrained(out_dir)


def prompt_candidates(source: str) -> list[str]:
    """`def`/`class` headers with their docstring, ending at the body's indentation, PROMPT_MIN..MAX chars."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # old stdlib files raise SyntaxWarning on invalid escapes
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            return []
    lines = source.splitlines(keepends=True)
    prompts = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if ast.get_docstring(node) is None or len(node.body) < 2:
            continue
        after_doc = node.body[1]  # its lineno is the `def` line, below any decorators
        next_start = min([d.lineno for d in getattr(after_doc, "decorator_list", [])] + [after_doc.lineno])
        doc_end = node.body[0].end_lineno
        if next_start <= doc_end:  # `"doc"; return x` on one line: no clean cut
            continue
        next_line = lines[next_start - 1]
        indent = next_line[: len(next_line) - len(next_line.lstrip())]
        # Cut just before the first statement after the docstring, keeping blank lines and
        # comments in between, so the prompt is verbatim file text.
        prompt = "".join(lines[node.lineno - 1: next_start - 1]) + indent
        if PROMPT_MIN_CHARS <= len(prompt) <= PROMPT_MAX_CHARS:
            prompts.append(prompt)
    return prompts


def heldout_prompts(n: int = 100) -> list[dict]:
    """Up to `n` prompts from held-out files, round-robin across files (one per file per round) for variety."""
    root = stdlib_root()
    per_file = [(p.relative_to(root).as_posix(), prompt_candidates(_read(p))) for p in corpus_files("heldout")]
    per_file = [(rel, cands) for rel, cands in per_file if cands]
    rows: list[dict] = []
    for round_index in range(max((len(c) for _, c in per_file), default=0)):
        for rel, cands in per_file:
            if round_index < len(cands) and len(rows) < n:
                rows.append({"prompt": cands[round_index], "source": rel})
    if not rows:
        raise DataError(f"no held-out prompts could be cut from {root}")
    return rows


def write_heldout_prompts(path=PROMPTS_FILE, n: int = 100) -> Path:
    """Write `heldout_prompts(n)` as JSONL {"prompt", "source"}; deterministic for a given stdlib."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in heldout_prompts(n))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path


TESTBED_MARKER = ".draftforge-testbed"  # written first: a testbed killed half-built is still recognised as ours
_WRITES = ("tokenizer", "corpus_train.jsonl", "corpus_heldout.jsonl", "prompts_heldout.jsonl", "target")


def _claim(root: Path) -> None:
    """Refuse a testbed directory holding files of the testbed's names that no testbed wrote (they would be
    replaced), else mark it as a testbed's."""
    from draftforge.errors import DataError

    ours = (root / TESTBED_MARKER).is_file() or (root / "corpus_settings.json").is_file()
    theirs = [name for name in _WRITES if (root / name).exists()] if root.is_dir() and not ours else []
    if theirs:
        raise DataError(f"testbed directory {root} holds {', '.join(theirs)}, which no draftforge testbed wrote; "
                        "building the testbed there would replace them: choose another --testbed (an empty or "
                        "new directory)")
    root.mkdir(parents=True, exist_ok=True)
    (root / TESTBED_MARKER).write_text("a draftforge testbed: `draftforge demo` may rebuild what is here\n")


def ensure_testbed(root=None, vocab_size: int = 2048, max_files: int | None = None) -> TestbedPaths:
    """Build (or reuse) tokenizer, corpus files and prompts; the target is trained separately by `pretrain`."""
    paths = testbed_paths(root)
    _claim(paths.root)
    train_tokenizer(paths.tokenizer, vocab_size=vocab_size, max_files=max_files)
    settings_path = paths.root / "corpus_settings.json"
    settings = {"max_files": max_files, "stdlib": str(stdlib_root())}
    fresh = settings_path.is_file() and json.loads(settings_path.read_text()) == settings
    for split, out in (("train", paths.corpus_train), ("heldout", paths.corpus_heldout)):
        if not (fresh and out.is_file()):
            write_corpus_jsonl(out, split, max_files=max_files)
    settings_path.write_text(json.dumps(settings) + "\n")
    if not paths.prompts.is_file():
        write_heldout_prompts(paths.prompts)
    return paths
