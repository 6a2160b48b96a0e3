"""What the CLI says to a user: per-command Ctrl-C messages, help text, and the notices it keeps quiet."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import datasets
import pytest

from draftforge import cli


def _interrupt(args) -> int:
    raise KeyboardInterrupt


SAYS = {
    "train": "interrupted: the last saved checkpoint is kept (one every train.save_every steps); rerun with --resume",
    "eval": "interrupted: no report was written for this run",
    "generate": "interrupted: the rows already appended to --out are kept; rerun the same command to continue",
    "harvest": "interrupted: the finished shards in --out are kept; rerun the same command with --resume",
    "demo": "interrupted: what the drafter runs in --out saved is kept; rerun the same command with --resume",
}


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))  # every command; those without words of their own:
def test_ctrl_c_says_what_this_command_left_and_exits_130(monkeypatch, capsys, command):  # "interrupted"
    says = SAYS.get(command, "interrupted\n")
    # Every command's run is replaced by one that is interrupted at once (no model is loaded).
    monkeypatch.setattr(cli, "_load", lambda spec: (lambda parser: None, _interrupt))
    assert cli.main([command]) == 130
    err = capsys.readouterr().err
    assert says in err, err
    if command != "train":
        assert "checkpoint" not in err, err  # training's words, which eval used to print


def _help(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as done:
        cli.main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_harvest_theta_help_is_a_users_text_with_device_documented(capsys):
    out = _help(capsys, "harvest", "theta")
    assert "Legend" not in out and "`draftforge harvest theta`:" not in out  # the module docstring's
    assert "continues with --resume" in out
    assert "cpu, cuda or cuda:N (default cpu)" in " ".join(out.split())


def test_harvest_trees_help_states_its_defaults(capsys):
    out = " ".join(_help(capsys, "harvest", "trees").split())
    for default in ("use only the first N prompts (default: all)", "(default auto)", "(default cpu)",
                    "(default 128)", "(default 10)", "(default 1000)"):
        assert default in out, default


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_cpu_notice_is_quiet_from_the_first_cli_call():
    # DeepSpeed logs "Setting accelerator to CPU" while it is imported (here by save_pretrained, deep in a
    # command), so the filter must be in place before any command runs.
    script = ("from draftforge.cli import main\n"
              "main([])\n"
              "import deepspeed\n"
              "from deepspeed.accelerator import get_accelerator\n"
              "print('accelerator', get_accelerator().device_name())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "accelerator " in done.stdout
    assert "Setting accelerator to CPU" not in done.stdout + done.stderr


def test_reading_local_rows_shows_no_generating_split_bar(tmp_path, capsys):
    from draftforge.data.sources import load_local

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"input_ids": [1, 2, 3, i], "prompt_len": 1}) + "\n" for i in range(5)))
    was_disabled = datasets.utils.are_progress_bars_disabled()
    assert len(load_local([rows], "tokens", "text")) == 5
    assert "Generating train split" not in capsys.readouterr().err
    assert datasets.utils.are_progress_bars_disabled() == was_disabled  # the bars the user wants come back


def test_token_rows_are_not_called_tokenized():
    from draftforge.data.pipeline import _tokenize_desc

    assert _tokenize_desc("tokens", 1200, 256) == "cutting 1,200 token rows to 256 tokens"
    assert _tokenize_desc("text", 3, 256) == "tokenizing 3 documents"
    assert _tokenize_desc("chat", 3, 256) == "tokenizing 3 conversations"


@pytest.mark.slow
def test_ctrl_c_in_a_real_eval_says_no_report_and_writes_none(tmp_path):
    """A real `draftforge eval` process gets SIGINT once it is timing: exit 130, eval's own message, no report."""
    import os
    import signal
    import time

    from benchmarks.decoding import spec_decode as bench

    paths = bench.save_random_models(tmp_path / "models")
    prompts = bench.write_random_prompts(tmp_path / "p.jsonl", 200)
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "draftforge", "eval", "--target", paths["target"], "--bench",
                             prompts, "--methods", "ar", "--max-new-tokens", "64", "--repeats", "3", "--out",
                             str(out), "--cost-repeats", "1", "--no-plots"], stderr=subprocess.PIPE, text=True,
                            env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # not inherited ignored
    err = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # wait until it times: models loaded, prompts read, pass under way
        line = proc.stderr.readline()
        err.append(line)
        if "method order" in line or not line:
            break
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=120)[1]
    text = "".join(err) + rest
    assert proc.returncode == 130, text[-2000:]
    assert "interrupted: no report was written for this run" in text
    assert not (out / "report.json").exists() and not (out / "report.md").exists()


def test_eval_speaks_in_its_own_words_once(random_models, tmp_path):
    """No transformers "Loading weights" bars, no doubled "[eval] [draftforge]" prefixes, no FutureWarning about a
    renamed cache argument: one line per step, in draftforge's words."""
    import subprocess
    import sys

    from benchmarks.decoding import spec_decode

    bench = spec_decode.write_random_prompts(tmp_path / "p.jsonl", 2)
    proc = subprocess.run([sys.executable, "-m", "draftforge", "eval", "--target", random_models["target"],
                           "--drafter", random_models["mamba_drafter"], "--bench", bench, "--methods", "ar,chain",
                           "--max-new-tokens", "6", "--repeats", "1", "--cost-repeats", "1", "--no-plots",
                           "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    err = proc.stderr
    assert "Loading weights" not in err and "Writing model shards" not in err
    assert "[eval] [draftforge]" not in err and err.count("[eval] target run in") == 1
    assert "FutureWarning" not in err and "deprecated" not in err


@pytest.mark.parametrize("flags, message", [
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--temperature", "0,x"], "--temperature expects numbers, got 'x'"),
    (["--temperature", "1", "--temperature", "0,1.0"], "--temperature names 1.0 twice"),  # ran every prompt twice
    (["--temperature", "nan"], "--temperature must be >= 0 (0 means greedy) and finite, got nan"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--repeats", "two"], "--repeats expects an integer, got 'two'"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
])
def test_eval_refuses_plain_bad_flags_before_importing_torch(flags, message):
    """Checked by draftforge/argcheck.py before the eval module (torch, transformers) is imported."""
    import subprocess
    import sys

    code = ("import sys; from draftforge.cli import main; rc = main(['eval', '--target', 't', '--bench', 'b'] + "
            f"{flags!r}); print('torch' in sys.modules, 'transformers' in sys.modules); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout.split() == ["False", "False"], proc.stdout + proc.stderr
    assert proc.stderr.count("error:") == 1 and message in proc.stderr and "Traceback" not in proc.stderr


def test_an_unwritable_place_is_one_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    # permission bits said /proc and a read-only mount were writable (to root always): commands measured or
    # trained, then died with a traceback; the check now creates a file there, and a refused write is one line
    import errno
    import tempfile

    from draftforge import fsutil
    from draftforge.cli import main

    def refused(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "x"))

    import draftforge.cli_target
    from draftforge.errors import DraftforgeError

    monkeypatch.setattr(tempfile, "mkstemp", refused)
    assert fsutil.output_problem(tmp_path / "out", "dir") == f"{tmp_path} is not writable"
    monkeypatch.undo()
    monkeypatch.setattr(draftforge.cli_target, "run", refused)  # a write refused deep inside a command
    assert main(["target", "prompts", "--out", str(tmp_path / "p.jsonl"), "-n", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {tmp_path / 'x'}: Read-only file system (the machine refused the access: check that "
                   "path's permissions, and that its disk is writable and has room)"]
    monkeypatch.setattr(fsutil.os, "open", refused)
    with pytest.raises(DraftforgeError, match=r"its lock .* cannot be created \(Read-only file system\)"):
        fsutil.OutputLock(tmp_path / "run", "draftforge train").__enter__()


def test_a_directory_or_a_binary_file_where_a_file_is_expected_is_named_as_such(tmp_path, capsys):
    # "does not exist" for a directory that exists, and a UnicodeDecodeError traceback for a binary recipe
    from draftforge.cli import main
    from draftforge.data.prompts import read_jsonl
    from draftforge.errors import DataError
    from draftforge.harvest.c2t import check_out

    assert main(["train", str(tmp_path)]) == 2
    assert f"recipe file {tmp_path} is a directory; give the YAML file" in capsys.readouterr().err
    binary = tmp_path / "model.safetensors"
    binary.write_bytes(b"\xd8\x00\xff\xfe" * 16)
    assert main(["train", str(binary)]) == 2
    err = capsys.readouterr().err
    assert "is not a text file" in err and "Traceback" not in err
    with pytest.raises(DataError, match="is a directory; give a JSONL file of prompts"):
        read_jsonl(tmp_path)
    cache = tmp_path / "cache"  # a hidden-state cache resumed as a trees harvest: not "another target"
    cache.mkdir()
    (cache / "harvest.json").write_text('{"kind": "hidden-cache", "target": "t"}')
    with pytest.raises(DataError, match="holds a hidden-cache, not a trees harvest"):
        check_out(cache, resume=True, overwrite=False)
    (cache / "harvest.json").write_text("[1, 2]")  # JSON, but no record: named, not an AttributeError
    with pytest.raises(DataError, match="is JSON but no harvest record"):
        check_out(cache, resume=True, overwrite=False)


def test_the_lock_makes_a_missing_parent_and_removes_it_when_nothing_was_written(tmp_path):
    from draftforge.fsutil import shared_lock

    with shared_lock(tmp_path / "a" / "b" / "out", "draftforge harvest"):
        assert (tmp_path / "a" / "b" / ".out.lock").is_file()
    assert list(tmp_path.iterdir()) == []  # a refused or empty command leaves nothing behind
    with shared_lock(tmp_path / "a" / "b" / "out", "draftforge harvest"):
        (tmp_path / "a" / "b" / "out").mkdir()
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == ["a", "a/b", "a/b/out"]


@pytest.mark.parametrize("value, message", [
    # the whole flag help (six lines) was pasted into the error; the range error offered "None", which a command
    # line cannot spell
    ("abc", "error: --prefill-chunk: cannot read 'abc' (encode each prompt in forwards of N tokens, each continuing "
            "the K/V cache)\n"),
    ("0", "error: --prefill-chunk must be a whole number of tokens >= 1 (or leave the flag out: one forward), "
          "got 0\n"),
])
def test_a_flag_value_that_cannot_be_read_is_named_in_a_short_line(capsys, value, message):
    assert cli.main(["eval", "--target", "t", "--bench", "humaneval", "--prefill-chunk", value]) == 2
    assert capsys.readouterr().err.endswith(message)


def test_a_home_path_the_shell_left_unexpanded_is_the_home_path(tmp_path, monkeypatch, capsys):
    """`--out=~/x` reaches the program as the literal text: generate, target prompts and the demo checked ~/x and
    wrote a literal ./~/x (the demo trained in one and read its data from the other)."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir(), cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    assert cli.main(["target", "prompts", "--out=~/p.jsonl", "-n", "2"]) == 0
    assert len((home / "p.jsonl").read_text().splitlines()) == 2 and not (cwd / "~").exists()
    assert f"to {home / 'p.jsonl'}" in capsys.readouterr().out
    args = cli.build_parser("eval").parse_args(["eval", "--target", "~", "--bench", "~/b.jsonl", "--out=~/r"])
    cli._expand_home(args)
    assert (args.target, args.bench, args.out_dir) == (str(home), str(home / "b.jsonl"), str(home / "r"))
    args = cli.build_parser("eval").parse_args(["eval", "--target", "t", "--bench", "b", "--drafter", "~user/x"])
    cli._expand_home(args)
    assert args.drafter == "~user/x"  # another user's home: as given


def test_a_value_that_starts_with_a_negative_number_is_the_flags_value():
    # `--layers -1,2` was argparse's "expected one argument" (only one plain negative number passes as a value)
    from draftforge.cli import _join_negative_values as join

    assert join(["harvest", "hidden", "--layers", "-1,2", "--top-k", "4"]) == ["harvest", "hidden", "--layers=-1,2",
                                                                            "--top-k", "4"]
    assert join(["eval", "--temperature", "-0.5", "--temperature=-1"]) == ["eval", "--temperature=-0.5",
                                                                          "--temperature=-1"]
    assert join(["--set", "-x"]) == ["--set", "-x"]  # not a number: argparse's own reading stands
    assert join(["prog", "--", "--layers", "-1"]) == ["prog", "--", "--layers", "-1"]  # after --, untouched
