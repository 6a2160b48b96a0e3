"""Data sources: resolve recipe source strings into one normalized `datasets` table.

Every source becomes rows of either {"text": str, "bad": str} (format=text),
{"messages": [{"role", "content"}], "bad": str} (format=chat) or
{"input_ids": [int], "labels": [int], "where": str, "bad": str} (format=tokens). `bad` is ""
for a usable row and otherwise the reason it is skipped; keeping bad rows (instead of
dropping them while reading) lets the skip counts survive a datasets cache hit.

format=tokens rows are ids a program wrote (e.g. a target's own continuations, which must
not be decoded and re-tokenized: BPE would merge or split them differently). A raw row is
{"input_ids": [...]} plus at most one of "prompt_len" (no loss on the first N tokens) or
"loss_mask" (0/1 per token); with neither, every token has loss. A malformed row is a bug in
its producer, so it raises DataError naming file:line instead of being skipped. The tokenizer that made
them is checked from their sidecar before they are read (data/provenance.py); a folder or glob source
skips those sidecars.

A local file that is not text (random bytes, an image; rule in data/textcheck.py) is refused naming it; a
folder or glob source skips such files with one notice. .jsonl.gz is the one compressed form read.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import itertools
import json
import os
import re
from pathlib import Path

import datasets

from draftforge.data.chat import IGNORE_INDEX
from draftforge.data.provenance import TRAIN_FIX, check_row_files, is_sidecar
from draftforge.data.textcheck import (
    GZIP_ERRORS,
    check_text_file,
    first_bad_utf8_line,
    gzip_error,
    is_gzipped_jsonl,
    text_files_only,
)
from draftforge.errors import DataError
from draftforge.loading import org_is_local_folder

FORMATS = ("text", "chat", "tokens")
ROW_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
_GLOB_CHARS = set("*?[")
# ShareGPT speakers -> OpenAI roles; anything else is skipped with a reason.
ROLE_ALIASES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bot": "assistant",
    "model": "assistant", "system": "system",
}


def normalize_row(row: dict, fmt: str, text_field: str, where: str = "a row") -> dict:
    """One raw row -> the normalized schema of this format (see module docstring)."""
    if fmt == "tokens":
        return normalize_tokens(row, where)
    if fmt == "text":
        text = row.get(text_field)
        if not isinstance(text, str):
            return {"text": "", "bad": f"missing text field {text_field!r}"}
        if not text.strip():
            return {"text": "", "bad": "empty text"}
        return {"text": text, "bad": ""}
    return _normalize_chat(row)


def _normalize_chat(row: dict) -> dict:
    turns = row.get("conversations")
    role_key, content_key = "from", "value"
    if turns is None:
        turns = row.get("messages")
        role_key, content_key = "role", "content"
    if not isinstance(turns, list) or not turns:
        return {"messages": [], "bad": "missing 'conversations' or 'messages' field"}
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return {"messages": [], "bad": "a turn is not an object"}
        role = ROLE_ALIASES.get(str(turn.get(role_key, "")).lower())
        content = turn.get(content_key)
        if role is None or not isinstance(content, str):
            return {"messages": [], "bad": f"turn without a known {role_key!r} or a string {content_key!r}"}
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        return {"messages": [], "bad": "no assistant turn"}
    return {"messages": messages, "bad": ""}


def _int_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def normalize_tokens(row: dict, where: str) -> dict:
    """{"input_ids", "prompt_len" | "loss_mask"} -> input_ids + labels (-100 where no loss); DataError if malformed."""
    ids = row.get("input_ids")
    if not _int_list(ids) or not ids:
        raise DataError(f"{where}: format=tokens needs 'input_ids', a non-empty list of ints")
    if min(ids) < 0:
        raise DataError(f"{where}: 'input_ids' has a negative id ({min(ids)})")
    if "prompt_len" in row and "loss_mask" in row:
        raise DataError(f"{where}: give 'prompt_len' or 'loss_mask', not both")
    if "loss_mask" in row:
        mask = row["loss_mask"]
        if not _int_list(mask) or len(mask) != len(ids) or not set(mask) <= {0, 1}:
            raise DataError(f"{where}: 'loss_mask' must be a list of 0/1, one per input id ({len(ids)})")
    elif "prompt_len" in row:
        n = row["prompt_len"]
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= len(ids):
            raise DataError(f"{where}: 'prompt_len' must be an int in [0, {len(ids)}], got {n!r}")
        mask = [0] * n + [1] * (len(ids) - n)
    else:
        mask = [1] * len(ids)
    labels = [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
    return {"input_ids": ids, "labels": labels, "where": where, "bad": "" if any(mask) else "no loss tokens"}


def features_for(fmt: str) -> datasets.Features:
    if fmt == "tokens":
        ids = datasets.List(datasets.Value("int32"))
        return datasets.Features({"input_ids": ids, "labels": ids, "where": datasets.Value("string"),
                                  "bad": datasets.Value("string")})
    if fmt == "text":
        return datasets.Features({"text": datasets.Value("string"), "bad": datasets.Value("string")})
    turn = {"role": datasets.Value("string"), "content": datasets.Value("string")}
    return datasets.Features({"messages": datasets.List(turn), "bad": datasets.Value("string")})


def is_hf_name(spec: str) -> bool:
    """`hf:` prefix, or a bare `name` / `org/name` that is not a local path or glob."""
    if spec.startswith("hf:"):
        return True
    if os.path.exists(spec) or _GLOB_CHARS & set(spec):
        return False
    looks_like_path = spec.startswith((".", "/", "~")) or Path(spec).suffix != "" or spec.count("/") > 1
    return not looks_like_path and not org_is_local_folder(spec)  # runs/corpus beside runs/: a local path


def hub_dataset_card(folder: Path) -> str | None:
    """What marks `folder` as a Hugging Face dataset repository (a README.md whose YAML header maps configs or
    dataset_info, or a dataset_infos.json), else None."""
    if (folder / "dataset_infos.json").is_file():
        return "dataset_infos.json"
    readme = folder / "README.md"
    if not readme.is_file():
        return None
    with open(readme, encoding="utf-8", errors="replace") as f:
        head = f.read(65536)
    if not head.startswith("---"):
        return None
    header = head[3:].split("\n---", 1)[0]
    keys = [k for k in ("configs", "dataset_info") if re.search(rf"^{k}:", header, re.M)]
    return f"README.md's header maps {' and '.join(keys)}" if keys else None


def resolve_local_files(spec: str, file_glob: str, quiet: bool = False) -> list[Path]:
    """A file, a folder (files matching `file_glob`, sorted) or a glob (sorted); only text files (and .parquet):
    a file source that is not text is refused, a folder or glob skips them with a notice (none if `quiet`)."""
    path = Path(os.path.expanduser(spec))
    if _GLOB_CHARS & set(spec):
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True))
        files = [f for f in files if f.is_file() and not is_sidecar(f)]
        if not files:
            raise DataError(f"data source glob {spec!r} matches no files; check the pattern")
        root = Path(*itertools.takewhile(lambda part: not _GLOB_CHARS & set(part), path.parts))
        return text_files_only(files, spec, root, quiet)
    if not path.exists():
        raise DataError(f"data source {spec!r} does not exist; give an existing file, folder or glob "
                        "(or a Hugging Face dataset name, optionally prefixed 'hf:')")
    if path.is_file():
        check_text_file(path)
        return [path]
    card = hub_dataset_card(path)
    if card:  # read as files, every split and the dataset card itself were trained on
        raise DataError(f"data folder {spec!r} is laid out as a Hugging Face dataset ({card}); read as files it would "
                        f"train on every split and on its README: give it as 'hf:{spec}' (data.split picks the split)")
    # nothing under a hidden folder (.git, .venv, .ipynb_checkpoints, ...), as a glob source skips them: a checked-out
    # repository's .git/HEAD, config and hooks were trained on as documents
    files = sorted(p for p in path.glob(file_glob) if p.is_file() and not is_sidecar(p)
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not files:
        raise DataError(f"data folder {spec!r} has no files matching file_glob {file_glob!r}")
    return text_files_only(files, spec, path, quiet)


def iter_file_rows(path: Path):
    """Raw rows of one local file; any non-row file (.txt, .py, ...) is one document."""
    for _, row in iter_located_rows(path):
        yield row


def row_suffix(path: Path) -> str | None:
    """How a file is read: ".jsonl" (.jsonl.gz too), ".json", ".parquet", or None (a text file, one document)."""
    suffix = ".jsonl" if is_gzipped_jsonl(path) else path.suffix.lower()
    return suffix if suffix in ROW_FILE_SUFFIXES else None


def _not_utf8(path, line_no: int) -> DataError:
    return DataError(f"{path}:{line_no}: not UTF-8 text; save the file as UTF-8 (or fix or remove that line)")


def iter_jsonl(path: str | Path):
    """(line number, parsed value) per non-blank line of a JSONL file (.jsonl.gz too).

    The one JSONL reader: a binary file, a malformed line or a line that is not UTF-8 raises DataError naming
    the file (and line).
    """
    path = Path(path)
    check_text_file(path)
    opener = gzip.open if is_gzipped_jsonl(path) else open
    try:
        with opener(path, "rt", encoding="utf-8-sig") as f:  # -sig: a leading BOM (Windows tools write one) is dropped
            for line_no, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{line_no}: malformed JSON line ({e.msg}); fix or remove it") from None
                yield line_no, value
    except GZIP_ERRORS as e:
        raise gzip_error(path, e) from None
    except UnicodeDecodeError:  # decoded a chunk at a time: the line is found again from the bytes
        raise _not_utf8(path, first_bad_utf8_line(path)) from None


def iter_located_rows(path: Path):
    """(where, raw row) pairs; `where` is "file:line" for JSONL, "file row i" otherwise (for error messages)."""
    suffix = row_suffix(path)
    if suffix == ".jsonl":  # iter_jsonl checks the file is text
        yield from ((f"{path}:{line_no}", row) for line_no, row in iter_jsonl(path))
        return
    check_text_file(path)
    if suffix == ".json":
        data = path.read_bytes()
        try:
            rows = json.loads(data.decode("utf-8-sig"))
        except UnicodeDecodeError as e:
            raise _not_utf8(path, data.count(b"\n", 0, e.start) + 1) from None
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: malformed JSON ({e.msg}); fix the file") from None
        if not isinstance(rows, list):
            raise DataError(f"{path}: a .json source must hold a list of row objects (use .jsonl for one per line)")
        yield from ((f"{path} row {i}", row) for i, row in enumerate(rows))
    elif suffix == ".parquet":
        index = 0
        for batch in parquet_file(path).iter_batches():
            for row in batch.to_pylist():
                yield f"{path} row {index}", row
                index += 1
    else:
        yield str(path), {"text": path.read_text(encoding="utf-8-sig", errors="replace")}


def parquet_file(path: Path):
    """pyarrow's ParquetFile, or DataError naming the file (pyarrow's own error names none: in a folder of shards
    the broken one was not said), a git-lfs pointer said as one."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        with open(path, "rb") as f:
            lfs = f.read(40).startswith(b"version https://git-lfs")
        hint = "a git-lfs pointer, not the data: run `git lfs pull` in its repository" if lfs else str(e)
        raise DataError(f"{path}: not a readable Parquet file ({hint})") from None


def _reader_code_hash() -> str:
    """This module's and textcheck's source, hashed: part of the rows cache's key (see load_local)."""
    import hashlib
    import inspect

    from draftforge.data import textcheck

    here = inspect.getsource(inspect.getmodule(_reader_code_hash))
    return hashlib.sha256((here + inspect.getsource(textcheck)).encode()).hexdigest()[:16]


def _generate_rows(files, fmt, text_field, signature):
    # `signature` (size, mtime, ctime per file, the reading code's hash) is unused here; it is part of gen_kwargs so
    # the datasets cache fingerprint changes whenever a file or the code that reads it changes.
    del signature
    for name in files:
        for where, row in iter_located_rows(Path(name)):
            if not isinstance(row, dict):
                row = {}
            if row_suffix(Path(name)) is None and fmt == "text":
                row = {text_field: row["text"]}
            yield normalize_row(row, fmt, text_field, where)


def _count_rows(path: Path, fmt: str) -> int:
    suffix = row_suffix(path)
    if fmt == "tokens":  # validate every row here: an error raised inside the datasets builder loses its message
        if suffix is None:
            raise DataError(f"{path}: format=tokens reads .jsonl/.json/.parquet rows of input_ids, not raw files")
        return sum(1 for where, row in iter_located_rows(path)
                   if normalize_tokens(row if isinstance(row, dict) else {}, where) is not None)
    if suffix == ".parquet":
        return parquet_file(path).metadata.num_rows
    if suffix in (".jsonl", ".json"):
        return sum(1 for _ in iter_file_rows(path))
    return 1


@contextlib.contextmanager
def no_datasets_bars():
    """datasets' own bars off for a step of draftforge's (e.g. "Generating train split" over the user's few
    local rows on every new file), then as they were, so the tokenizing bar a user waits on still shows."""
    if datasets.utils.are_progress_bars_disabled():
        yield
        return
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.enable_progress_bars()


def load_local(files: list[Path], fmt: str, text_field: str) -> datasets.Dataset:
    """Local files -> a normalized Dataset, cached by datasets (keyed on paths, sizes, mtimes)."""
    names = [str(f.resolve()) for f in files]
    for f in files:  # here, not in the datasets builder: it may run in another process and loses the message
        check_text_file(f)
    # Read JSON/JSONL eagerly once so a malformed line is reported with its location
    # here, not from deep inside the datasets builder (which also rejects zero rows).
    if sum(_count_rows(f, fmt) for f in files) == 0:
        raise DataError(f"data files {[str(f) for f in files][:3]} have no rows; check the paths or the files")
    # the cache key: each file's size, mtime and ctime (a same-size rewrite given back its old mtime, as cp -p and
    # rsync -t do, still changes ctime) and the code that reads rows (an upgrade that normalises rows otherwise
    # served the old rows from the datasets cache)
    # (a tuple: datasets shards a generator over its list arguments, and `files` is the one list)
    signature = (*((os.path.getsize(n), os.stat(n).st_mtime_ns, os.stat(n).st_ctime_ns) for n in names), _READER_CODE)
    with no_datasets_bars():
        return datasets.Dataset.from_generator(
            _generate_rows, features=features_for(fmt),
            gen_kwargs={"files": names, "fmt": fmt, "text_field": text_field, "signature": signature},
        )


def load_hf(spec: str, cfg, fmt: str, text_field: str):
    """A Hugging Face dataset (Hub name or local dataset folder) -> normalized rows."""
    name = spec[3:] if spec.startswith("hf:") else spec
    try:
        raw = datasets.load_dataset(name, cfg.hf_config, split=cfg.split, streaming=cfg.streaming)
    except (ValueError, FileNotFoundError, ConnectionError, OSError) as e:
        raise DataError(f"could not load Hugging Face dataset {name!r} (config {cfg.hf_config!r}, split "
                        f"{cfg.split!r}): {e}. Check the name, hf_config, split and network access") from None
    columns = raw.column_names  # None for some streamed datasets: extra columns then ride along
    return raw.map(normalize_row, fn_kwargs={"fmt": fmt, "text_field": text_field, "where": f"dataset {name}"},
                   remove_columns=columns, features=features_for(fmt) if columns is not None else None)


def load_sources(cfg):
    """All recipe sources -> one normalized Dataset (or IterableDataset when streaming)."""
    fmt = cfg.format
    if fmt not in FORMATS:
        raise DataError(f"unknown data.format {fmt!r}; use one of {', '.join(FORMATS)}")
    if not cfg.sources:
        raise DataError("data.sources is empty; list at least one dataset name, file, folder or glob")
    parts = []
    for spec in cfg.sources:
        if is_hf_name(spec):
            parts.append(load_hf(spec, cfg, fmt, cfg.text_field))
        else:
            files = resolve_local_files(spec, cfg.file_glob)
            local = load_local(files, fmt, cfg.text_field)
            parts.append(local.to_iterable_dataset() if cfg.streaming else local)
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def check_overlaps(cfg) -> None:
    """DataError for a local file that data.sources reach twice (listed twice, or in a folder or glob and by name:
    its rows were read twice, and the split could put the copies on both sides) or that data.eval_sources reach as
    well (trained on and evaluated on), naming the file and the two specs."""
    def reached(specs, key: str) -> dict[Path, str]:
        seen: dict[Path, str] = {}
        for spec in specs:
            if is_hf_name(spec):
                continue
            for f in resolve_local_files(spec, cfg.file_glob, quiet=True):
                real = f.resolve()
                if real in seen:
                    raise DataError(f"{key} reach {f} twice ({seen[real]!r} and {spec!r}): its rows would be read "
                                    "twice; list each file once")
                seen[real] = spec
        return seen

    train = reached(cfg.sources, "data.sources")
    for real, spec in reached(cfg.eval_sources, "data.eval_sources").items():
        if real in train:
            raise DataError(f"{real} is both a training source (through {train[real]!r}) and an eval source "
                            f"({spec!r}): its rows would be trained on and evaluated on; keep it out of data.sources "
                            "(a glob or file_glob can leave it out)")


def check_token_sources(cfg, tokenizer) -> None:
    """format=tokens recipe sources against the tokenizer it trains with, before any row is read."""
    files, outside = [], []
    for spec in cfg.sources:
        if is_hf_name(spec):
            outside.append(f"dataset {spec}")
        else:
            files += resolve_local_files(spec, cfg.file_glob, quiet=True)  # load_sources gives the notice
    check_row_files(files, tokenizer, TRAIN_FIX, outside)


_READER_CODE = _reader_code_hash()
