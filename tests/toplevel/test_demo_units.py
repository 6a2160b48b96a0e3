"""The demo's own plumbing, without training anything: thread choice, phase times, the speedup spread."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from draftforge import demo, runtime


def _report(repeats=3):
    def row(method, median, lo, hi, speedup):
        return {"method": method, "temperature": 0.0, "speedup": speedup, "tau": 1.0,
                "tokens_per_s_spread": {"median": median, "min": lo, "max": hi}}

    return {"manifest": {"repeats": repeats},
            "results": [row("ar", 100.0, 80.0, 125.0, 1.0), row("tree", 200.0, 150.0, 250.0, 2.0)]}


def test_speedup_spread_pairs_the_extreme_passes():
    line = demo.speedup_spread(_report())
    # slowest tree pass / fastest AR pass = 150/125 = 1.20; fastest / slowest = 250/80 = 3.125
    assert line.startswith("speedup, median of 3 timed passes")
    assert "tree 2.00× (1.20–3.12×)" in line and "ar " not in line


def test_speedup_spread_prefers_the_reports_per_pass_speedups():
    report = _report()
    report["results"][1]["speedup_spread"] = {"min": 1.7, "median": 2.0, "max": 2.2}
    assert "tree 2.00× (1.70–2.20×)" in demo.speedup_spread(report)


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_default_to_one_unless_asked_or_set_by_omp(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(3)  # not the count the default must set, whatever this process started with
    assert runtime.choose_threads(None).startswith("torch threads: 1 (") and torch.get_num_threads() == 1
    assert runtime.choose_threads(2).startswith("torch threads: 2 (as asked") and torch.get_num_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # set by the user: left as the OpenMP runtime set it
    torch.set_num_threads(3)
    assert runtime.choose_threads(None) == "torch threads: 3 (from OMP_NUM_THREADS)" and torch.get_num_threads() == 3


def test_run_demo_prints_phase_times_spread_and_threads(tmp_path, monkeypatch, restore_threads):
    calls = []
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("draftforge.testbed.ensure_testbed", lambda tb, max_files: SimpleNamespace(prompts="p"))
    monkeypatch.setattr(demo, "ensure_target", lambda tb, quick, say: None)
    monkeypatch.setattr(demo, "_train", lambda values, *a: calls.append(values) or {"export": values["output_dir"],
                                                                                    "final_loss": 1.0})
    monkeypatch.setattr(demo, "write_distill_data", lambda *a: None)
    monkeypatch.setattr(demo, "_eval", lambda *a: _report())
    monkeypatch.setattr("draftforge.eval.report.markdown_table", lambda report: "TABLE")
    torch.set_num_threads(2)
    lines = []
    summary = demo.run_demo(tmp_path / "tb", tmp_path / "out", threads=None, say=lines.append)
    assert torch.get_num_threads() == 2  # restored for the caller
    assert [c["output_dir"] for c in calls] == [str(tmp_path / "out" / "drafter-pretrain"),
                                                str(tmp_path / "out" / "drafter-sft")]
    assert list(summary["phase_seconds"]) == ["testbed", "target", "drafter pre-training", "distillation data",
                                              "drafter SFT", "eval"]
    text = "\n".join(lines)
    assert "phase times: testbed 0.0 min" in text and "tree 2.00×" in text and "torch threads: 1 (" in text


def test_resume_continues_the_demos_runs_and_says_how_to_start_again(tmp_path, monkeypatch):
    # an interrupted demo started over: minutes of training lost; --resume continues each drafter run
    import draftforge.train
    from draftforge.errors import CheckpointError

    calls = []

    def fake_run(recipe, **kwargs):
        calls.append(kwargs)
        return SimpleNamespace(final_loss=1.0, eval_loss=None, tokens_per_s=1.0, export_dir="x")

    monkeypatch.setattr(draftforge.train, "run", fake_run)
    values = demo.tiny_recipe("pretrain", tmp_path / "tb", tmp_path / "out")
    demo._train(values, "pre-training", lambda *_: None, quick=False, resume=True)  # nothing there yet: a new run
    run_dir = tmp_path / "out" / "drafter-pretrain"
    run_dir.mkdir(parents=True)
    (run_dir / "recipe.yaml").write_text("{}")
    demo._train(values, "pre-training", lambda *_: None, quick=False, resume=True)
    demo._train(values, "pre-training", lambda *_: None, quick=False)  # without --resume: replaced, as before
    assert calls == [{"overwrite": True}, {"resume": True}, {"overwrite": True}]

    def refused(recipe, **kwargs):
        raise CheckpointError("--resume: the recipe differs from the run in X in train.block_size")

    monkeypatch.setattr(draftforge.train, "run", refused)
    with pytest.raises(CheckpointError, match=r"the demo in .*out cannot be resumed \(--resume: the recipe differs.*"
                                              r"\(--quick, --testbed\), give those, or run the demo without --resume "
                                              r"to start it again"):
        demo._train(values, "pre-training", lambda *_: None, quick=False, resume=True)


def test_resume_keeps_distillation_rows_only_of_the_same_target_and_settings(tmp_path, tiny_tokenizer_dir):
    import json
    import shutil

    from tests.fixtures.decode import tiny_llama
    from transformers import AutoTokenizer

    tb, out = tmp_path / "tb", tmp_path / "out"
    shutil.copytree(tiny_tokenizer_dir, tb / "tokenizer")
    tok = AutoTokenizer.from_pretrained(tb / "tokenizer")
    tiny_llama(vocab=len(tok), seed=0).save_pretrained(tb / "target")
    source = ('''def add(a, b):\n    """Add two numbers and return the sum of them, as the caller asked; both '''
              '''are kept as they are."""\n    return a + b\n''' * 4)
    (tb / "corpus_train.jsonl").write_text(json.dumps({"text": source}) + "\n")
    out.mkdir()
    said = []
    path = demo.write_distill_data(tb, out, 2, 4, said.append)
    first, stamp = path.read_bytes(), path.stat().st_mtime_ns
    demo.write_distill_data(tb, out, 2, 4, said.append, resume=True)
    assert path.stat().st_mtime_ns == stamp and "--resume keeps" in said[-1]  # kept, not written again
    path.write_bytes(first + b"\n")  # not the rows its record names (a run killed between the two writes)
    demo.write_distill_data(tb, out, 2, 4, said.append, resume=True)
    assert "--resume keeps" not in said[-1] and path.read_bytes() == first
    for settings in ((2, 5), (1, 4)):  # other settings: written again
        stamp = path.stat().st_mtime_ns
        demo.write_distill_data(tb, out, *settings, said.append, resume=True)
        assert "--resume keeps" not in said[-1] and path.stat().st_mtime_ns != stamp
    demo.write_distill_data(tb, out, 2, 4, said.append)
    assert path.read_bytes() == first
    tiny_llama(vocab=len(tok), seed=1).save_pretrained(tb / "target")  # another target: its rows are not the old ones
    demo.write_distill_data(tb, out, 2, 4, said.append, resume=True)
    assert "--resume keeps" not in said[-1]


def test_quick_keeps_the_eval_size_the_user_asked_for(monkeypatch, tmp_path):
    """--quick replaced --num-prompts / --max-new-tokens with its own 3 and 16 silently; now only their defaults."""
    seen = []
    monkeypatch.setattr("draftforge.eval.runner.run_eval", lambda config: seen.append(config))
    paths = SimpleNamespace(prompts="p.jsonl")
    for quick, asked, expect in ((True, (None, None), (3, 16)), (True, (5, 9), (5, 9)), (False, (None, None), (20, 64)),
                                 (False, (7, None), (7, 64))):
        demo._eval(tmp_path, paths, "drafter", tmp_path / "out", quick, *asked)
        assert (seen[-1].num_prompts, seen[-1].max_new_tokens) == expect


def test_what_is_in_out_but_not_the_demos_is_refused_before_any_work_and_its_link_kept(tmp_path):
    """A user's sft_distill.jsonl.meta.json (with no rows yet) was replaced by the demo's record; a link at
    OUT/drafter-pretrain to a run elsewhere was replaced through (leaving a stray link beside that run); a user's
    link at OUT/testbed was deleted for the demo's own."""
    from draftforge.demo import check_out_files, link_testbed
    from draftforge.errors import DraftforgeError

    out = tmp_path / "out"
    out.mkdir()
    (out / "sft_distill.jsonl.meta.json").write_text('{"my": "own metadata"}')
    with pytest.raises(DraftforgeError, match=r"sft_distill.jsonl.meta.json not written by a draftforge demo"):
        check_out_files(out)
    (out / "sft_distill.jsonl.meta.json").unlink()
    elsewhere = tmp_path / "my-run"
    elsewhere.mkdir()
    (out / "drafter-pretrain").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(DraftforgeError, match=r"drafter-pretrain \(a link\) not written by a draftforge demo"):
        check_out_files(out)
    (out / "drafter-pretrain").unlink()
    check_out_files(out)
    userdata = tmp_path / "userdata"
    userdata.mkdir()
    (out / "testbed").symlink_to(userdata, target_is_directory=True)
    said = []
    link_testbed(out, tmp_path / "tb", said.append)
    assert (out / "testbed").resolve() == userdata.resolve() and "is not the demo's link" in said[0]
    (out / "testbed").unlink()
    testbed = tmp_path / "tb"
    testbed.mkdir()
    (testbed / ".draftforge-testbed").write_text("")
    link_testbed(out, testbed, said.append)  # the demo's own link: made, then replaced for another testbed
    other = tmp_path / "tb2"
    other.mkdir()
    link_testbed(out, other, said.append)
    assert (out / "testbed").resolve() == other.resolve() and len(said) == 1


def test_a_users_notes_in_a_run_the_demo_replaces_and_a_target_without_its_record_are_refused_up_front(tmp_path,
                                                                                                       monkeypatch):
    """Notes in OUT/drafter-sft/ were refused only at the SFT step, after pre-training was replaced; a cached
    testbed target without draftforge.json was trained again and then died renaming onto it (Directory not
    empty), every rerun alike. A resumed demo keeps its runs, so their notes are no obstacle then."""
    from draftforge.demo import check_out_files, ensure_target
    from draftforge.errors import DraftforgeError
    from draftforge.train.rundir import RUN_MARKER

    out = tmp_path / "out"
    run = out / "drafter-sft"
    run.mkdir(parents=True)
    (run / RUN_MARKER).write_text("")
    (run / "recipe.yaml").write_text("task: sft\n")
    (run / "my-notes.md").write_text("mine")
    with pytest.raises(DraftforgeError, match=r"drafter-sft/my-notes.md not written by a draftforge demo"):
        check_out_files(out)
    check_out_files(out, resume=True)
    target = tmp_path / "testbed" / "target"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    trained = []
    monkeypatch.setattr(demo, "_train", lambda *a, **k: trained.append(1))
    with pytest.raises(DraftforgeError, match=r"target is there but holds no draftforge.json.*move it away"):
        ensure_target(tmp_path / "testbed", quick=True, say=lambda m: None)
    assert trained == [] and (target / "config.json").read_text() == "{}"
