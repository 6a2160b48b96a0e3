"""`draftforge harvest trees` and task `c2t`: labels equal an actual decode, resumable shards, bad input, training.

The harvest labels come from the target's greedy continuation (docs/methods/c2t.md §6); the check decodes the same
prompt with the engine, verifying the same full EAGLE-2 trees in tree-attention forwards, and
compares the accepted path of every round with the harvest's label-1 nodes of the same tree.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import datasets
import pytest
import torch

from draftforge.cli import main as cli_main
from draftforge.harvest import c2t as hv
from draftforge.decode import SpeculativeDecoder, load_drafter, load_target
from draftforge.decode.methods.eagle2 import Eagle2Builder
from draftforge.errors import CompatibilityError, DataError
from draftforge.models.c2t import C2TClassifier, load_head
from tests.fixtures.decode import eagle3_head, noisy_copy, tiny_llama, tiny_mamba
from tests.fixtures.plans import PlanController

VOCAB = 12
SETTINGS = hv.HarvestSettings(top_k=3, depth=3, top_m=1000, max_new_tokens=15)


Recorder = PlanController


@pytest.mark.parametrize("kind,prompt_len", [("mamba", 9), ("transformer", 9), ("eagle3", 9), ("eagle3", 1)])
def test_harvest_labels_equal_the_accepted_paths_of_a_real_decode(kind, prompt_len):
    """A one-token prompt gives a drafter that reads the target's states nothing to draft from in its first round
    (the decoder runs that round as AR): the harvest writes no rows for it (it crashed) and goes on."""
    target = load_target(tiny_llama(vocab=VOCAB, dtype=torch.float64))
    model = {"mamba": lambda: tiny_mamba(vocab=VOCAB, dtype=torch.float64),
             "transformer": lambda: noisy_copy(target.model, 0.05),
             "eagle3": lambda: eagle3_head(target.model, 0.05)}[kind]()  # reads the target: it follows the decode
    drafter = load_drafter(model, target)
    prompt = [(5 * i + 2) % VOCAB for i in range(prompt_len)]
    rows = hv.harvest_prompt(target, drafter, prompt, "p0", SETTINGS, ("t", "d"), eos=[])
    ctrl = Recorder(Eagle2Builder(3, 3, rerank=False).plan())
    SpeculativeDecoder("x", target, drafter, ctrl).generate(prompt, max_new_tokens=SETTINGS.max_new_tokens,
                                                            eos_token_id=[])
    trees = [r for r in ctrl.rounds if r.plan is not None and len(r.tree)]
    assert (len(ctrl.rounds[0].tree) == 0) == (prompt_len == 1)
    ids = list(dict.fromkeys(rows["tree_id"]))
    assert len(ids) == len(trees) > 1
    accepted = 0
    for tree_id, rnd in zip(ids, trees):
        mine = [i for i, t in enumerate(rows["tree_id"]) if t == tree_id]
        assert len(mine) == len(rnd.tree)
        assert [rows["node"][i] for i in mine if rows["label"][i]] == rnd.path
        assert [rows["d"][i] for i in mine] == [d - 1 for d in rnd.tree.depths]
        accepted += len(rnd.path)
    assert accepted > 0  # some trees had accepted nodes
    first = [i for i, t in enumerate(rows["tree_id"]) if t == ids[0]]
    assert len(first) == 3 + 3 * 9  # a full pool: k + depth·k² nodes
    assert all(0 < rows["P"][i] <= 1 and 0 < rows["H"][i] <= torch.log(torch.tensor(VOCAB)) + 1e-6 for i in first)


def test_harvested_features_equal_a_per_path_run_of_the_drafter():
    """The rows C2T trains on must hold the features its decoder computes (docs/methods/c2t.md): for every node of
    the first tree, P = the product of the drafter's probabilities along its root path, H = −Σ p·log p over the
    top-M of its parent's distribution (not renormalised; M = 5 of 12 ids here), d = its draft layer − 1, each
    from a plain forward of the drafter over the prompt and the node's ancestors."""
    target = load_target(tiny_llama(vocab=VOCAB, dtype=torch.float64))
    model = noisy_copy(target.model, 0.3)
    drafter = load_drafter(model, target)
    prompt = [(5 * i + 2) % VOCAB for i in range(9)]
    settings = hv.HarvestSettings(top_k=3, depth=2, top_m=5, max_new_tokens=6)
    rows = hv.harvest_prompt(target, drafter, prompt, "p0", settings, ("t", "d"), eos=[])
    first = [i for i, t in enumerate(rows["tree_id"]) if t == rows["tree_id"][0]]
    assert len(first) == 3 + 2 * 9
    tokens = {}  # node -> its token, found from the parent's distribution below
    with torch.no_grad():
        def probs(ids):
            return model(torch.tensor([ids])).logits[0, -1].double().softmax(-1)

        for i in first:  # parents come before their children
            node, parent = rows["node"][i], rows["parent"][i]
            ancestors = []
            up = parent
            while up != -1:
                ancestors.insert(0, up)
                up = rows["parent"][first[0] + up]
            p_parent = probs(prompt + [tokens[a] for a in ancestors])
            top = p_parent.topk(5).values
            assert rows["H"][i] == pytest.approx(float(-(top * top.log()).sum()), rel=1e-5)
            assert rows["d"][i] == len(ancestors)
            # the node's token: the one whose joint probability the harvest recorded, among its parent's top-3
            joint_parent = rows["P"][first[0] + parent] if parent != -1 else 1.0
            siblings = [tokens[n] for n in tokens if rows["parent"][first[0] + n] == parent]
            cand = [int(t) for t in p_parent.topk(3).indices if int(t) not in siblings]
            tok = cand[0]
            tokens[node] = tok
            assert rows["P"][i] == pytest.approx(joint_parent * float(p_parent[tok]), rel=1e-5)


def save_models(tmp_path) -> tuple[Path, Path]:
    target = tiny_llama(vocab=VOCAB)
    t_dir, d_dir = tmp_path / "target", tmp_path / "drafter"
    target.save_pretrained(t_dir)
    noisy_copy(target, 0.05).save_pretrained(d_dir)
    return t_dir, d_dir


def harvest_cli(t_dir, d_dir, bench, out, *extra):
    return cli_main(["harvest", "trees", "--target", str(t_dir), "--drafter", str(d_dir), "--bench", str(bench),
                     "--out", str(out), "--top-k", "3", "--depth", "3", "--max-new-tokens", "24", "--ignore-eos",
                     *extra])


@pytest.fixture(scope="module")
def harvested(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("harvest")
    t_dir, d_dir = save_models(tmp)
    bench = tmp / "prompts.jsonl"
    bench.write_text("".join(json.dumps({"input_ids": [(3 * i + j) % VOCAB for j in range(5 + i % 4)]}) + "\n"
                             for i in range(12)))
    assert harvest_cli(t_dir, d_dir, bench, tmp / "h") == 0
    return t_dir, d_dir, bench, tmp / "h"


def test_harvest_cli_writes_shards_and_resumes(harvested, capsys):
    t_dir, d_dir, bench, out = harvested
    shards = sorted(out.glob("*.parquet"))
    assert len(shards) == 12 and (out / "harvest.json").is_file()
    data = hv.load_harvest([out])
    assert set(hv.COLUMNS) <= set(data.column_names) and sum(data["label"]) > 0
    before = shards[5].read_bytes()
    shards[5].unlink()
    assert harvest_cli(t_dir, d_dir, bench, out) == 2  # an existing harvest needs --resume
    assert "--resume" in capsys.readouterr().err
    assert harvest_cli(t_dir, d_dir, bench, out, "--resume") == 0
    assert shards[5].read_bytes() == before  # the missing shard is made again, identically
    # a kept shard cut short (a damaged copy) is harvested again, identically, and said so (a traceback before)
    shards[7].write_bytes(shards[7].read_bytes()[: len(shards[7].read_bytes()) // 2])
    capsys.readouterr()
    assert harvest_cli(t_dir, d_dir, bench, out, "--resume") == 0
    assert "1 kept shard(s) could not be read (prompt-000007.parquet): harvested again" in capsys.readouterr().err
    assert shards[5].read_bytes() == before and len(hv.load_harvest([out])) == len(data)


def test_a_resume_on_another_device_says_so_and_records_it(harvested, tmp_path, monkeypatch, capsys):
    import shutil

    t_dir, d_dir, bench, out = harvested
    copy = tmp_path / "h"
    shutil.copytree(out, copy)
    devices = json.loads((copy / "harvest.json").read_text())["devices"]
    assert len(devices) == 1 and devices[0].startswith("cpu: ")
    monkeypatch.setattr("draftforge.harvest.c2t.device_name", lambda device: "cuda: Imaginary GPU")
    capsys.readouterr()
    assert harvest_cli(t_dir, d_dir, bench, copy, "--resume") == 0  # nothing left to harvest: nothing to say
    assert "continued on" not in capsys.readouterr().err
    (copy / "prompt-000003.parquet").unlink()
    assert harvest_cli(t_dir, d_dir, bench, copy, "--resume") == 0
    assert (f"notice: continued on cuda: Imaginary GPU; the part already written was computed on {devices[0]}"
            in capsys.readouterr().err)
    assert json.loads((copy / "harvest.json").read_text())["devices"] == [*devices, "cuda: Imaginary GPU"]


def test_a_resume_over_other_prompts_or_a_broken_record_is_refused(harvested, tmp_path, capsys):
    """Another bench (or --num-prompts, or without --ignore-eos) under --resume put other prompts' trees under the
    same shard numbers; a damaged harvest.json was a JSONDecodeError traceback."""
    import shutil

    t_dir, d_dir, bench, out = harvested
    copy = tmp_path / "h"
    shutil.copytree(out, copy)
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"input_ids": [(5 * i + j) % VOCAB for j in range(6)]}) + "\n"
                             for i in range(12)))
    before = sorted((p.name, p.stat().st_mtime_ns) for p in copy.iterdir())
    assert harvest_cli(t_dir, d_dir, other, copy, "--resume") == 2
    assert "harvested with other prompts (the --bench file, --num-prompts or --chat-template changed" in \
        capsys.readouterr().err
    assert cli_main(["harvest", "trees", "--target", str(t_dir), "--drafter", str(d_dir), "--bench", str(bench),
                     "--out", str(copy), "--top-k", "3", "--depth", "3", "--max-new-tokens", "24", "--resume"]) == 2
    assert "another ignore_eos" in capsys.readouterr().err
    assert sorted((p.name, p.stat().st_mtime_ns) for p in copy.iterdir()) == before
    meta = json.loads((copy / "harvest.json").read_text())
    (copy / "harvest.json").write_text(json.dumps({**meta, "depth_origin": 1}))  # its d column counts from 1
    assert harvest_cli(t_dir, d_dir, bench, copy, "--resume") == 2
    assert "another depth_origin (the harvest's 1, this run's 0)" in capsys.readouterr().err
    (copy / "harvest.json").write_text("{not json")
    assert harvest_cli(t_dir, d_dir, bench, copy, "--resume") == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "harvest.json: not readable JSON" in err[0]


def test_overwrite_replaces_the_harvest_and_nothing_else(harvested, tmp_path, capsys):
    """harvest trees had no --overwrite (the other harvests have one): starting again meant deleting by hand."""
    import shutil

    t_dir, d_dir, bench, out = harvested
    copy = tmp_path / "h"
    shutil.copytree(out, copy)
    (copy / "NOTES.md").write_text("mine")
    before = {p.name: p.read_bytes() for p in copy.glob("*.parquet")}
    # the user's own parquet files: --overwrite deleted one that matched prompt-*.parquet, and reading the harvest
    # (its summary, training) took both for shards and crashed on their columns
    mine = {"prompt-notes.parquet": b"my notes", "my_analysis.parquet": b"my table"}
    for name, data in mine.items():
        (copy / name).write_bytes(data)
    (copy / "prompt-000099.parquet").write_bytes(b"a shard of a longer harvest")  # not the new harvest's: removed
    assert harvest_cli(t_dir, d_dir, bench, copy, "--resume", "--overwrite") == 2
    assert "pass one of them" in capsys.readouterr().err
    assert harvest_cli(tmp_path / "no-such-target", d_dir, bench, copy, "--overwrite") == 2  # a failed load: kept
    assert (copy / "prompt-000099.parquet").is_file() and (copy / "harvest.json").is_file()
    capsys.readouterr()
    assert harvest_cli(t_dir, d_dir, bench, copy, "--overwrite") == 0
    assert "--overwrite: removed the harvest in" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in copy.glob("*.parquet") if p.name not in mine} == before  # the same shards
    assert (copy / "NOTES.md").read_text() == "mine"
    assert all((copy / name).read_bytes() == data for name, data in mine.items())
    other = tmp_path / "other"  # another command's harvest under harvest.json is not replaced
    other.mkdir()
    (other / "harvest.json").write_text(json.dumps({"kind": "theta-harvest"}))
    assert harvest_cli(t_dir, d_dir, bench, other, "--overwrite") == 2
    assert "holds a theta-harvest, not a trees harvest" in capsys.readouterr().err
    assert json.loads((other / "harvest.json").read_text()) == {"kind": "theta-harvest"}


def test_harvest_bad_input(harvested, tmp_path, capsys):
    _, d_dir, bench, out = harvested
    other = tiny_llama(vocab=VOCAB, seed=5)
    other.save_pretrained(tmp_path / "other")
    assert harvest_cli(tmp_path / "other", d_dir, bench, out, "--resume") == 2
    assert "another target" in capsys.readouterr().err
    shard = min(out.glob("*.parquet"))
    datasets.Dataset.from_parquet(str(shard)).remove_columns(["H"]).to_parquet(str(tmp_path / "noH.parquet"))
    with pytest.raises(DataError, match=r"lacks column\(s\) \['H'\]"):
        hv.load_harvest([tmp_path / "noH.parquet"])
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    data = datasets.Dataset.from_parquet(str(shard))
    data.to_parquet(str(mixed / "prompt-000000.parquet"))
    data.map(lambda r: {"target": "0" * 16}).to_parquet(str(mixed / "prompt-000001.parquet"))
    with pytest.raises(CompatibilityError, match="several targets"):
        hv.load_harvest([mixed])
    with pytest.raises(CompatibilityError, match="not from this recipe's target"):
        hv.load_harvest([out], target_fingerprint="f" * 16)
    with pytest.raises(DataError, match="nothing does not exist"):
        hv.load_harvest([tmp_path / "nothing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no parquet shards"):
        hv.load_harvest([tmp_path / "empty"])
    shifted = tmp_path / "shifted"  # a harvest counting d from 1 would train a head reading every layer one off
    shutil.copytree(out, shifted)
    meta = json.loads((shifted / hv.META_FILE).read_text())
    (shifted / hv.META_FILE).write_text(json.dumps({**meta, "depth_origin": 1}))
    with pytest.raises(CompatibilityError, match=r"counts draft depth d from 1 .* first draft layer d=0"):
        hv.load_harvest([out, shifted])


def c2t_recipe(tmp_path, t_dir, out, **task) -> dict:
    return {"task": "c2t", "output_dir": str(tmp_path / "run"), "model": {"target": str(t_dir)},
            "data": {"sources": [str(out)]}, "c2t": {"eval_fraction": 0.25, "negative_ratio": 3, **task},
            "optim": {"lr": 1e-2, "warmup_steps": 0, "weight_decay": 0.0, "schedule": "constant"},
            "train": {"max_steps": 60, "global_batch_size": 64, "micro_batch_size": 64, "block_size": 1,
                      "eval_every": 30, "save_every": 60, "log_every": 10, "trackers": []}}


def test_c2t_task_trains_and_exports_a_head(harvested, tmp_path):
    from draftforge.recipe import recipe_from_dict
    from draftforge.train.c2t import build
    from draftforge.train.loop import read_metrics, train

    initial = {}

    def build_and_keep_the_start(recipe, acc, with_data=True):  # the task's own builder; its head before step 1
        spec = build(recipe, acc, with_data)
        initial.setdefault("state", {k: v.clone() for k, v in spec.model.state_dict().items()})
        return spec

    t_dir, _, _, out = harvested
    result = train(recipe_from_dict(c2t_recipe(tmp_path, t_dir, out)), build_and_keep_the_start)
    assert sum(result.losses[-5:]) / 5 < result.losses[0]
    logged = read_metrics(result.run_dir)
    assert all({"pred_positive", "accepted", "hits"} <= set(r) for r in logged)
    head, meta = load_head(result.export_dir)
    assert meta["features"] == ["P", "H", "d"] and meta["task"] == "c2t"
    report = meta["heldout"]
    assert report["accepted"] > 0 and 0 <= report["beta=0.5"]["recall"] <= 1
    assert report["beta=0.2"]["positive_rate"] >= report["beta=0.9"]["positive_rate"]
    assert meta["harvest"]["train_rows"] < meta["harvest"]["rows"]  # negatives were sampled
    again = tmp_path / "again"  # `draftforge export` of the run goes through the task's hook too
    assert cli_main(["export", str(result.run_dir), "--out", str(again)]) == 0
    assert (again / "c2t.safetensors").read_bytes() == (result.export_dir / "c2t.safetensors").read_bytes()
    assert cli_main(["export", str(result.run_dir), "--out", str(again)]) == 2  # a head is kept without --overwrite
    assert cli_main(["export", str(result.run_dir), "--out", str(again), "--overwrite"]) == 0
    trained = head.state_dict()
    assert trained.keys() == initial["state"].keys()
    for name, before in initial["state"].items():
        assert not torch.equal(before, trained[name]), f"{name} did not train"


def test_c2t_task_feature_sets_and_bad_target(harvested, tmp_path):
    from draftforge.errors import RecipeError
    from draftforge.recipe import recipe_from_dict
    from draftforge.train import run

    t_dir, _, _, out = harvested
    values = c2t_recipe(tmp_path, t_dir, out, features="Hd")
    values["train"]["max_steps"] = 4
    result = run(recipe_from_dict(values))
    assert load_head(result.export_dir)[1]["features"] == ["H", "d"]
    with pytest.raises(RecipeError, match="c2t.features"):
        recipe_from_dict(c2t_recipe(tmp_path, t_dir, out, features="PHdx"))
    other = tiny_llama(vocab=VOCAB, seed=5)
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(CompatibilityError, match="not from this recipe's target"):
        run(recipe_from_dict(c2t_recipe(tmp_path / "again", tmp_path / "other", out)))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tree_budget_benchmark_end_to_end(harvested, tmp_path, dtype):
    """benchmarks/decoding/tree_budget.py: one run sweeps N and β, checks every output against AR (fp32: bitwise;
    bf16: identical or a measured near-tie, benchmarks.common.versus_ar), writes JSON + PNG."""
    from benchmarks.decoding import tree_budget as mod
    from tests.decode.test_c2t import hand_set_head

    t_dir, d_dir, bench, _ = harvested
    head = hand_set_head(tmp_path / "head")
    out = tmp_path / "bench"
    assert mod.main(["--target", str(t_dir), "--drafter", str(d_dir), "--bench", str(bench), "--c2t", str(head),
                     "--c2t-head", f"again={head}", "--ns", "4,12", "--betas", "0.4,0.6", "--eagle-top-k", "3",
                     "--eagle-depth", "3", "--c2t-top-k", "3", "--c2t-depth", "4", "--num-prompts", "2",
                     "--max-new-tokens", "12", "--repeats", "2", "--out", str(out),
                     "--dtype", dtype]) == 0  # 1 on any defect
    result = json.loads((out / "tree_budget.json").read_text())
    names = [p["name"] for p in result["points"]]
    assert names == ["ar", "eagle2 N=4", "eagle2 N=12", "c2t β=0.4", "c2t β=0.6", "again β=0.5"]
    assert all(len(p["secs_per_repeat"]) == 2 for p in result["points"])
    if dtype == "float32":
        assert all(p["lossless"] and p["versus_ar"] is None for p in result["points"])
    else:
        assert all(p["lossless"] or p["versus_ar"]["ok"] for p in result["points"])
    assert (out / "tree_budget.png").stat().st_size > 0


def test_an_out_it_may_not_write_is_refused_before_any_model_loads(harvested, tmp_path, capsys):
    """With a --target that does not exist, the refusal must be about --out: it came after both models loaded."""
    _, d_dir, bench, out = harvested
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    for where, said in ((out, "already holds a harvest; pass --resume"), (mine, "holds files that are not a harvest")):
        assert harvest_cli(tmp_path / "no-such-target", d_dir, bench, where) == 2
        assert said in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "mine" and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_the_harvests_top_m_is_the_one_the_exported_head_and_its_decoder_use(harvested, tmp_path):
    # H is the entropy of the parent's top-M: a head exported with M = 1000 whatever the harvest's --top-m, and a
    # decoder that took max(M, K), computed H otherwise than the rows it learnt from
    from draftforge.decode import build_decoder
    from draftforge.recipe import recipe_from_dict
    from draftforge.train import run

    t_dir, d_dir, bench, out = harvested
    small = tmp_path / "h2"
    assert harvest_cli(t_dir, d_dir, bench, small, "--top-m", "2", "--num-prompts", "4") == 0
    values = c2t_recipe(tmp_path, t_dir, small)
    values["train"]["max_steps"] = 4
    result = run(recipe_from_dict(values))
    assert load_head(result.export_dir)[1]["entropy_top_m"] == 2
    again = tmp_path / "again"  # `draftforge export RUN_DIR` reads the run's own record
    assert cli_main(["export", str(result.run_dir), "--out", str(again)]) == 0
    assert json.loads((again / "draftforge.json").read_text())["entropy_top_m"] == 2
    target = load_target(str(t_dir), dtype=torch.float32)
    decoder = build_decoder("c2t", target, load_drafter(str(d_dir), target), c2t=str(result.export_dir),
                            c2t_top_k=3, c2t_depth=3)
    builder = decoder.controller.plan.builder
    probs_BV = torch.softmax(torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0)), -1)
    top2 = probs_BV.topk(2).values
    _, conf_BK = builder.scores(1, probs_BV.log(), torch.ones(2))
    x = torch.stack([probs_BV.topk(3).values.double(), (-(top2 * top2.log()).sum(-1))[:, None].expand(2, 3),
                     torch.zeros(2, 3)], -1)
    assert torch.allclose(conf_BK, builder.classifier.confidence(x.float()), atol=1e-6)  # H over the top 2
    with pytest.raises(CompatibilityError, match="different top-M"):
        run(recipe_from_dict(c2t_recipe(tmp_path / "both", t_dir, small) | {"data": {"sources": [str(out),
                                                                                                str(small)]}}))


def test_empty_shards_load_and_tree_ids_stay_apart_across_harvests(harvested, tmp_path, capsys):
    # a prompt whose continuation is one token grows no tree: its shard had null-typed columns, and a harvest
    # whose first shard was one failed to load (a traceback, in harvest, --resume and train alike); tree ids
    # "prompt/step" of two harvests of line-numbered prompts collided, so trees and τ were miscounted
    import shutil

    t_dir, d_dir, bench, out = harvested
    one = hv.summarize(hv.load_harvest([out]))
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    both = hv.summarize(hv.load_harvest([out, copy]))
    assert (both["trees"], both["rows"], both["tau"]) == (2 * one["trees"], 2 * one["rows"], one["tau"])
    first = copy / "prompt-000000.parquet"
    hv.write_shard({c: [] for c in hv.COLUMNS}, first)  # as a prompt without trees writes it now
    assert len(hv.load_harvest([copy])) == one["rows"] - len(datasets.Dataset.from_parquet(str(out / first.name)))
    datasets.Dataset.from_dict({c: [] for c in hv.COLUMNS}).to_parquet(str(first))  # untyped, as before
    assert len(hv.load_harvest([copy])) < one["rows"]
    short = tmp_path / "short"  # one new token per prompt: no tree anywhere, one clear error
    assert harvest_cli(t_dir, d_dir, bench, short, "--max-new-tokens", "1", "--num-prompts", "2") == 2
    err = capsys.readouterr().err
    assert "holds no trees" in err and "Traceback" not in err


def test_a_resume_removes_the_half_shard_a_killed_write_left(harvested, tmp_path):
    import shutil

    t_dir, d_dir, bench, out = harvested
    copy = tmp_path / "h"
    shutil.copytree(out, copy)
    (copy / "prompt-000003.parquet").unlink()
    half = copy / ".prompt-000003.parquet.tmp"  # killed between writing the temp file and renaming it
    half.write_bytes(b"PAR1 cut short")
    assert harvest_cli(t_dir, d_dir, bench, copy, "--resume") == 0
    assert not half.exists() and (copy / "prompt-000003.parquet").read_bytes() == (out / "prompt-000003.parquet"
                                                                                   ).read_bytes()


def test_a_top_k_past_the_vocabulary_names_this_commands_flag(harvested, tmp_path, capsys):
    """harvest trees reuses EAGLE-2's check, which named --eagle-top-k, a flag this command does not have."""
    t_dir, d_dir, bench, _ = harvested
    assert harvest_cli(t_dir, d_dir, bench, tmp_path / "h", "--top-k", "100000") == 2
    err = capsys.readouterr().err
    assert "--top-k 100000 is larger than the drafter's vocabulary" in err and "--eagle-top-k" not in err


def test_a_trees_harvest_cut_short_another_kind_or_a_missing_target_is_one_line(harvested, tmp_path):
    """From an audit: a killed, unresumed trees harvest trained on part of its prompts with nothing said; a θ
    harvest or a missing folder as data.sources was "holds no parquet shards"; a model.target that does not exist
    skipped the target check and trained; a missing --bench was found only after both models loaded."""
    from draftforge.errors import DataError, RecipeError
    from draftforge.harvest.c2t import TreeHarvestJob, harvest_trees, load_harvest
    from draftforge.train.c2t import target_fingerprint

    t_dir, d_dir, bench, out = harvested
    assert json.loads((out / "harvest.json").read_text())["prompts"] == 12
    cut = tmp_path / "cut"
    shutil.copytree(out, cut)
    sorted(cut.glob("prompt-*.parquet"))[-1].unlink()
    with pytest.raises(DataError, match=r"cut is incomplete \(11 of 12 prompts\).*--resume"):
        load_harvest([cut])
    theta = tmp_path / "theta"
    theta.mkdir()
    (theta / "harvest.json").write_text(json.dumps({"kind": "theta-harvest", "shards": {}}))
    with pytest.raises(DataError, match="holds a theta-harvest, not a C2T trees harvest"):
        load_harvest([theta])
    with pytest.raises(DataError, match="harvest source .*missing does not exist"):
        load_harvest([tmp_path / "missing"])
    with pytest.raises(RecipeError, match=r"model.target': directory .*no-such-target does not exist"):
        target_fingerprint(str(tmp_path / "no-such-target"))
    with pytest.raises(DataError, match=r"--bench .*nope.jsonl does not exist"):  # t_dir/d_dir never load
        harvest_trees(TreeHarvestJob(target=str(tmp_path / "t"), drafter=str(tmp_path / "d"),
                                     bench=str(tmp_path / "nope.jsonl"), out=str(tmp_path / "o")))
