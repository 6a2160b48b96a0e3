"""Export: exact round trip through from_pretrained, atomic writes, refusals, tokenizer fingerprints."""
# Shapes: B batch, T tokens, V vocabulary.

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import draftforge
from draftforge.errors import CheckpointError, CompatibilityError
from draftforge.export import (check_tokenizer_compat, export_model, load_exported, read_export_metadata,
                               tokenizer_fingerprint)
from draftforge.models import build_model
from draftforge.testbed import train_tokenizer

META = {"task": "pretrain", "target": "testbed/tiny-target", "recipe": {"optim": {"lr": 1e-3}},
        "metrics": {"eval_loss": 2.5}}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=300, max_files=4)


def _model(tokenizer, arch="mamba"):
    torch.manual_seed(0)
    size = "tiny-drafter" if arch == "llama" else "tiny"
    return build_model(arch, len(tokenizer), size=size, overrides={"num_hidden_layers": 1},
                       eos_token_id=tokenizer.eos_token_id).eval()


def _logits(model, ids_BT):
    with torch.no_grad():
        return model(ids_BT).logits


@pytest.mark.parametrize("arch", ["mamba", "mamba2", "llama"])
def test_round_trip_logits_equal(tokenizer, tmp_path, arch):
    model = _model(tokenizer, arch)
    out = export_model(model, tokenizer, tmp_path / "export", metadata=META)
    ids_BT = tokenizer(["class A:\n    def f(self):\n        return 1"], return_tensors="pt").input_ids
    plain = AutoModelForCausalLM.from_pretrained(out, use_safetensors=True).eval()
    torch.testing.assert_close(_logits(plain, ids_BT), _logits(model, ids_BT), rtol=0, atol=0)
    loaded, loaded_tok, meta = load_exported(out, expected_task="pretrain")
    torch.testing.assert_close(_logits(loaded, ids_BT), _logits(model, ids_BT), rtol=0, atol=0)
    assert loaded_tok.get_vocab() == tokenizer.get_vocab()
    assert loaded_tok.chat_template == tokenizer.chat_template
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "draftforge.json", "model.safetensors", "tokenizer.json"} <= names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl"))]
    assert meta["format_version"] == 1 and meta["draftforge_version"] == draftforge.__version__
    assert {k: meta[k] for k in ("task", "target", "recipe", "metrics")} == META
    assert meta["tokenizer_fingerprint"] == tokenizer_fingerprint(tokenizer) and meta["created"].endswith("Z")


def test_lora_adapters_are_merged_and_caller_model_untouched(tokenizer, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    peft_model = get_peft_model(_model(tokenizer, "llama"), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # lora_B starts at zero; make the adapter change the output
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    peft_model.eval()
    ids_BT = torch.randint(0, len(tokenizer), (2, 9))
    expected = _logits(peft_model, ids_BT)
    out = export_model(peft_model, tokenizer, tmp_path / "lora", metadata={**META, "task": "sft"})
    loaded, _, _ = load_exported(out, expected_task="sft")
    torch.testing.assert_close(_logits(loaded, ids_BT), expected, rtol=1e-5, atol=1e-5)
    assert isinstance(peft_model, PeftModel) and any("lora_A" in n for n, _ in peft_model.named_parameters())
    with peft_model.disable_adapter():  # still a live adapter: disabling it changes the output
        assert not torch.allclose(_logits(peft_model, ids_BT), expected)


def _files(root):
    """Every file of an export (custom_generate/ included) -> its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_failure_mid_export_leaves_nothing_and_keeps_earlier_export(tokenizer, tmp_path, monkeypatch):
    model = _model(tokenizer)
    out = export_model(model, tokenizer, tmp_path / "export", metadata=META)
    before = _files(out)

    def crash(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(type(tokenizer), "save_pretrained", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        export_model(model, tokenizer, tmp_path / "fresh", metadata=META)
    with pytest.raises(RuntimeError, match="disk full"):
        export_model(model, tokenizer, out, metadata={**META, "task": "sft"}, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # no temp dirs, no half "fresh"
    assert _files(out) == before


def test_a_re_export_of_the_same_run_spelled_another_way_replaces_it(tokenizer, tmp_path, monkeypatch):
    """`export runs/x` after training wrote runs/x/export (its recipe's output_dir as the recipe spelled it) was
    refused as a different export, the message printing both whole recipes; a real difference is named by key."""
    monkeypatch.chdir(tmp_path)
    model = _model(tokenizer)
    recipe = {"optim": {"lr": 1e-3}, "output_dir": "runs/x"}
    out = export_model(model, tokenizer, tmp_path / "export", metadata={**META, "recipe": recipe})
    for spelled in ("./runs/x/", str(tmp_path / "runs" / "x")):
        export_model(model, tokenizer, out, metadata={**META, "recipe": {**recipe, "output_dir": spelled}})
    other = {"optim": {"lr": 2e-3}, "output_dir": "runs/y"}
    with pytest.raises(CheckpointError, match=r"its recipe differs in optim.lr, output_dir\); choose"):
        export_model(model, tokenizer, out, metadata={**META, "recipe": other})


def test_overwrite_protection(tokenizer, tmp_path):
    model = _model(tokenizer)
    out = export_model(model, tokenizer, tmp_path / "export", metadata=META)
    export_model(model, tokenizer, out, metadata={**META, "metrics": {"eval_loss": 2.0}})  # same run: replaced
    assert read_export_metadata(out)["metrics"] == {"eval_loss": 2.0}
    # the message names what differs, both sides (it named the old export's task and target, which may match)
    with pytest.raises(CheckpointError, match=r"different export \(its task 'pretrain', this one's 'sft'\); .*"
                                              "--overwrite"):
        export_model(model, tokenizer, out, metadata={**META, "task": "sft"})
    export_model(model, tokenizer, out, metadata={**META, "task": "sft"}, overwrite=True)
    assert read_export_metadata(out)["task"] == "sft"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # the old one was cleaned up
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(CheckpointError, match="not a readable draftforge export"):
            export_model(model, tokenizer, other, metadata=META, overwrite=overwrite)
    assert [p.name for p in other.iterdir()] == ["todo.txt"]
    with pytest.raises(CheckpointError, match="task"):
        export_model(model, tokenizer, tmp_path / "x", metadata={"target": "t"})
    # files a user put into an export (a README, an eval report) survive a re-export of the same run: refused
    (out / "README.md").write_text("my notes")
    (out / "eval").mkdir()
    (out / "eval" / "report.json").write_text("{}")
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    for overwrite in (False, True):
        with pytest.raises(CheckpointError, match=r"holds files the new copy would not hold \(README.md, "
                                                  r"eval/report.json\)"):
            export_model(model, tokenizer, out, metadata={**META, "task": "sft"}, overwrite=overwrite)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before
    assert (out / "README.md").read_text() == "my notes" and read_export_metadata(out)["task"] == "sft"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "notes"]  # no temp dir left beside it
    # a link to a folder, and an empty folder, were not counted as files: a re-export removed them silently
    for name in ("README.md", "eval/report.json", "eval"):
        (out / name).unlink() if (out / name).is_file() else (out / name).rmdir()
    (out / "my_data").symlink_to(other, target_is_directory=True)
    (out / "plots").mkdir()
    with pytest.raises(CheckpointError, match=r"holds files the new copy would not hold \(my_data, plots/\)"):
        export_model(model, tokenizer, out, metadata={**META, "task": "sft"})
    assert (out / "my_data").is_symlink() and (out / "plots").is_dir()


def test_refusals_on_load(tokenizer, tmp_path):
    out = export_model(_model(tokenizer), tokenizer, tmp_path / "export", metadata=META)
    with pytest.raises(CheckpointError, match="'pretrain' export, but a 'eesd'"):
        load_exported(out, expected_task="eesd")
    (out / "optimizer.pt").write_bytes(b"\x80\x04not really")
    with pytest.raises(CheckpointError, match=r"pickle files \['optimizer.pt'\]"):
        load_exported(out)
    (out / "optimizer.pt").unlink()
    meta_text = (out / "draftforge.json").read_text()
    (out / "draftforge.json").write_text(meta_text[: len(meta_text) // 2])  # truncated
    with pytest.raises(CheckpointError, match="corrupt"):
        load_exported(out)
    (out / "draftforge.json").unlink()
    with pytest.raises(CheckpointError, match="not a draftforge export"):
        read_export_metadata(out)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_exported(tmp_path / "missing")


def test_tampered_tokenizer_detected(tokenizer, tmp_path):
    out = export_model(_model(tokenizer), tokenizer, tmp_path / "export", metadata=META)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|pad|>"
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="fingerprint"):
        load_exported(out)
    # a vocabulary edit that keeps every size and special token: two ids swapped in tokenizer.json
    again = export_model(_model(tokenizer), tokenizer, tmp_path / "export2", metadata=META)
    _swap_two_ids(tokenizer, tmp_path / "swapped")
    (again / "tokenizer.json").write_text((tmp_path / "swapped" / "tokenizer.json").read_text())
    with pytest.raises(CheckpointError, match="fingerprint"):
        load_exported(again)


def test_fingerprint_stable_and_sensitive(tokenizer, tmp_path):
    fingerprint = tokenizer_fingerprint(tokenizer)
    assert len(fingerprint) == 64 and fingerprint == tokenizer_fingerprint(tokenizer)
    tokenizer.save_pretrained(tmp_path / "copy")
    from transformers import AutoTokenizer

    reloaded = AutoTokenizer.from_pretrained(tmp_path / "copy")
    assert tokenizer_fingerprint(reloaded) == fingerprint
    check_tokenizer_compat(reloaded, tokenizer)
    reloaded.add_tokens(["<|extra|>"])
    assert tokenizer_fingerprint(reloaded) != fingerprint
    with pytest.raises(CompatibilityError, match=r"\(301 tokens\).*\(300 tokens\)"):
        check_tokenizer_compat(reloaded, tokenizer)
    other = train_tokenizer(tmp_path / "other", vocab_size=280, max_files=4)
    with pytest.raises(CompatibilityError, match="other"):
        check_tokenizer_compat(other, tokenizer)
    # the same size and special tokens, two ids swapped: every id after them means another token to the drafter
    swapped = AutoTokenizer.from_pretrained(_swap_two_ids(tokenizer, tmp_path / "swapped"))
    assert len(swapped) == len(tokenizer) and swapped.eos_token == tokenizer.eos_token
    assert swapped.get_vocab() != tokenizer.get_vocab()
    assert tokenizer_fingerprint(swapped) != fingerprint
    with pytest.raises(CompatibilityError, match=r"\(300 tokens\).*\(300 tokens\)"):
        check_tokenizer_compat(swapped, tokenizer)


def _swap_two_ids(tokenizer, out_dir):
    """A saved copy of `tokenizer` whose vocabulary maps two ordinary tokens to each other's ids."""
    tokenizer.save_pretrained(out_dir)
    spec = json.loads((out_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    special = {t["content"] for t in spec.get("added_tokens", [])}
    a, b = [tok for tok, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if tok not in special][-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (out_dir / "tokenizer.json").write_text(json.dumps(spec))
    return out_dir


@pytest.mark.parametrize("tied", [True, False])
def test_state_without_lm_head_loads_only_when_the_head_is_tied(tied):
    """`draftforge export` and the gathered FSDP/ZeRO-3 export share this check: a missing lm_head is
    fine when it is tied to the embedding (saved once), an error otherwise (it would stay random)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftforge.train.distributed import load_fitting_state

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    state = {k: v for k, v in LlamaForCausalLM(config).state_dict().items() if not k.endswith("lm_head.weight")}
    fresh = LlamaForCausalLM(config)
    if tied:
        load_fitting_state(fresh, state, "state")
        assert torch.equal(fresh.lm_head.weight, state["model.embed_tokens.weight"])
    else:
        with pytest.raises(CheckpointError, match="missing \\['lm_head.weight'\\]"):
            load_fitting_state(fresh, state, "state")


@pytest.mark.parametrize("state", ["no checkpoint", "corrupted", "finished, no checkpoint"])
def test_export_of_a_run_without_a_usable_checkpoint_gives_export_advice(tmp_path, capsys, state):
    """`draftforge export` must not print train's `--resume` advice; it exits 2 and writes nothing."""
    import yaml

    from draftforge.cli import main

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    recipe = {"task": "pretrain", "output_dir": str(run_dir), "model": {"tokenizer": str(tmp_path / "tok")},
              "data": {"sources": [str(tmp_path / "corpus.txt")]}}
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    if state == "corrupted":
        (run_dir / "checkpoints" / "step-00000002").mkdir(parents=True)  # no manifest: fails verification
    if state.startswith("finished"):
        (run_dir / "export").mkdir()
        (run_dir / "export" / "config.json").write_text("{}")
    assert main(["export", str(run_dir), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--resume" not in err and err.count("\n") == 1
    expected = {"no checkpoint": "has no checkpoint to export yet", "corrupted": "is corrupted, so there is nothing",
                "finished, no checkpoint": f"own export is in {run_dir / 'export'}"}[state]
    assert expected in err
    assert not (tmp_path / "out").exists()
