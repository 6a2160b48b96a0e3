"""Which tokenizer (and target) made a file of token ids, and the checks that refuse another one.

Token ids mean nothing without their tokenizer: rows made with one tokenizer train a drafter of another
without any error, the ids are simply read as other tokens. So every file of ids draftforge writes records
the fingerprint of its tokenizer (export.tokenizer_fingerprint, the one exports are checked with) and of
the target that made it: a JSONL of token rows in a sidecar `ROWS.meta.json`, written before its first
row; a harvest in its harvest.json. Readers compare that record with the tokenizer they train or run with
and refuse a mismatch in one line naming both; rows with no record (made outside draftforge) are used
as they are, after a one-line notice.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from draftforge.errors import DataError

SIDECAR_SUFFIX = ".meta.json"
VERSION = 1
OUTSIDE = "rows from outside draftforge: ids are used as they are; their tokenizer cannot be checked"
TRAIN_FIX = ("regenerate the rows with the target you train for (draftforge generate --target ...), "
             "or point model.target / model.tokenizer at {theirs}")


def sidecar_path(rows) -> Path:
    rows = Path(rows)
    return rows.with_name(rows.name + SIDECAR_SUFFIX)


def is_sidecar(path) -> bool:
    """A sidecar next to its rows file: folder and glob sources skip it (it is no data of its own)."""
    path = Path(path)
    return path.name.endswith(SIDECAR_SUFFIX) and path.with_name(path.name[: -len(SIDECAR_SUFFIX)]).is_file()


def tokenizer_identity(tokenizer) -> dict:
    """{"tokenizer": its name or path, "tokenizer_fingerprint": ...}; both None without a tokenizer."""
    if tokenizer is None:
        return {"tokenizer": None, "tokenizer_fingerprint": None}
    from draftforge.export import tokenizer_fingerprint

    return {"tokenizer": getattr(tokenizer, "name_or_path", None) or None,
            "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer)}


def rows_record(tokenizer, model, target, written_by: str) -> dict:
    """The sidecar of rows a target wrote. The target's fingerprint is models.cali_ts's: it rounds weights to
    bfloat16, so the same target loaded in float32 on one machine and bfloat16 on another stays the same."""
    from draftforge.models.cali_ts import model_fingerprint

    return {**tokenizer_identity(tokenizer), "target": str(target) if target else None,
            "target_fingerprint": model_fingerprint(model) if model is not None else None,
            "written_by": written_by, "version": VERSION}


def write_sidecar(rows, record: dict) -> None:
    from draftforge.fsutil import atomic_write_text

    atomic_write_text(sidecar_path(rows), json.dumps(record, indent=2, sort_keys=True) + "\n")


def foreign_sidecar(rows, written_by: str) -> Path | None:
    """The sidecar path of rows not written yet, where something other than `written_by`'s own record is there
    (a user's file, a link, a folder, an unreadable record): writing the rows would replace it. None if free."""
    path = sidecar_path(rows)
    if not path.exists() and not path.is_symlink():
        return None
    if path.is_symlink() or not path.is_file():
        return path
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return path
    return None if isinstance(record, dict) and record.get("written_by") == written_by else path


def read_sidecar(rows) -> dict | None:
    """The record next to `rows`, None when there is none; DataError for one that cannot be read."""
    path = sidecar_path(rows)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not a readable draftforge sidecar ({e}); regenerate the rows, or remove it "
                        "to use them unchecked") from None
    if not isinstance(record, dict):
        raise DataError(f"{path}: a draftforge sidecar holds a JSON object; regenerate the rows, or remove it "
                        "to use them unchecked")
    return record


def describe(record: dict) -> str:
    name = record.get("tokenizer") or "an unnamed tokenizer"
    text = f"{name} (tokenizer fingerprint {str(record.get('tokenizer_fingerprint'))[:12]})"
    return text + (f" of target {record['target']}" if record.get("target") else "")


def check_record(record: dict | None, ours: dict, where: str, fix: str) -> bool:
    """True when `record` names our tokenizer; False when it names none (cannot be checked); DataError
    naming both sides when it names another. `fix` may say {theirs}: the target or tokenizer that made it."""
    theirs = (record or {}).get("tokenizer_fingerprint")
    if not theirs or not ours.get("tokenizer_fingerprint"):
        return False
    if theirs == ours["tokenizer_fingerprint"]:
        return True
    made_by = record.get("target") or record.get("tokenizer") or "the tokenizer that made them"
    raise DataError(f"{where}: its token ids were made with {describe(record)}, but this run uses "
                    f"{describe(ours)}; {fix.format(theirs=made_by)}")


def notice(what: list[str], text: str = OUTSIDE) -> None:
    shown = ", ".join(what[:2]) + (f" and {len(what) - 2} more" if len(what) > 2 else "")
    print(f"[draftforge] notice: {shown}: {text}", file=sys.stderr, flush=True)


def check_row_files(files, tokenizer, fix: str = TRAIN_FIX, outside=()) -> None:
    """Refuse a rows file whose sidecar names another tokenizer; one notice for those with no record (and
    for `outside` sources, e.g. Hub datasets). Without a tokenizer of ours there is nothing to compare."""
    if tokenizer is None:
        return
    ours = tokenizer_identity(tokenizer)
    unchecked = list(outside)
    for f in files:
        if not check_record(read_sidecar(f), ours, str(f), fix):
            unchecked.append(str(f))
    if unchecked:
        notice(unchecked)


def open_rows_file(out: Path, record: dict) -> None:
    """Before a writer appends to `out`: a new (or empty) file gets its sidecar first, so rows never exist
    without one; rows already there must come from the same tokenizer and target (else DataError, nothing
    written). Rows with no sidecar stay unchecked: a sidecar now would vouch for rows it never saw."""
    out = Path(out)
    if not out.is_file() or out.stat().st_size == 0:
        write_sidecar(out, record)
        return
    old = read_sidecar(out)
    if old is None:
        notice([str(out)], "its rows have no sidecar (written outside draftforge or before sidecars): new rows "
                           "are appended, and the file's tokenizer stays unchecked")
        return
    changed = [name for key, name in (("tokenizer_fingerprint", "tokenizer"), ("target_fingerprint", "target"))
               if old.get(key) != record.get(key)]
    if changed:
        raise DataError(f"{out} holds rows made with {describe(old)}, not with {describe(record)} (another "
                        f"{' and another '.join(changed)}); resume with --target {old.get('target') or '(the same)'}, "
                        "or pass another --out")
