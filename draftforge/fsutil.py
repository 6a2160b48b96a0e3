"""Atomic writes that leave files with the usual permissions.

`tempfile.mkdtemp` / `mkstemp` create 0700 / 0600 entries (private on purpose); renamed into
place they would keep those modes, so a serving process under another account could not read a
model that was just exported. Every temp entry made here gets the mode a plain mkdir / open would
have given it under the current umask.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)  # the only portable way to read it: set, then restore at once
    os.umask(mask)
    return mask


def temp_dir_beside(target: Path, tag: str = "tmp") -> Path:
    """An empty hidden directory next to `target` (same filesystem, so a rename is atomic), mode 0777 & ~umask."""
    target.parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f".{target.name}.{tag}-", dir=target.parent))
    os.chmod(path, 0o777 & ~_umask())
    return path


def atomic_write_text(path: Path, text: str) -> None:
    """Write via a temp file + rename, so a killed run never leaves a half-written file; mode 0666 & ~umask."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def usual_permissions(root: Path) -> None:
    """Give `root` and everything under it the modes a plain mkdir / open would (some writers, e.g.
    safetensors through transformers, create 0600 files)."""
    mask = _umask()
    root = Path(root)
    for p in [root, *root.rglob("*")]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def _files_under(root: Path) -> set[str]:
    """Every file, link (to a folder too) and empty folder under `root` (relative paths; a folder ends in /)."""
    return {p.relative_to(root).as_posix() + ("/" if p.is_dir() and not p.is_symlink() else "")
            for p in root.rglob("*") if p.is_symlink() or not p.is_dir() or not any(p.iterdir())}


def files_only_in(old: Path, new: Path) -> list[str]:
    """Files, links and empty folders under `old` that `new` does not hold (relative paths): what replacing `old`
    by `new` would delete."""
    return sorted(_files_under(old) - _files_under(new)) if Path(old).is_dir() else []


def some_entries(path: Path, n: int = 3) -> str:
    """The first `n` entries of a directory by name (folders marked /), and how many more."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in Path(path).iterdir())
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def foreign_dir_problem(out: Path, marker: str, what: str) -> str | None:
    """Why a command that writes `what` (its record: `marker`) may not write into `out`: a non-empty directory
    without that record holds someone else's files. None for a new or empty directory, or its own."""
    out = Path(out)
    if out.is_dir() and not (out / marker).exists() and any(out.iterdir()):
        return (f"--out {out} holds files that are not {what} ({some_entries(out)}; no {marker}); choose a new or "
                "empty --out")
    return None


def write_dir_atomically(out_dir: Path, fill) -> Path:
    """Build a directory with `fill(tmp_dir)` in a temp dir beside `out_dir`, give it the usual permissions,
    then rename it onto `out_dir` (an old copy is replaced only once the new one is complete). An old copy that
    holds files the new one does not (a README, an eval report put there by hand) is not replaced: CheckpointError
    naming them, nothing changed."""
    from draftforge.errors import CheckpointError

    out_dir = Path(out_dir)
    tmp_dir = temp_dir_beside(out_dir)
    try:
        fill(tmp_dir)
        usual_permissions(tmp_dir)
        foreign = files_only_in(out_dir, tmp_dir)
        if foreign:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            raise CheckpointError(f"{out_dir} holds files the new copy would not hold ({shown}); replacing it "
                                  "would delete them: move them out, or write to another directory")
        replace_dir(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def replace_dir(tmp_dir: Path, out_dir: Path) -> None:
    """Rename the finished `tmp_dir` onto `out_dir`; an existing `out_dir` is moved aside first, put back if
    the rename fails, and removed after. A link at `out_dir` gives way to the new directory and is removed as a
    link (the directory it pointed at is left as it is): rmtree refused it, and a stray `.NAME.old-*` link stayed."""
    if not out_dir.exists() and not out_dir.is_symlink():
        tmp_dir.rename(out_dir)
        return
    old_dir = temp_dir_beside(out_dir, "old")
    old_dir.rmdir()
    out_dir.rename(old_dir)
    try:
        tmp_dir.rename(out_dir)
    except BaseException:
        old_dir.rename(out_dir)
        raise
    if old_dir.is_symlink():
        old_dir.unlink()
    else:
        shutil.rmtree(old_dir, ignore_errors=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_json(path: Path, redo: str):
    """The parsed JSON file at `path`; CheckpointError naming it when it is corrupt (`redo`: what to do then)."""
    from draftforge.errors import CheckpointError

    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is corrupt ({err}); {redo}") from None


def read_safetensors(path: Path, redo: str) -> dict:
    """The tensors of the safetensors file at `path`; CheckpointError naming it when it is truncated, empty or not
    safetensors at all (`redo`: what to do then), not the library's traceback."""
    from safetensors.torch import load_file

    from draftforge.errors import CheckpointError, first_line

    try:
        return load_file(str(path))
    except Exception as err:  # SafetensorError, OSError, ...: a damaged or foreign file
        raise CheckpointError(f"{path} cannot be read ({first_line(err)}); {redo}") from None


def output_problem(path: str | Path, kind: str) -> str | None:
    """Why `path` cannot be written as an output `kind` ("dir" or "file"), else None: checked before any model
    loads, so that a command never measures for minutes and then fails to save. A missing path is fine when its
    nearest existing ancestor is a writable directory."""
    path = Path(path).expanduser()
    if path.exists():
        if kind == "dir" and not path.is_dir():
            return f"{path} is a file, not a directory"
        if kind == "file" and path.is_dir():
            return f"{path} is a directory, not a file"
        where = path if path.is_dir() else path.parent
    else:
        where = next((p for p in path.parents if p.exists()), Path("."))
        if not where.is_dir():
            return f"{where} is a file, so {path} cannot be created"
    if not writable(where):
        return f"{where} is not writable"
    return None


def writable(directory: Path) -> bool:
    """Whether a file can be created in `directory`: tried (a hidden probe file, removed at once), since permission
    bits say nothing of a read-only mount, /proc or a full disk, and nothing at all to root."""
    if not os.access(directory, os.W_OK | os.X_OK):
        return False
    try:
        fd, probe = tempfile.mkstemp(prefix=".draftforge-probe-", dir=directory)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


class OutputLock:
    """`with OutputLock(out, "draftforge generate"):` one writer per output at a time. A file `.NAME.lock` beside
    `out` holds the writer's pid; a second writer started while the first runs is refused in one line (two
    appending to one file doubled its rows). A lock whose process is gone (killed) is taken over. Removed on
    exit, whatever the exit."""

    def __init__(self, out: str | Path, what: str):
        out = Path(out)
        self.path, self.out, self.what = out.with_name(f".{out.name}.lock"), out, what

    def __enter__(self):
        import socket
        import time

        from draftforge.errors import DraftforgeError

        mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "what": self.what,
                           "started": time.strftime("%Y-%m-%dT%H:%M:%S")})
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is not None:
                    raise DraftforgeError(
                        f"{self.out} is being written by another {holder.get('what', 'process')} (pid "
                        f"{holder['pid']}, started {holder.get('started', '?')}); wait for it to finish or stop it "
                        f"(its lock: {self.path})") from None
                self.path.unlink(missing_ok=True)  # its writer is gone: a kill left it behind
                continue
            except OSError as e:  # a read-only mount, /proc, a parent that is not a directory
                raise DraftforgeError(f"{self.out} cannot be written: its lock {self.path} cannot be created "
                                      f"({e.strerror}); choose a writable place") from None
            with os.fdopen(fd, "w") as f:
                f.write(mine + "\n")
            return self
        raise DraftforgeError(f"could not take the lock {self.path}; remove it if no draftforge command is writing "
                              f"{self.out}")

    def _holder(self) -> dict | None:
        """The lock's record while its process lives on this host, else None (stale, or unreadable)."""
        import socket

        try:
            holder = json.loads(self.path.read_text())
            pid = int(holder["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if holder.get("host") != socket.gethostname():
            return holder  # another machine's process on a shared disk: cannot be checked, so it holds
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:  # alive, another user's
            return holder
        return holder

    def __exit__(self, *exc):
        self.path.unlink(missing_ok=True)
        return False


@contextlib.contextmanager
def shared_lock(out, what: str, main: bool = True, share=None):
    """Hold `OutputLock(out, what)` for the block across the processes of one launch: the main process takes it
    (a lock whose process died is taken over) and `share(problem)` hands its verdict to every process (returns the
    main process's value; None for one process), so all of them stop with the same line when another command holds
    it. A parent directory that does not exist yet is made for the lock (two commands starting into the same new
    `runs/x` collide as surely as into an existing one); those of the directories it made that are still empty at
    the end are removed again, so a refused command leaves nothing behind."""
    from draftforge.errors import DraftforgeError

    lock, problem, made = None, None, []
    if main:
        out = Path(out).expanduser().resolve()
        if out.name:
            made = _make_parents(out.parent)
            lock = OutputLock(out, what)
            try:
                lock.__enter__()
            except DraftforgeError as e:
                lock, problem = None, str(e)
    try:
        if share is not None:
            problem = share(problem)
        if problem:
            raise DraftforgeError(problem)
        yield
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)
        for directory in made:  # deepest first; one that now holds anything stays
            try:
                directory.rmdir()
            except OSError:
                break


def _make_parents(directory: Path) -> list[Path]:
    """mkdir -p `directory`; the directories it made, deepest first ([] where it existed or cannot be made: the
    lock's own error then says why)."""
    missing = []
    while not directory.exists() and directory != directory.parent:
        missing.append(directory)
        directory = directory.parent
    try:
        for d in reversed(missing):
            d.mkdir()
    except OSError:
        return [d for d in missing if d.is_dir()]
    return missing
