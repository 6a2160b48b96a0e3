"""Task `eesd` (EESD §3.1-3.2): only the exit head trains (the target's trunk stays bitwise the same), the
loss falls, the export holds only the trained parts and attaches to its own target only, export -> load
gives the same drafts, bad recipes are refused before anything is built; the same with a reduced draft
vocabulary (model.draft_vocab, counted on the training labels or on model.draft_vocab_from rows).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from draftforge.cli import main as cli_main
from draftforge.decode import load_drafter, load_target
from draftforge.decode.methods.eesd import EarlyExitDrafter
from draftforge.decode.sampling import SamplingParams
from draftforge.errors import CheckpointError, CompatibilityError, RecipeError
from draftforge.recipe import recipe_from_dict
from draftforge.train.eesd import build_eesd_task
from draftforge.train.loop import train

LAYERS = 4


def save_target(path, tokenizer_dir, seed=0):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tiny_tokenizer_dir):
    return save_target(tmp_path_factory.mktemp("target"), tiny_tokenizer_dir)


def token_rows(path, target_dir, n=24):
    """Self-distilled rows: the target's own greedy continuations of short prompts (loss on the answer)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    g = torch.Generator().manual_seed(0)
    with path.open("w") as f:
        for _ in range(n):
            prompt = torch.randint(3, 500, (1, 6), generator=g)
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=26, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            f.write(json.dumps({"input_ids": out[0].tolist(), "prompt_len": 6}) + "\n")
    return path


def recipe(tmp_path, target_dir, rows, corpus=None, **eesd):
    return {
        "task": "eesd", "output_dir": str(tmp_path / "run"),
        "model": {"target": str(target_dir)},
        "data": {"sources": [str(rows)], "format": "tokens", "eval_fraction": 0.1},
        "eesd": {"exit_after_layer": 2, **({"open_sources": [str(corpus)]} if corpus else {}), **eesd},
        "optim": {"lr": 3e-3, "warmup_steps": 0, "weight_decay": 0.0},
        "train": {"max_steps": 25, "global_batch_size": 8, "micro_batch_size": 4, "block_size": 32,
                  "eval_every": 25, "save_every": 25, "log_every": 5, "trackers": []},
    }


def train_and_check(values: dict, target_dir):
    """Train; the loss falls, every exit-head tensor moved and the trunk is bitwise as loaded. (result, spec, head0)"""
    built = {}

    def build(r, acc, with_data=True):
        built["spec"] = spec = build_eesd_task(r, acc, with_data)
        built["head0"] = {k: v.clone() for k, v in spec.model.state_dict().items()}
        return spec

    result = train(recipe_from_dict(values), build)
    spec = built["spec"]
    assert sum(result.losses[-3:]) / 3 < result.losses[0] - 0.3
    original = load_file(str(target_dir / "model.safetensors"))
    trunk = spec.frozen["trunk"]
    for name, value in trunk.state_dict().items():  # embeddings + layers 1..2: bitwise as loaded
        key = "model." + name.replace("embed.", "embed_tokens.")
        assert torch.equal(value, original[key]), name
    assert not any(p.requires_grad for p in trunk.parameters())
    for name, value in spec.model.state_dict().items():
        assert not torch.equal(value, built["head0"][name]), f"{name} did not train"
    return result, spec, built["head0"]


def first_drafts(drafters, target, seq=(5, 17, 42, 9, 100, 7)):
    """Each drafter's greedy 6-token chain after `seq`."""
    seq, drafts = list(seq), []
    for d in drafters:
        paired = d.paired_target(target)
        paired.prefill(seq)
        d.reset()
        drafts.append(d.draft(seq, (1,) * 6, SamplingParams(), torch.Generator()).tokens)
    return drafts


def test_only_the_exit_head_trains_and_the_export_attaches_to_its_target(tmp_path, target_dir, tiny_corpus_dir):
    rows = token_rows(tmp_path / "rows.jsonl", target_dir)
    result, spec, _ = train_and_check(recipe(tmp_path, target_dir, rows, tiny_corpus_dir), target_dir)
    assert {p.split(".")[0] for p in spec.model.state_dict()} == {"layer", "norm", "lm_head"}
    mix = spec.data_stats
    assert mix["open_blocks"] == mix["self_distilled_blocks"] > 0  # open_fraction 0.5: as many blocks of each

    export = result.export_dir
    meta = json.loads((export / "draftforge.json").read_text())
    assert meta["task"] == "eesd" and meta["exit_after_layer"] == 2 and meta["num_layers"] == LAYERS
    assert not (export / "model.safetensors").exists()  # only the trained parts, not the target
    saved = load_file(str(export / "exit_head.safetensors"))
    assert set(saved) == set(spec.model.state_dict())

    # export -> load -> the same drafts as the trained head in memory
    target = load_target(str(target_dir))
    loaded = load_drafter(str(export), target)
    drafts = first_drafts([loaded, EarlyExitDrafter(spec.model.cpu(), 2, target.vocab_size)], target)
    assert drafts[0] == drafts[1]

    out = tmp_path / "again"  # `draftforge export RUN_DIR` goes through the same hook
    assert cli_main(["export", str(result.run_dir), "--out", str(out)]) == 0
    assert (out / "exit_head.safetensors").read_bytes() == (export / "exit_head.safetensors").read_bytes()

    other = load_target(str(save_target(tmp_path / "other", target_dir, seed=1)))
    with pytest.raises(CompatibilityError, match="fingerprint"):
        load_drafter(str(export), other)
    # the same weights under another RoPE base give the frozen layers other states: refused, naming the key
    import shutil

    moved = tmp_path / "rope"
    shutil.copytree(target_dir, moved)
    config = json.loads((moved / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    if rope:
        config["rope_parameters"] = {**rope, "rope_theta": rope["rope_theta"] * 2}
    else:
        config["rope_theta"] = config.get("rope_theta", 10000.0) * 2
    (moved / "config.json").write_text(json.dumps(config))
    with pytest.raises(CompatibilityError, match="config rope_"):
        load_drafter(str(export), load_target(str(moved)))


def test_export_refuses_a_target_replaced_since_the_run(tmp_path, target_dir):
    # `draftforge export RUN` rebuilt the head's frozen-trunk fingerprint from the model saved at the target path
    # since: the export then loaded on that model and was refused on the one it was trained on
    import shutil

    from draftforge.train.export_run import export_checkpoint

    target = tmp_path / "target"
    shutil.copytree(target_dir, target)
    values = recipe(tmp_path, target, token_rows(tmp_path / "rows.jsonl", target, n=8))
    values["train"].update(max_steps=2, eval_every=2, save_every=2)
    done = train(recipe_from_dict(values), build_eesd_task)
    save_target(target, target_dir, seed=1)
    with pytest.raises(CheckpointError, match=r"model.target changed since .* trained \(inputs.json records what it "
                                              r"read\), and the export would describe what is there now; the run's "
                                              r"own export in .* was written with what it trained on"):
        export_checkpoint(done.run_dir, tmp_path / "out", say=lambda *x: None)
    assert not (tmp_path / "out").exists()


def test_a_reduced_draft_vocabulary_trains_exports_and_drafts_inside_it(tmp_path, target_dir, tiny_corpus_dir):
    rows = token_rows(tmp_path / "rows.jsonl", target_dir, n=12)
    values = recipe(tmp_path, target_dir, rows, tiny_corpus_dir)
    values["model"]["draft_vocab"] = 48
    result, spec, head0 = train_and_check(values, target_dir)
    d2t = json.loads((result.run_dir / "draft_vocab.json").read_text())
    assert len(d2t) == 48 and d2t == sorted(d2t) and spec.model.lm_head.weight.shape == (48, 32)
    original = load_file(str(target_dir / "model.safetensors"))  # tied: the head is the embedding
    assert torch.equal(head0["lm_head.weight"], original["model.embed_tokens.weight"][d2t])
    # counted on the training blocks' loss labels (self-distilled and open), most frequent first
    labels = torch.tensor(spec.train_data["labels"]).flatten()
    counts = torch.bincount(labels[labels >= 0], minlength=512)
    assert set(counts.argsort(descending=True, stable=True)[:40].tolist()) <= set(d2t)
    # the loss is CE over draft ids: labels become head rows, -100 where the map lacks the token
    inside, outside = d2t[3], next(t for t in range(512) if t not in d2t)
    batch = spec.collate({"input_ids": [[1, 2, 3, 4]], "labels": [[-100, inside, outside, d2t[0]]]}, "cpu")
    assert batch["labels"].tolist() == [[-100, 3, -100, 0]]

    export = result.export_dir
    assert json.loads((export / "draftforge.json").read_text())["draft_vocab"] == d2t
    target = load_target(str(target_dir))
    loaded = load_drafter(str(export), target)
    assert loaded.d2t.tolist() == d2t
    drafts = first_drafts([loaded, EarlyExitDrafter(spec.model.cpu(), 2, target.vocab_size)], target)
    assert drafts[0] == drafts[1] and set(drafts[0]) <= set(d2t)
    out = tmp_path / "again"  # `draftforge export RUN_DIR` rebuilds the 48-row head from the run's map
    assert cli_main(["export", str(result.run_dir), "--out", str(out)]) == 0
    assert (out / "exit_head.safetensors").read_bytes() == (export / "exit_head.safetensors").read_bytes()

    meta = json.loads((out / "draftforge.json").read_text())  # a map made for a larger target: one clear error
    (out / "draftforge.json").write_text(json.dumps({**meta, "draft_vocab": d2t[:-1] + [512 + 7]}))
    with pytest.raises(CompatibilityError, match="outside the target's vocabulary"):
        load_drafter(str(out), target)
    (out / "draftforge.json").write_text(json.dumps({**meta, "draft_vocab": d2t[:-1]}))  # 47 ids, 48 rows
    with pytest.raises(CheckpointError, match="does not fit"):
        load_drafter(str(out), target)


def test_draft_vocabulary_from_other_token_rows(tmp_path, target_dir):
    """model.draft_vocab_from: the head's ids are those rows' most frequent loss ids, not the training data's."""
    from draftforge.train.export_run import _NoAccelerator

    rows = token_rows(tmp_path / "rows.jsonl", target_dir, n=4)
    answers = tmp_path / "answers.jsonl"
    answers.write_text('{"input_ids": [5, 6, 7, 9, 9, 9], "prompt_len": 2}\n{"input_ids": [40, 41, 9, 41], '
                       '"prompt_len": 1}\n')
    values = recipe(tmp_path, target_dir, rows)
    values["model"].update(draft_vocab=3, draft_vocab_from=str(answers))
    spec = build_eesd_task(recipe_from_dict(values), _NoAccelerator())
    eos = spec.tokenizer.eos_token_id  # always kept; then 9 (x4) and 41 (x2); prompt ids 5, 6, 40 carry no loss
    assert spec.model.config.draft_vocab == sorted({eos, 9, 41}) and spec.model.lm_head.out_features == 3


def test_head_only_exit_trains_norm_and_head(tmp_path, target_dir):
    rows = token_rows(tmp_path / "rows.jsonl", target_dir, n=8)
    values = recipe(tmp_path, target_dir, rows, exit_layer=False)
    values["train"]["max_steps"] = 3
    result = train(recipe_from_dict(values), build_eesd_task)
    saved = load_file(str(result.export_dir / "exit_head.safetensors"))
    assert {k.split(".")[0] for k in saved} == {"norm", "lm_head"}


def test_an_exit_head_resumes_as_it_would_have_run(tmp_path, target_dir, tiny_corpus_dir):
    from tests.fixtures.resume import assert_resume_matches_uninterrupted

    values = recipe(tmp_path, target_dir, token_rows(tmp_path / "rows.jsonl", target_dir), tiny_corpus_dir)
    values["train"].update(max_steps=6, eval_every=2, save_every=2, log_every=1)
    assert_resume_matches_uninterrupted(values, tmp_path, stop=3)


def test_bad_recipes_are_refused(tmp_path, target_dir):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    for n in (LAYERS, LAYERS + 3):
        with pytest.raises(RecipeError, match=r"eesd.exit_after_layer.*\[1, 3\]"):
            recipe_from_dict(recipe(tmp_path, target_dir, rows, exit_after_layer=n))
    with pytest.raises(RecipeError, match="eesd.exit_after_layer"):
        recipe_from_dict(recipe(tmp_path, target_dir, rows, exit_after_layer=0))
    with pytest.raises(RecipeError, match="eesd.layer_init"):
        recipe_from_dict(recipe(tmp_path, target_dir, rows, layer_init="first"))
    values = recipe(tmp_path, target_dir, rows)
    values["model"] = {"tokenizer": str(target_dir)}
    with pytest.raises(RecipeError, match="model.target"):
        recipe_from_dict(values)


def test_a_target_that_cannot_be_split_is_refused(tmp_path, tiny_tokenizer_dir):
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    path = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=3, n_head=4)).save_pretrained(path)
    tok.save_pretrained(path)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"input_ids": [1, 2, 3]}) + "\n")
    with pytest.raises(CompatibilityError, match="gpt2.*llama, mistral, qwen2"):
        recipe_from_dict(recipe(tmp_path, path, rows))


def test_eval_runs_an_eesd_export_against_ar(tmp_path, target_dir):
    """`draftforge eval --drafter EESD_EXPORT --methods eesd`: loaded, paired, self-checked against AR."""
    from draftforge.eval.runner import EvalConfig, run_eval
    from draftforge.models.eesd import ExitHead, split_target
    from draftforge.models.eesd_export import save_exit_head, target_identity

    target = load_target(str(target_dir))
    parts = split_target(target.model)
    export = save_exit_head(ExitHead.from_target(parts, 3), target_identity(parts, 3), target.tokenizer,
                            tmp_path / "exit", {"task": "eesd", "target": str(target_dir)})
    bench = tmp_path / "p.jsonl"
    bench.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in ([5, 17, 42, 9], [3, 88, 12, 61, 7])))
    rep = run_eval(EvalConfig(target=str(target_dir), drafter=str(export), bench=str(bench), max_new_tokens=12,
                              methods=("ar", "eesd", "chain"), out_dir=str(tmp_path / "out"),
                              quiet=True, plots=False,
                              method_options={"eesd": {"chain_length": 3}, "chain": {"chain_length": 3}}))
    by_method = {}
    for r in rep["records"]:
        by_method.setdefault(r["method"], []).append((r["prompt_id"], r["tokens"]))
    assert set(by_method) == {"ar", "eesd", "chain"}  # hf_assisted is skipped for an early-exit drafter
    assert by_method["eesd"] == by_method["ar"] == by_method["chain"]


def test_eesd_on_two_processes_matches_one(tmp_path, target_dir):
    """The frozen trunk stays out of DDP; 2 CPU processes give the 1-process loss curve."""
    import subprocess

    import yaml

    from draftforge.train.loop import read_metrics
    from tests import REPO
    from tests.train.test_distributed import _command, _env

    rows = token_rows(tmp_path / "rows.jsonl", target_dir, n=8)
    values = recipe(tmp_path, target_dir, rows)
    values["train"].update(max_steps=4, log_every=1, eval_every=0, save_every=4)
    path = tmp_path / "eesd.yaml"
    path.write_text(yaml.safe_dump(values))
    env = _env()
    losses = {}
    for config in (None, "multi_cpu.yaml"):
        out = tmp_path / f"run-{config}"
        proc = subprocess.run(_command(config, path, out), cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert ("2 process(es)" if config else "1 process(es)") in proc.stdout
        assert (out / "export" / "exit_head.safetensors").is_file()
        losses[config] = [r["loss"] for r in read_metrics(out)]
    assert losses["multi_cpu.yaml"] == pytest.approx(losses[None], rel=1e-4)


def test_eval_sources_are_the_whole_held_out_set_when_open_data_is_mixed_in(tmp_path, target_dir, tiny_corpus_dir):
    from transformers import AutoTokenizer

    from draftforge.train.eesd import mixed_blocks

    rows = token_rows(tmp_path / "rows.jsonl", target_dir, n=6)
    held = token_rows(tmp_path / "held.jsonl", target_dir, n=2)
    values = recipe(tmp_path, target_dir, rows, tiny_corpus_dir)
    values["data"]["eval_sources"] = [str(held)]
    tok = AutoTokenizer.from_pretrained(target_dir)
    data = mixed_blocks(recipe_from_dict(values), tok, len(tok))
    held_ids = [json.loads(line)["input_ids"] for line in held.read_text().splitlines()]
    assert all(len(ids) == 32 for ids in held_ids)  # one whole row per 32-token block
    assert list(data.eval["input_ids"]) == held_ids  # only the eval_sources rows: no open data held out


def test_the_surplus_of_a_mix_is_dropped_uniformly_not_from_the_end():
    # blocks sit in source order; keeping the first ones kept only the first sources (the stdlib corpus's first
    # modules in recipes/smollm2/eesd.yaml). Oracle: over 200 seeds every block of the larger side is kept, each
    # about 10 / 100 of the time (expected 20 times; the chance that a given one never is, 0.9**200, is 7e-10)
    import datasets

    from draftforge.train.eesd import _mix

    a = datasets.Dataset.from_dict({"i": list(range(100)), "side": ["a"] * 100})
    b = datasets.Dataset.from_dict({"i": list(range(10)), "side": ["b"] * 10})
    kept = torch.zeros(100)
    for seed in range(200):
        mixed, n_a, n_b = _mix(a, b, 0.5, seed)
        assert (n_a, n_b) == (10, 10) and mixed["side"].count("b") == 10
        ids = [i for i, s in zip(mixed["i"], mixed["side"]) if s == "a"]
        assert len(set(ids)) == 10
        kept[ids] += 1
    assert kept.min() > 0 and kept.sum() == 2000
    assert _mix(a, b, 0.5, 3)[0]["i"] == _mix(a, b, 0.5, 3)[0]["i"]  # seeded
