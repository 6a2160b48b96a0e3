"""Is a local data file text? One cheap, deterministic look at its first 8 KiB, before anything reads it.

A data source trains on whatever it reads: random bytes named .txt, a PNG in a folder of code. So every
local-file path asks `non_text_reason` first: resolve_local_files (a file source is refused, a folder's or
glob's non-text files are skipped with one notice), load_local, iter_located_rows and iter_jsonl. They run in
the process that reads the recipe, before any model is built and before the datasets builder (which may run
elsewhere, loses an error's message and writes the cache) sees a file.

The rule, on the first SNIFF_BYTES (decompressed for a .jsonl.gz name, the one compressed form read): a known
binary signature (PNG, JPEG, GIF, PDF, ZIP, gzip, Parquet, a UTF-16 byte-order mark), a NUL byte, or bytes
that are not UTF-8 make a file non-text; a character cut by the 8 KiB boundary is not an error. A .parquet
file is binary by design and not looked at. Past the first 8 KiB, iter_jsonl names a line that is not UTF-8,
and a text document reads such bytes as replacement characters.
"""

from __future__ import annotations

import codecs
import gzip
import sys
import zlib
from pathlib import Path

from draftforge.errors import DataError

SNIFF_BYTES = 8192
GZIP_ERRORS = (gzip.BadGzipFile, EOFError, zlib.error)
SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"),
    (b"GIF87a", "a GIF image"),
    (b"GIF89a", "a GIF image"),
    (b"%PDF-", "a PDF document"),
    (b"PK\x03\x04", "a ZIP archive"),
    (b"PK\x05\x06", "a ZIP archive"),
    (b"\x1f\x8b", "gzip data (only a .jsonl.gz name is read decompressed)"),
    (b"PAR1", "Parquet data (name it .parquet)"),
    (b"\xff\xfe", "UTF-16 text (save it as UTF-8)"),
    (b"\xfe\xff", "UTF-16 text (save it as UTF-8)"),
)
SHOWN = 5
"""A skip notice or error names this many files, then counts the rest."""


def gzip_error(path, e: Exception) -> DataError:
    return DataError(f"{path}: not a readable gzip file ({e}); fetch or compress it again")


def is_gzipped_jsonl(path: str | Path) -> bool:
    """A .jsonl.gz name: the one compressed form the readers open with gzip (any other gzip file is binary)."""
    return Path(path).name.lower().endswith(".jsonl.gz")


def _open_bytes(path: Path):
    return gzip.open(path, "rb") if is_gzipped_jsonl(path) else open(path, "rb")


def non_text_reason(path: str | Path) -> str | None:
    """Why `path` is not text (e.g. "a PNG image"), or None for a text file and for any .parquet file.

    An unreadable .jsonl.gz is neither: DataError, as iter_jsonl says it."""
    path = Path(path)
    if path.suffix.lower() == ".parquet":
        return None
    try:
        with _open_bytes(path) as f:
            raw = f.read(SNIFF_BYTES + 1)  # one byte more: is the file longer than what is looked at?
    except GZIP_ERRORS as e:
        raise gzip_error(path, e) from None
    head = raw[:SNIFF_BYTES]
    for magic, what in SIGNATURES:
        if head.startswith(magic):
            return what
    nul = head.find(b"\0")
    if nul >= 0:
        return f"a NUL byte at byte {nul}"
    try:  # final=False at a cut: a character split by the boundary waits for bytes that are not read
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(raw) <= SNIFF_BYTES)
    except UnicodeDecodeError as e:
        return f"not UTF-8: byte 0x{head[e.start]:02x} at byte {e.start}"
    return None


def check_text_file(path: str | Path) -> None:
    """DataError naming `path` unless it is text (or .parquet); see the module docstring for the rule."""
    reason = non_text_reason(path)
    if reason:
        raise DataError(f"{path}: not a text file ({reason}); data files must be UTF-8 text (.txt, source "
                        "code, .jsonl, .json) or .parquet rows")


def _names(files: list[Path], root: Path) -> str:
    names = [str(f.relative_to(root)) if f.is_relative_to(root) else str(f) for f in files[:SHOWN]]
    return ", ".join(names) + (f" and {len(files) - SHOWN} more" if len(files) > SHOWN else "")


def text_files_only(files: list[Path], source: str, root: Path, quiet: bool = False) -> list[Path]:
    """The text files of a folder or glob source: one notice names those skipped (unless `quiet`), and
    DataError if none is left. `root` is the folder the names are shown relative to."""
    kept, skipped = [], []
    for f in files:
        (skipped if non_text_reason(f) else kept).append(f)
    if skipped and not kept:
        raise DataError(f"data source {source!r} has no text file: {len(skipped)} non-text file"
                        f"{'s' if len(skipped) > 1 else ''} ({_names(skipped, root)}); give UTF-8 text "
                        "(.txt, source code, .jsonl, .json) or .parquet rows")
    if skipped and not quiet:
        print(f"[draftforge] notice: skipped {len(skipped)} non-text file{'s' if len(skipped) > 1 else ''} in "
              f"{root}: {_names(skipped, root)}", file=sys.stderr, flush=True)
    return kept


def first_bad_utf8_line(path: str | Path) -> int:
    """The number of the first line of `path` (decompressed for .jsonl.gz) that is not UTF-8; 0 if there is none.

    Lines split at b"\\n", which no UTF-8 character contains, so each line decodes on its own."""
    with _open_bytes(Path(path)) as f:
        for line_no, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return line_no
    return 0
