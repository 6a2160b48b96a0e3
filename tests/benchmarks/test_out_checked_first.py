"""Every benchmark that writes a JSON result refuses an --out (or --json) it would not write before it measures:
these checked it only in write_json at the end, after minutes of measuring (the result then went to stdout)."""

import importlib
import sys

import pytest

T = ["--target", "t"]
D = ["--target", "t", "--drafter", "d"]
# module, the flags it needs to parse, the flag naming its result, the file name inside a directory flag
CASES = [
    ("benchmarks.decoding.context_curves", ["report_dir"], "--out", "context_curves.json"),
    ("benchmarks.decoding.drafter_agreement", D, "--out", None),
    ("benchmarks.decoding.drafter_tv", D, "--out", None),
    ("benchmarks.decoding.eval_memory", [], "--out", None),
    ("benchmarks.decoding.hf_assisted_ssm", [], "--out", None),
    ("benchmarks.decoding.tree_acceptance", D + ["--bench", "b", "--tree", "3"], "--out", None),
    ("benchmarks.micro.draw", [], "--out", None),
    ("benchmarks.micro.eagle3_step", T, "--out", None),
    ("benchmarks.micro.mamba2_step", [], "--json", None),
    ("benchmarks.micro.prefill_chunk", T, "--out", None),
    ("benchmarks.micro.target_context", T, "--out", None),
    ("benchmarks.micro.train_scaling", [], "--out", None),
    ("benchmarks.micro.train_throughput", [], "--out", None),
    ("benchmarks.micro.verify_context", T, "--out", None),
    ("benchmarks.serving.vllm_compare", T, "--out", None),
]


@pytest.mark.parametrize("content", ["my notes, not a result\n", '{"my": "settings"}\n'], ids=["text", "json"])
@pytest.mark.parametrize("module, needs, flag, inside", CASES, ids=[c[0].rsplit(".", 1)[1] for c in CASES])
def test_a_users_file_as_the_result_is_refused_before_measuring(module, needs, flag, inside, content, tmp_path,
                                                                monkeypatch, capsys):
    # a user's JSON object (a config, someone's results) was taken for an earlier result and replaced
    mod = importlib.import_module(module)
    notes = tmp_path / "notes"
    mine = (notes / inside) if inside else tmp_path / "notes.json"
    mine.parent.mkdir(parents=True, exist_ok=True)
    mine.write_text(content)
    out = str(notes if inside else mine)
    monkeypatch.setattr(sys, "argv", [module, *needs, flag, out])  # the mains without argv read sys.argv
    takes_argv = "argv" in mod.main.__code__.co_varnames[: mod.main.__code__.co_argcount]
    with pytest.raises(SystemExit) as e:
        mod.main([*needs, flag, out]) if takes_argv else mod.main()
    assert e.value.code == 2
    assert f"{flag} {mine} exists and is not a JSON result" in capsys.readouterr().err
    assert mine.read_text() == content
