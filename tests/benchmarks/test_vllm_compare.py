"""benchmarks/serving: the vLLM comparison skips with its reason where no vLLM environment exists (CI never needs
vLLM), vLLM's settings are read as documented, an EAGLE-3 export goes to vLLM's eagle3 method, and draftforge's
counters are re-cut to vLLM's rounds. The one test that runs vLLM is `slow` and needs a vLLM environment
($VLLM_PYTHON or setup_vllm.sh's venv); it is skipped, with that reason, elsewhere."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.serving import vllm_compare
from benchmarks.serving.vllm_serve import parse_setting


def test_no_vllm_environment_is_a_skip_with_its_reason(tmp_path, monkeypatch, capsys):
    out = tmp_path / "v.json"
    monkeypatch.setenv("VLLM_PYTHON", str(tmp_path / "none" / "python"))  # the environment's default: a skip
    result = vllm_compare.main(["--target", "t", "--out", str(out)])
    assert result["skipped"].startswith(f"no vLLM environment at {tmp_path / 'none' / 'python'}")
    assert json.loads(out.read_text()) == result
    # a --vllm-python the user typed that holds no vLLM is a mistake (exit 2), not a skip a pipeline reads as done
    with pytest.raises(SystemExit) as e:
        vllm_compare.main(["--target", "t", "--vllm-python", str(tmp_path / "none" / "python"), "--out", str(out)])
    assert e.value.code == 2 and "--vllm-python: no vLLM environment at" in capsys.readouterr().err
    venv = tmp_path / "venv"  # the venv's directory stands for its python
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\necho 0.32.0\n")
    (venv / "bin" / "python").chmod(0o755)
    assert vllm_compare.vllm_python(str(venv)) == (str(venv / "bin" / "python"), "0.32.0")


def test_vllms_error_lines_keep_the_worker_exception_and_the_reason_line():
    # vLLM's workers log the root cause to stdout (it was not kept), and a pydantic error gives its reason on the
    # line after "ValidationError" (it was filtered out)
    out = "\n".join(["INFO starting", "(Worker pid=1) ERROR ... ValueError: the drafter's tokenizer differs",
                     "pydantic_core.ValidationError: 1 validation error for SpeculativeConfig",
                     "  Value error, Target and draft model should have the same vocabulary size.", "INFO a",
                     "RuntimeError: Engine core initialization failed."])
    lines = vllm_compare.error_lines(out).splitlines()
    assert lines[:4] == [out.splitlines()[i] for i in (1, 2, 3, 5)] and lines[-1] == "INFO a"


def test_relative_paths_reach_vllm_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "t").mkdir(parents=True)
    assert vllm_compare.local_path("models/t") == str(tmp_path / "models" / "t")  # vLLM runs from the repo root
    assert vllm_compare.local_path("org/hub-model") == "org/hub-model"


def test_a_drafter_for_another_target_is_refused_before_vllm_runs(random_models, tiny_target):
    vllm_compare.check_pair(random_models["target"], random_models["mamba_drafter"])  # a pair: no error
    with pytest.raises(SystemExit, match=r"^error: --drafter .*mamba_drafter does not fit --target .*: "):
        vllm_compare.check_pair(str(tiny_target), random_models["mamba_drafter"])  # vocabulary 128 vs 512


def test_spread_draft_vocab_moves_ids_at_any_size():
    # leaving out every step-th id past half the vocabulary kept the first N ids: d2t all 0, "spread" in name only
    from benchmarks.serving.eagle3_init_export import spread_ids

    for vocab, n in ((49152, 8192), (512, 500), (7, 3)):
        ids = spread_ids(vocab, n)
        assert len(set(ids)) == n and ids == sorted(ids) and 0 <= ids[0] and ids[-1] < vocab
        assert sum(i != j for j, i in enumerate(ids)) > 0


def test_fp32_outputs_that_differ_from_plain_end_the_run_with_1(tmp_path, monkeypatch, tiny_tokenizer_dir):
    """The docstring's "every output must equal plain decoding's" was only a column in the table (exit 0)."""
    import subprocess

    bench = tmp_path / "p.jsonl"
    bench.write_text('{"input_ids": [1, 5, 9]}\n{"input_ids": [1, 7]}\n')
    monkeypatch.setattr(vllm_compare, "vllm_python", lambda given: ("python", "0.32.0"))

    def served(cmd, **kwargs):  # vllm_serve.py's JSON: plain, and ngram with one output off
        out = cmd[cmd.index("--out") + 1]
        result = {"tokens": [[4, 4], [6, 6]], "tokens_per_s": 1.0}
        json.dump({"results": {"plain": result, "ngram-3": {**result, "tokens": [[4, 4], [6, 0]]}}}, open(out, "w"))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(vllm_compare.subprocess, "run", served)
    monkeypatch.setattr(vllm_compare, "harness", lambda *a, **k: {"ar": {"tokens": [[4, 4], [6, 6]],
                                                                          "tokens_per_s": 1.0}})
    args = ["--target", str(tiny_tokenizer_dir), "--bench", str(bench), "--out", str(tmp_path / "r.json")]
    with pytest.raises(SystemExit, match=r"differ from vLLM's plain decoding: vLLM/ngram-3 \(1/2 identical\)"):
        vllm_compare.main(args)
    assert json.loads((tmp_path / "r.json").read_text())["engines"]["vLLM/ngram-3"]["identical_to_vllm_plain"] == 1
    assert vllm_compare.main(args + ["--dtype", "bfloat16"])["dtype"] == "bfloat16"  # bf16: near-ties may differ


def test_settings():
    assert parse_setting("plain") == ("plain", None)
    assert parse_setting("ngram:3")[1]["num_speculative_tokens"] == 3
    # the method named: vLLM reads a "model" without "/" whose parts are identifiers (drafter.v1) as a class path
    assert parse_setting("draft:drafter.v1:4") == ("draft-4", {"model": "drafter.v1", "method": "draft_model",
                                                                "num_speculative_tokens": 4})
    assert parse_setting("eagle3:/e:3") == ("eagle3-3", {"model": "/e", "method": "eagle3",
                                                         "num_speculative_tokens": 3})
    with pytest.raises(SystemExit, match="give plain, ngram:K, draft:DIR:K, mamba:DIR:K or eagle3:DIR:K"):
        parse_setting("eagle")


def test_a_mamba_drafter_goes_through_the_custom_class_proposer(monkeypatch):
    monkeypatch.delenv("DRAFTFORGE_MAMBA_DRAFTER", raising=False)
    name, spec = parse_setting("mamba:/exports/m2:3")
    assert name == "mamba-3" and spec["method"] == "custom_class" and spec["num_speculative_tokens"] == 3
    assert spec["model"] == "benchmarks.serving.mamba_proposer.MambaProposer"
    import os

    assert os.environ["DRAFTFORGE_MAMBA_DRAFTER"] == "/exports/m2"
    monkeypatch.delenv("DRAFTFORGE_MAMBA_DRAFTER")


def test_the_mamba_proposer_drafts_what_the_drafter_would_greedily(tmp_path, monkeypatch):
    """The proposer's chain for a row = the drafter's own greedy continuation of that row's committed tokens."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from benchmarks.serving.mamba_proposer import MambaProposer
    from tests.fixtures.decode import tiny_mamba2

    model = tiny_mamba2(vocab=64)
    model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path / "m")
    monkeypatch.setenv("DRAFTFORGE_MAMBA_DRAFTER", str(tmp_path / "m"))
    proposer = MambaProposer(SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=4)))
    rows = np.zeros((2, 16), dtype=np.int64)
    rows[0, :5], rows[1, :3] = [5, 17, 42, 9, 3], [7, 7, 1]
    drafts = proposer.propose([[3], [1]], np.array([5, 3]), rows)
    for seq, got in (([5, 17, 42, 9, 3], drafts[0]), ([7, 7, 1], drafts[1])):
        x = torch.tensor([seq])
        want = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=4, do_sample=False)
        assert got == want[0, len(seq):].tolist()
    assert proposer.propose([[], [2]], np.array([5, 3]), rows)[0] == []  # a row that sampled nothing drafts nothing


def test_the_mamba_proposer_serves_a_reduced_draft_vocabulary(tmp_path, monkeypatch):
    """A drafter whose head predicts 16 of 64 ids (config.draft_vocab, as `model.draft_vocab` recipes export):
    the proposer drafts target ids, each the draft vocabulary's id at the head's argmax; oracle: draftforge's own
    loader and a greedy loop that re-encodes the whole sequence every step (no cache)."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from benchmarks.serving.mamba_proposer import MambaProposer
    from draftforge.loading import load_causal_lm
    from tests.fixtures.decode import tiny_mamba2

    model = tiny_mamba2(vocab=64)
    draft_ids = list(range(0, 64, 4))  # 16 target ids
    torch.manual_seed(3)
    model.lm_head = torch.nn.Linear(model.config.hidden_size, len(draft_ids), bias=False)
    model.config.draft_vocab = draft_ids
    model.save_pretrained(tmp_path / "m")
    monkeypatch.setenv("DRAFTFORGE_MAMBA_DRAFTER", str(tmp_path / "m"))
    proposer = MambaProposer(SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3)))
    rows = np.zeros((1, 16), dtype=np.int64)
    rows[0, :4] = [5, 17, 42, 9]
    got = proposer.propose([[9]], np.array([4]), rows)[0]
    reference = load_causal_lm(str(tmp_path / "m")).float().eval()
    seq, want = [5, 17, 42, 9], []
    with torch.no_grad():
        for _ in range(3):
            best = int(reference(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
            want.append(draft_ids[best])
            seq.append(want[-1])
    assert got == want and all(t in draft_ids for t in got)


def test_the_mamba_proposer_refuses_a_drafter_made_for_another_target(tmp_path, monkeypatch):
    """Ids of another tokenizer mean other tokens: the drafts were verified losslessly and accepted next to never,
    with nothing said. The same tokenizer passes; another one, or draft ids past the target's vocabulary, fail."""
    from types import SimpleNamespace

    from benchmarks.serving.mamba_proposer import MambaProposer
    from tests.fixtures.decode import tiny_mamba2
    from tests.fixtures.tokenizers import testbed_bpe

    texts = ["def f(x):\n    return x + 1\n" * 40, "the cat sat on the mat; a dog ran by\n" * 40]
    for name, text in (("ours", texts[0]), ("theirs", texts[1])):
        testbed_bpe([text], tmp_path / name)
    model = tiny_mamba2(vocab=512)
    model.save_pretrained(tmp_path / "m")
    testbed_bpe([texts[0]], tmp_path / "m")
    monkeypatch.setenv("DRAFTFORGE_MAMBA_DRAFTER", str(tmp_path / "m"))

    def config(target, vocab=512):
        return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=2),
                               model_config=SimpleNamespace(model=str(target), tokenizer=str(target),
                                                            hf_config=SimpleNamespace(vocab_size=vocab)))

    MambaProposer(config(tmp_path / "ours"))
    with pytest.raises(ValueError, match="the drafter's tokenizer differs from the target's"):
        MambaProposer(config(tmp_path / "theirs"))
    reduced = tiny_mamba2(vocab=512)
    import torch

    reduced.lm_head = torch.nn.Linear(reduced.config.hidden_size, 4, bias=False)
    reduced.config.draft_vocab = [0, 5, 300, 511]
    reduced.save_pretrained(tmp_path / "r")
    monkeypatch.setenv("DRAFTFORGE_MAMBA_DRAFTER", str(tmp_path / "r"))
    with pytest.raises(ValueError, match="holds id 511, beyond the target's vocabulary of 300"):
        MambaProposer(config(tmp_path / "ours", vocab=300))


def test_per_position_and_vllm_rounds():
    # rounds of a draftforge run: (accepted, drafted)
    assert vllm_compare.per_position([2, 0, 3, 1], [3, 3, 3, 0], 3) == [2, 2, 1]  # the last round drafted nothing
    # an answer of 6 tokens, the first emitted by the prefill: rounds start at 1, 4 (1 + 2 + 1), 5; the third
    # starts before the end, so it drafts and its accepted drafts count although they run past the answer
    got = vllm_compare.vllm_rounds([2, 0, 2, 3], [3, 3, 3, 3], length=6, k=3)
    assert got == {"num_drafts": 3, "num_accepted_tokens": 4, "accepted_per_pos": [2, 2, 0]}


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory, tiny_tokenizer_dir):
    """A 4-layer Llama (head_dim 64, as vLLM's CPU attention takes) with the 512-token tokenizer, saved."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("eagle3_target")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    LlamaForCausalLM(config).eval().save_pretrained(d)
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy(f, d / f.name)
    return d


@pytest.fixture(scope="module")
def eagle3_export(tiny_target, tmp_path_factory):
    from benchmarks.serving import eagle3_init_export

    out = tmp_path_factory.mktemp("eagle3_exports") / "fit"
    return eagle3_init_export.build(str(tiny_target), str(out), draft_vocab=500, steps=3, fit_prompts=24,
                                    fit_bench="testbed", fit_new_tokens=24, spread=True)  # d2t offsets not all 0


def test_an_eagle3_export_is_served_as_vllms_eagle3_method(eagle3_export, tiny_target, tmp_path):
    assert vllm_compare.drafter_kind(str(eagle3_export)) == "eagle3"
    assert vllm_compare.drafter_kind(str(tiny_target)) == "draft"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba2"}))
    assert vllm_compare.drafter_kind(str(tmp_path)) == "mamba"
    # what vLLM cannot load is named before it starts: no config.json, a reduced head, an EESD exit
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "draft_vocab": [0, 5, 9]}))
    with pytest.raises(SystemExit, match="a reduced draft vocabulary \\(3 ids\\)"):
        vllm_compare.drafter_kind(str(tmp_path))
    (tmp_path / "draftforge.json").write_text(json.dumps({"task": "eesd"}))
    with pytest.raises(SystemExit, match="an EESD exit head"):
        vllm_compare.drafter_kind(str(tmp_path))
    with pytest.raises(SystemExit, match="no config.json"):
        vllm_compare.drafter_kind(str(tmp_path / "nowhere"))
    config = json.loads((eagle3_export / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 500
    from safetensors.torch import load_file

    assert load_file(str(eagle3_export / "model.safetensors"))["d2t"].count_nonzero() > 400  # the map is tested
    meta = json.loads((eagle3_export / "draftforge.json").read_text())
    assert meta["init"]["fit"]["sequences"] == 24 and meta["target"] == str(tiny_target.resolve())


def test_the_eagle3_export_drafts_losslessly_in_the_harness_and_on_vllms_rounds(eagle3_export, tiny_target):
    import torch

    from draftforge.decode import build_decoder, load_drafter, load_target

    target = load_target(str(tiny_target), dtype=torch.float32)
    ar = build_decoder("ar", target)
    chain = build_decoder("chain", target, load_drafter(str(eagle3_export), target), chain_length=3)
    prompts = [[1, 40, 41, 42, 43], [1, 7, 99, 7, 99, 7]]
    answers = [ar.generate(ids, max_new_tokens=12, eos_token_id=[]).tokens for ids in prompts]
    for ids, answer in zip(prompts, answers):
        assert chain.generate(ids, max_new_tokens=12, eos_token_id=[]).tokens == answer
    got = vllm_compare.on_vllm_rounds(chain, prompts, answers, 3)
    assert got["tokens"] == answers and len(got["spec_per_prompt"]) == len(answers) == 2
    for counts, answer in zip(got["spec_per_prompt"], answers):
        # every decode step after the prefill drafts; the answer is 1 + rounds + accepted, less any overshoot
        assert 1 + counts["num_drafts"] + counts["num_accepted_tokens"] >= len(answer) > counts["num_drafts"]


@pytest.mark.slow
@pytest.mark.parametrize("aux", [None, [1, 3]], ids=["three-aux-layers", "two-aux-layers"])
def test_vllm_serves_an_eagle3_export(eagle3_export, tiny_target, tmp_path, aux):
    """vLLM runs the export with its eagle3 method: fp32 outputs equal plain greedy, and its draft / acceptance
    counters equal draftforge's on vLLM's rounds, prompt by prompt. With two aux layers the export failed to load
    (vLLM sized fc for three: the export did not say num_aux_hidden_states)."""
    python, note = vllm_compare.vllm_python(None)
    if python is None:
        pytest.skip(note)
    if aux is not None:
        from benchmarks.serving import eagle3_init_export

        eagle3_export = eagle3_init_export.build(str(tiny_target), str(tmp_path / "e3"), draft_vocab=500, steps=3,
                                                 fit_prompts=24, fit_bench="testbed", fit_new_tokens=24,
                                                 aux_layers=aux, spread=True)
    result = vllm_compare.main(["--target", str(tiny_target), "--drafter", str(eagle3_export), "--bench", "testbed",
                                "--num-prompts", "3", "--max-new-tokens", "16", "--draft-tokens", "3",
                                "--out", str(tmp_path / "out.json")])
    for name, r in result["engines"].items():
        assert r["identical_to_vllm_plain"] == 3, name
    assert result["drafter_counts_equal_per_prompt"] == 3, result["drafter_counts_per_prompt"]
    accepted = result["engines"]["vLLM/eagle3-3"]["spec"]["accepted_per_pos"]
    assert accepted[0] > 0 and accepted[-1] > 0  # drafts accepted at every depth: the counts compare something


def test_the_harness_side_runs_ar_with_and_without_the_lean_forward_to_the_same_tokens(tmp_path):
    from tests.fixtures.decode import tiny_llama

    tiny_llama(vocab=64, layers=2, hidden=64).save_pretrained(tmp_path / "t")
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    out = vllm_compare.harness(str(tmp_path / "t"), None, prompts, 12, 3, torch.bfloat16)
    own = "ar, the model's own forward (lean_forward off)"
    assert {"ar", own, "prompt-lookup-3"} <= set(out)
    assert out[own]["tokens"] == out["ar"]["tokens"] and all(len(t) == 12 for t in out["ar"]["tokens"])


def test_on_vllms_rounds_an_eos_accepted_mid_round_counts_as_vllm_counts(tmp_path):
    """vLLM records a round's accepted drafts before trimming the answer at EOS; the harness stopped at the EOS
    and counted fewer. Oracle by hand: with the target as its own drafter every draft is accepted, so an answer
    of L tokens (the first from the prefill) takes ceil((L - 1) / (k + 1)) rounds of k accepted drafts each."""
    import math

    import torch

    from draftforge.decode import build_decoder, load_drafter, load_target
    from tests.fixtures.decode import tiny_llama

    model = tiny_llama(vocab=64, layers=2, hidden=64)
    free = build_decoder("ar", load_target(model)).generate([1, 2, 3, 4, 5], max_new_tokens=20,
                                                             eos_token_id=[]).tokens
    eos = free[6]  # met mid-answer
    model.generation_config.eos_token_id = eos
    model.save_pretrained(tmp_path / "t")
    target = load_target(str(tmp_path / "t"), dtype=torch.float32)
    answer = build_decoder("ar", target).generate([1, 2, 3, 4, 5], max_new_tokens=20).tokens  # ends at the EOS
    assert answer[-1] == eos and len(answer) < 20
    k = 3
    chain = build_decoder("chain", target, load_drafter(str(tmp_path / "t"), target, dtype=torch.float32),
                          chain_length=k)
    got = vllm_compare.on_vllm_rounds(chain, [[1, 2, 3, 4, 5]], [answer], k)
    rounds = math.ceil((len(answer) - 1) / (k + 1))
    assert got["tokens"] == [answer]
    assert got["spec_per_prompt"] == [{"num_drafts": rounds, "num_accepted_tokens": k * rounds,
                                       "accepted_per_pos": [rounds] * k}]


def test_vllm_serve_refuses_two_settings_under_one_name(monkeypatch, capsys, tmp_path):
    # results are keyed kind-K: the second drafter's replaced the first's in the JSON
    import sys

    from benchmarks.serving import vllm_serve

    monkeypatch.setattr(sys, "argv", ["vllm_serve.py", "--target", "t", "--prompts", "p.json", "--out",
                                      str(tmp_path / "o.json"), "--setting", "draft:/a:3", "--setting", "draft:/b:3"])
    with pytest.raises(SystemExit) as e:
        vllm_serve.main()
    assert e.value.code == 2 and "two settings are both draft-3" in capsys.readouterr().err


def test_vllms_output_after_a_failure_never_replaces_a_users_file(tmp_path):
    # the log beside --out (v.vllm.log) was written over whatever file had that name
    log = tmp_path / "v.vllm.log"
    assert vllm_compare.failure_log(log) == log  # free: used
    log.write_text(vllm_compare.LOG_HEADER + "an earlier failure\n")
    assert vllm_compare.failure_log(log) == log  # an earlier log of ours: replaced
    log.write_text("my notes\n")
    (tmp_path / "v-1.vllm.log").write_text("more notes\n")
    assert vllm_compare.failure_log(log) == tmp_path / "v-2.vllm.log"  # a user's files: kept, the next free name
    assert log.read_text() == "my notes\n"
