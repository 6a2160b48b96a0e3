"""`draftforge generate`: the target's own answers as token rows (greedy = its generate()), resumable, clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from draftforge.data.generate import (chat_jobs, cut_at_eos, generate_rows, random_start_jobs, read_done)
from draftforge.errors import DataError

QUESTIONS = ["What is a list?", "Write add(a, b).", "Say hello to the world politely please.", "Why?",
             "import os and print the path", "Explain sys.argv in one sentence.", "Hi"]


@pytest.fixture(scope="module")
def target():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=96,
                      eos_token_id=0, pad_token_id=1)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_id": f"p{i}", "messages": [{"role": "user", "content": q}]}) + "\n"
                            for i, q in enumerate(QUESTIONS)))
    return path


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_greedy_rows_equal_the_targets_own_generate(target, chat_tok, prompt_file, tmp_path):
    jobs = chat_jobs(prompt_file, chat_tok, context=96, max_new_tokens=12)
    out = tmp_path / "rows.jsonl"
    stats = generate_rows(target, chat_tok, jobs, out, temperatures=[0], max_new_tokens=12, batch_size=3)
    rows = {r["prompt_id"]: r for r in _rows(out)}
    assert stats.rows == len(QUESTIONS) == len(rows)
    for job in jobs:
        want = target.generate(torch.tensor([job.input_ids]), do_sample=False, max_new_tokens=12,
                               eos_token_id=0, pad_token_id=1)[0].tolist()
        want_new, _ = cut_at_eos(want[len(job.input_ids):], [0])
        row = rows[job.prompt_id]
        assert row["input_ids"] == job.input_ids + want_new
        assert row["prompt_len"] == len(job.input_ids) and row["temperature"] == 0.0
        assert chat_tok.decode(job.input_ids).endswith("<assistant>")  # through the chat template


def test_greedy_rows_are_the_argmax_whatever_the_targets_generation_config_adds(target, chat_tok, prompt_file,
                                                                               tmp_path):
    """A target that ships repetition_penalty (Qwen2.5-Instruct does) or no_repeat_ngram_size: generate() applied
    them to the rows, which are meant as the target's own greedy answers. Oracle: an argmax loop over the logits."""
    import copy

    model = copy.deepcopy(target)
    model.generation_config.repetition_penalty, model.generation_config.no_repeat_ngram_size = 3.0, 2
    jobs = chat_jobs(prompt_file, chat_tok, context=96, max_new_tokens=12)
    out = tmp_path / "rows.jsonl"
    generate_rows(model, chat_tok, jobs, out, temperatures=[0], max_new_tokens=12, batch_size=3)
    rows = {r["prompt_id"]: r for r in _rows(out)}
    for job in jobs:
        seq = list(job.input_ids)
        with torch.no_grad():
            for _ in range(12):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
                if seq[-1] == 0:  # the fixture's eos
                    break
        assert rows[job.prompt_id]["input_ids"] == seq, job.prompt_id
    assert model.generation_config.repetition_penalty == 3.0  # the model's own config is given back


def test_eos_is_respected(target, chat_tok, prompt_file, tmp_path):
    jobs = chat_jobs(prompt_file, chat_tok, context=96, max_new_tokens=8)[:1]
    first = target.generate(torch.tensor([jobs[0].input_ids]), do_sample=False, max_new_tokens=3,
                            eos_token_id=0, pad_token_id=1)[0, len(jobs[0].input_ids) + 1].item()
    target.generation_config.eos_token_id = first  # the second greedy token is now an EOS
    try:
        generate_rows(target, chat_tok, jobs, tmp_path / "r.jsonl", temperatures=[0], max_new_tokens=8)
    finally:
        target.generation_config.eos_token_id = 0
    (row,) = _rows(tmp_path / "r.jsonl")
    new = row["input_ids"][row["prompt_len"]:]
    assert new[-1] == first and first not in new[:-1] and len(new) <= 2
    assert cut_at_eos([5, 7, 0, 9, 1], [0]) == ([5, 7, 0], True) and cut_at_eos([5, 7], [0]) == ([5, 7], False)


class Killed(Exception):
    pass


def test_resume_after_a_kill_gives_the_same_file(target, chat_tok, prompt_file, tmp_path):
    jobs = chat_jobs(prompt_file, chat_tok, context=96, max_new_tokens=10)
    kw = dict(temperatures=[0, 1.0], max_new_tokens=10, batch_size=3, seed=7)
    whole = tmp_path / "whole.jsonl"
    generate_rows(target, chat_tok, jobs, whole, **kw)
    assert len(_rows(whole)) == 2 * len(QUESTIONS)

    part = tmp_path / "part.jsonl"
    calls = []

    def kill_after_two(n, tok_s, there):
        calls.append(n)
        if len(calls) == 2:
            raise Killed

    with pytest.raises(Killed):
        generate_rows(target, chat_tok, jobs, part, progress=kill_after_two, **kw)
    lines = part.read_text().splitlines(keepends=True)
    part.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])  # the kill tore the last line
    reports = []  # (rows the batch wrote, rows in the file after it), read back from the file at each call
    stats = generate_rows(target, chat_tok, jobs, part, **kw,
                          progress=lambda n, tok_s, there: reports.append((n, there, len(_rows(part)))))
    assert stats.skipped == len(lines) - 1 and stats.rows == 2 * len(QUESTIONS) - (len(lines) - 1)
    # the resumed run reports only what it writes: the kept rows are the first report's start, not a batch
    assert all(there == in_file for _, there, in_file in reports)
    assert reports[0][1] - reports[0][0] == len(lines) - 1 and sum(n for n, _, _ in reports) == stats.rows
    assert part.read_text() == whole.read_text()
    again = generate_rows(target, chat_tok, jobs, part, **kw)  # nothing left to do
    assert again.rows == 0 and part.read_text() == whole.read_text()


def test_a_resume_over_a_grown_prompt_list_says_the_file_is_no_single_run(target, chat_tok, prompt_file, tmp_path,
                                                                         capsys):
    """Batches are planned over the whole job list and seeded by their index, so rows resumed over a longer list are
    sampled in other batches than an uninterrupted run of it would sample them: said once, the rows kept."""
    jobs = chat_jobs(prompt_file, chat_tok, context=96, max_new_tokens=6)
    kw = dict(temperatures=[1.0], max_new_tokens=6, batch_size=3, seed=7)
    out = tmp_path / "grown.jsonl"
    generate_rows(target, chat_tok, jobs[:4], out, **kw)
    first = out.read_text()
    capsys.readouterr()
    generate_rows(target, chat_tok, jobs[:4], out, **kw)  # the same list: nothing to say, nothing to do
    assert "notice" not in capsys.readouterr().err
    generate_rows(target, chat_tok, jobs, out, **kw)
    err = capsys.readouterr().err
    assert "started on another prompt list" in err and "equals no single uninterrupted run" in err
    assert out.read_text().startswith(first) and len(_rows(out)) == len(jobs)


def test_a_resume_on_another_device_says_so_and_records_it(target, chat_tok, prompt_file, tmp_path, monkeypatch,
                                                           capsys):
    from draftforge.data.provenance import sidecar_path

    jobs = chat_jobs(prompt_file, chat_tok, context=96, max_new_tokens=6)
    kw = dict(temperatures=[0], max_new_tokens=6, batch_size=2)
    out = tmp_path / "moved.jsonl"
    generate_rows(target, chat_tok, jobs[:2], out, **kw)
    devices = json.loads(sidecar_path(out).read_text())["devices"]
    assert len(devices) == 1 and devices[0].startswith("cpu: ")
    monkeypatch.setattr("draftforge.runtime.device_name", lambda device: "cuda: Imaginary GPU")
    capsys.readouterr()
    generate_rows(target, chat_tok, jobs[:2], out, **kw)  # nothing left to write: nothing to say
    assert "continued on" not in capsys.readouterr().err
    generate_rows(target, chat_tok, jobs, out, **kw)
    assert f"continued on cuda: Imaginary GPU; the part already written was computed on {devices[0]}" in \
        capsys.readouterr().err
    assert json.loads(sidecar_path(out).read_text())["devices"] == [*devices, "cuda: Imaginary GPU"]


def test_sampled_rows_differ_from_greedy_and_mix_in_one_file(target, chat_tok, prompt_file, tmp_path):
    jobs = chat_jobs(prompt_file, chat_tok, context=96, max_new_tokens=10)
    generate_rows(target, chat_tok, jobs, tmp_path / "m.jsonl", temperatures=[0, 1.0], max_new_tokens=10)
    rows = _rows(tmp_path / "m.jsonl")
    greedy = {r["prompt_id"]: r["input_ids"] for r in rows if r["temperature"] == 0}
    sampled = {r["prompt_id"]: r["input_ids"] for r in rows if r["temperature"] == 1}
    assert greedy.keys() == sampled.keys() and greedy != sampled


def test_random_starts_for_base_targets(target, tmp_path):
    jobs = random_start_jobs(5, 400, seed=3, skip_ids=[0, 1])
    assert all(len(j.input_ids) == 1 and j.input_ids[0] not in (0, 1) and 3 <= j.greedy_prefix <= 5 for j in jobs)
    generate_rows(target, None, jobs, tmp_path / "b.jsonl", temperatures=[1.0], max_new_tokens=8, batch_size=5)
    rows = _rows(tmp_path / "b.jsonl")
    assert len(rows) == 5 and all(r["prompt_len"] == 1 for r in rows)
    # the first max(greedy_prefix) tokens are greedy: equal to the target's greedy continuation
    k = max(j.greedy_prefix for j in jobs)
    for job, row in zip(sorted(jobs, key=lambda j: j.prompt_id), sorted(rows, key=lambda r: r["prompt_id"])):
        greedy = target.generate(torch.tensor([job.input_ids]), do_sample=False, max_new_tokens=k,
                                 eos_token_id=0, pad_token_id=1)[0].tolist()
        got = row["input_ids"]
        n = min(len(got), len(greedy))
        assert got[:n] == greedy[:n]


def test_random_starts_from_the_command_with_and_without_a_tokenizer(target, chat_tok, tmp_path, capsys):
    """A target saved without tokenizer files crashed in AutoTokenizer (random starts need none); with one, starts
    come from its ids, not from embedding rows past them (a table padded beyond the tokenizer)."""
    from draftforge.cli import main

    path = tmp_path / "target"
    target.save_pretrained(path)
    argv = ["generate", "--target", str(path), "--random-starts", "40", "--max-new-tokens", "4", "--temperature", "0",
            "--dtype", "float32"]
    assert main(argv + ["--out", str(tmp_path / "bare.jsonl")]) == 0
    assert len(_rows(tmp_path / "bare.jsonl")) == 40
    chat_tok.save_pretrained(path)
    assert len(chat_tok) < target.config.vocab_size
    assert main(argv + ["--out", str(tmp_path / "tok.jsonl")]) == 0
    assert all(r["input_ids"][0] < len(chat_tok) for r in _rows(tmp_path / "tok.jsonl"))
    capsys.readouterr()


def test_a_bad_prompt_file_is_refused_before_the_weights_load_and_a_short_file_is_said(target, chat_tok, tmp_path,
                                                                                         monkeypatch, capsys):
    """The prompt file was read after the model loaded (a minute for a real target) and `-n` beyond the file's
    length answered fewer prompts without a word."""
    import draftforge.loading
    from draftforge.cli import main

    path = tmp_path / "target"
    target.save_pretrained(path)
    chat_tok.save_pretrained(path)
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"prompt_id": "a", "prompt": "x"}\n{"prompt_id": "a", "prompt": "y"}\n')
    argv = ["generate", "--target", str(path), "--max-new-tokens", "3", "--temperature", "0", "--dtype", "float32"]
    real_load, loads = draftforge.loading.load_causal_lm, []
    monkeypatch.setattr(draftforge.loading, "load_causal_lm", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    assert main(argv + ["--prompts", str(dup), "--out", str(tmp_path / "dup-rows.jsonl")]) != 0
    assert "appears twice" in capsys.readouterr().err and loads == []
    two = tmp_path / "two.jsonl"
    two.write_text('{"prompt_id": "a", "prompt": "x"}\n{"prompt_id": "b", "prompt": "y"}\n')
    capsys.readouterr()
    assert main(argv + ["--prompts", str(two), "-n", "5", "--out", str(tmp_path / "rows.jsonl")]) == 0
    assert len(loads) == 1 and len(_rows(tmp_path / "rows.jsonl")) == 2
    assert "-n 5 asked for more prompts" in capsys.readouterr().out


def test_token_rows_load_for_sft(target, chat_tok, prompt_file, tmp_path):
    from draftforge.data.sources import normalize_tokens

    jobs = chat_jobs(prompt_file, chat_tok, context=96, max_new_tokens=6)
    generate_rows(target, chat_tok, jobs, tmp_path / "s.jsonl", temperatures=[0], max_new_tokens=6)
    for row in _rows(tmp_path / "s.jsonl"):
        norm = normalize_tokens(row, "row")
        assert norm["bad"] == "" and norm["labels"][: row["prompt_len"]] == [-100] * row["prompt_len"]


def test_bad_input_gets_one_clear_error(target, chat_tok, prompt_file, tmp_path):
    with pytest.raises(DataError, match="exceeds the target's context"):
        chat_jobs(prompt_file, chat_tok, context=96, max_new_tokens=90)
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"prompt_id": "a", "prompt": "x"}\n{"prompt_id": "a", "prompt": "y"}\n')
    with pytest.raises(DataError, match="appears twice"):
        chat_jobs(dup, chat_tok, context=96, max_new_tokens=4)
    jobs = chat_jobs(prompt_file, chat_tok, context=96, max_new_tokens=4)
    for kw, msg in (({"temperatures": [-1]}, "temperature"), ({"temperatures": [1, 1.0]}, "names 1.0 twice"),
                    ({"max_new_tokens": 0}, "max-new-tokens"),
                    ({"batch_size": 0}, "batch-size")):
        with pytest.raises(DataError, match=msg):
            generate_rows(target, chat_tok, jobs, tmp_path / "x.jsonl", **kw)
    alien = tmp_path / "alien.jsonl"
    alien.write_text('{"input_ids": [1, 2]}\n')
    with pytest.raises(DataError, match="not a `draftforge generate` file"):
        read_done(alien)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt_id": "a", "temperature": 0}\n{oops\n{"prompt_id": "b", "temperature": 0}\n')
    with pytest.raises(DataError, match="not the last one"):
        read_done(broken)
    with pytest.raises(DataError, match="does not exist"):
        chat_jobs(tmp_path / "missing.jsonl", chat_tok, context=96, max_new_tokens=4)


def test_cli_help_lists_generate():
    from draftforge.cli import build_parser

    parser = build_parser("generate")
    help_text = parser._subparsers._group_actions[0].choices["generate"].format_help()
    assert "--temperature" in help_text and "--max-new-tokens" in help_text and "resume" in help_text


def test_a_users_file_at_out_is_never_cut_and_settings_must_match_on_resume(target, chat_tok, prompt_file,
                                                                            tmp_path):
    """A one-line note at --out (its only line is 'torn') was cut to nothing and filled with rows; --out equal
    to --prompts destroyed the prompt file; a resume with another length cap, seed, batch size or dtype mixed its
    rows into the file. Each is now refused before anything changes."""
    from draftforge.data.generate import row_settings, rows_problem

    jobs = chat_jobs(prompt_file, chat_tok, context=96, max_new_tokens=10)
    note = tmp_path / "note.jsonl"
    note.write_text("my important note")  # no newline: the file's one line reads as a torn row
    with pytest.raises(DataError, match="not cut: it may be yours"):
        generate_rows(target, chat_tok, jobs, note, temperatures=[0], max_new_tokens=4)
    assert note.read_text() == "my important note"
    settings = row_settings(4, 0, 8, "float32")
    assert "is the --prompts file" in rows_problem(prompt_file, settings, prompt_file)
    out = tmp_path / "rows.jsonl"
    kw = dict(temperatures=[0], max_new_tokens=4, batch_size=2, seed=3)
    generate_rows(target, chat_tok, jobs[:2], out, **kw)
    before = out.read_bytes()
    for change, said in (({"max_new_tokens": 6}, "max_new_tokens 4 -> 6"), ({"seed": 4}, "seed 3 -> 4"),
                         ({"batch_size": 3}, "batch_size 2 -> 3"),
                         ({"dtype": "bfloat16"}, "dtype float32 -> bfloat16")):
        with pytest.raises(DataError, match=f"other settings \\({said}\\)"):
            generate_rows(target, chat_tok, jobs, out, **{**kw, **change})
        assert out.read_bytes() == before
    # a prompt whose tokens changed under the same id: refused, not skipped as answered
    moved = [type(j)(j.prompt_id, list(j.input_ids) + [5], j.greedy_prefix) for j in jobs]
    with pytest.raises(DataError, match="answered to other prompt tokens"):
        generate_rows(target, chat_tok, moved, out, **kw)
    assert out.read_bytes() == before
    assert generate_rows(target, chat_tok, jobs, out, **kw).skipped == 2  # the same settings resume


def test_one_writer_per_file(target, chat_tok, prompt_file, tmp_path):
    """Two generate runs on one --out (a relaunch while the first still runs) each wrote every row: the file held
    them twice. A live writer's lock refuses the second; a killed writer's lock is taken over; none is left."""
    import json as _json
    import os
    import socket
    import subprocess

    from draftforge.errors import DraftforgeError

    jobs = chat_jobs(prompt_file, chat_tok, context=96, max_new_tokens=4)
    out = tmp_path / "rows.jsonl"
    lock = tmp_path / ".rows.jsonl.lock"  # a first writer still running: this process, by its lock's record
    lock.write_text(_json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "what": "draftforge generate"}))
    with pytest.raises(DraftforgeError, match=rf"being written by another draftforge generate \(pid {os.getpid()}"):
        generate_rows(target, chat_tok, jobs, out, temperatures=[0], max_new_tokens=4)
    assert not out.exists() and lock.exists()  # the first writer's lock is its own to remove
    gone = subprocess.Popen(["true"])
    gone.wait()
    lock.write_text(_json.dumps({"pid": gone.pid, "host": socket.gethostname()}))
    stats = generate_rows(target, chat_tok, jobs, out, temperatures=[0], max_new_tokens=4)
    assert stats.rows == len(jobs) and not lock.exists()


def test_a_users_file_where_the_rows_record_goes_is_refused_and_kept(target, chat_tok, prompt_file, tmp_path):
    """--out new, but ROWS.meta.json already there and not generate's: the record written before the first row
    replaced it (a user's own metadata). A link there, or an unreadable one, is not generate's either."""
    jobs = chat_jobs(prompt_file, chat_tok, context=96, max_new_tokens=10)
    out = tmp_path / "rows.jsonl"
    meta = tmp_path / "rows.jsonl.meta.json"
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text('{"mine": 1}')
    for make in (lambda: meta.write_text('{"my": "own metadata"}'), lambda: meta.write_text("{torn"),
                 lambda: meta.symlink_to(elsewhere)):
        make()
        with pytest.raises(DataError, match="rows.jsonl.meta.json is not a record `draftforge generate` wrote"):
            generate_rows(target, chat_tok, jobs[:1], out, temperatures=[0], max_new_tokens=4)
        assert not out.exists() and elsewhere.read_text() == '{"mine": 1}'
        meta.unlink()
    generate_rows(target, chat_tok, jobs[:1], out, temperatures=[0], max_new_tokens=4)  # generate's own: resumed
    (tmp_path / "rows.jsonl").unlink()
    generate_rows(target, chat_tok, jobs[:1], out, temperatures=[0], max_new_tokens=4)


@pytest.mark.parametrize("target, message", [
    ("{tmp}/nope", "error: cannot load the target: directory {tmp}/nope does not exist"),
    ("{tmp}/file.txt", "error: target '{tmp}/file.txt' is a file; give the model's directory"),
    ("not-here/at-all", "error: --target not-here/at-all: cannot read its tokenizer (no such local directory; tried "
                        "it as a Hugging Face Hub id: "),
])
def test_a_target_that_is_not_a_model_is_one_line(tmp_path, capsys, monkeypatch, target, message):
    # each ended in a transformers traceback (HFValidationError, OSError)
    from draftforge.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file.txt").write_text("x")
    argv = ["generate", "--target", target.format(tmp=tmp_path), "--random-starts", "2", "--out", "rows.jsonl"]
    assert main(argv) == 2
    assert message.format(tmp=tmp_path) in capsys.readouterr().err and not (tmp_path / "rows.jsonl").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has the device the test asks for")
def test_a_device_this_torch_lacks_is_one_line(tmp_path, capsys):
    # torch's AssertionError ("Torch not compiled with ...") ended the run after the model loaded
    from draftforge.cli import main

    assert main(["generate", "--target", str(tmp_path), "--random-starts", "2", "--out", str(tmp_path / "r.jsonl"),
                 "--device", "cuda"]) == 2
    assert "error: --device cuda: no CUDA device here" in capsys.readouterr().err
