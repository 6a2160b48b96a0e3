"""The regression digests prove a refactor changed nothing, so their comparison must not be blind: a missing item,
a shorter loss curve, an empty digest and a file that is not a digest each fail; --out never replaces a user's file."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.regression import decode_digest, loss_digest
from tests import REPO


def _write(path, data) -> str:
    path.write_text(json.dumps(data))
    return str(path)


def test_loss_digest_compare_names_what_is_missing_shorter_or_empty(tmp_path, capsys):
    # before: KeyError for an item missing from B, ValueError for an empty list, "max relative difference 0.00e+00"
    # for a shorter curve, and exit 0 for an empty A (nothing compared)
    a = _write(tmp_path / "a.json", {"x_losses": [1.0, 2.0], "x_eval": 1.5, "y": "s"})
    shorter = _write(tmp_path / "b.json", {"x_losses": [1.0], "z": 3})
    assert loss_digest.compare(a, shorter) == 1
    out = capsys.readouterr().out
    assert "| x_losses | differs: 2 values vs 1 |" in out and "| x_eval | missing from" in out
    assert "| z | only in" in out
    empty_list = _write(tmp_path / "c.json", {"x_losses": [], "x_eval": 1.5, "y": "s"})
    assert loss_digest.compare(a, empty_list) == 1 and "differs: 2 values vs 0" in capsys.readouterr().out
    last_digit = _write(tmp_path / "d.json", {"x_losses": [1.0, 2.0000000000000004], "x_eval": 1.5, "y": "s"})
    assert loss_digest.compare(a, last_digit) == 1 and "max relative difference 2.22e-16" in capsys.readouterr().out
    assert loss_digest.compare(a, a) == 0
    assert loss_digest.compare(_write(tmp_path / "e.json", {}), a) == 1
    assert "holds no items: nothing was compared" in capsys.readouterr().out


def test_decode_digest_compare_fails_when_nothing_is_in_both(tmp_path, capsys):
    a = _write(tmp_path / "a.json", {"k": [[1, 2], [0, 1]]})
    assert decode_digest.compare(a, a) == 0
    assert decode_digest.compare(_write(tmp_path / "e.json", {}), a) == 1
    assert "nothing was compared" in capsys.readouterr().out
    assert decode_digest.compare(a, _write(tmp_path / "t.json", {"k": [[1, 3], [0, 1]]})) == 1


@pytest.mark.parametrize("argv, message", [
    (["--compare", "{tmp}/nope.json", "{tmp}/a.json"], "error: {tmp}/nope.json: not a readable digest"),
    (["--out", "{tmp}/notes.txt"], "error: --out {tmp}/notes.txt exists and is not a digest written by draftforge's "
                                   "benchmarks; it is not replaced"),
    (["--out", "{tmp}/mine.json"], "error: --out {tmp}/mine.json exists and is not a digest written by"),
    (["--out", "{tmp}"], "error: --out {tmp} is a directory"),
])
def test_a_file_that_is_not_a_digest_is_one_line_and_kept(tmp_path, argv, message):
    # a missing file was a traceback with exit 1 (the exit of "differ"); --out over a user's file replaced it after
    # the run, and --out a directory failed only after the run
    (tmp_path / "notes.txt").write_text("mine\n")
    (tmp_path / "mine.json").write_text('{"k": "a JSON object of the user\'s, not a digest"}')
    _write(tmp_path / "a.json", {"k": [[1], [0]]})
    done = subprocess.run([sys.executable, "-m", "benchmarks.regression.decode_digest",
                           *[a.format(tmp=tmp_path) for a in argv]], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith(message.format(tmp=tmp_path))
    assert len(done.stderr.strip().splitlines()) == 1
    assert (tmp_path / "notes.txt").read_text() == "mine\n"


def test_a_benchmarks_json_never_replaces_a_users_file(tmp_path, capsys):
    # decode_digest / loss_digest and every write_json user replaced any file at --out after the run
    from benchmarks.common import json_out_problem, write_json

    mine = tmp_path / "notes.json"
    mine.write_text("my notes\n")
    with pytest.raises(SystemExit, match=r"notes.json exists and is not a JSON result written by draftforge's "
                                         r"benchmarks; it is not replaced"):
        write_json(mine, {"median_ms": 1.5})
    assert mine.read_text() == "my notes\n" and '"median_ms": 1.5' in capsys.readouterr().out  # printed, not lost
    assert json_out_problem(tmp_path, "--json").startswith("--json ") and "is a directory" in json_out_problem(tmp_path)
    earlier = tmp_path / "r.json"
    write_json(earlier, {"a": 1})
    write_json(earlier, {"a": 2})  # an earlier result is replaced
    assert json.loads(earlier.read_text()) == {"a": 2, "written_by": "draftforge benchmarks"}
    theirs = tmp_path / "theirs.json"  # a JSON object is not a result for being one
    theirs.write_text('{"a": 1}')
    with pytest.raises(SystemExit, match="theirs.json exists and is not a JSON result"):
        write_json(theirs, {"a": 2})
    assert theirs.read_text() == '{"a": 1}'


def test_a_benchmarks_draftforge_error_is_one_line(capsys):
    # spec_decode / eval_memory with an unknown method ended in a RecipeError traceback
    from benchmarks.common import one_line_errors
    from draftforge.errors import RecipeError

    @one_line_errors
    def main():
        raise RecipeError("unknown method 'bogus'")

    assert main() == 2 and capsys.readouterr().err == "error: unknown method 'bogus'\n"
