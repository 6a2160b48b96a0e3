"""One safe loader: missing local dirs are named, pickle weights are refused unless opted in, a fake
safetensors file is a CheckpointError; the notices a CPU user cannot act on are dropped."""

from __future__ import annotations

import logging
import shutil

from pathlib import Path

import pytest
import torch

from draftforge import loading
from draftforge.decode import load_drafter, load_target
from draftforge.errors import CheckpointError
from draftforge.loading import load_causal_lm
from draftforge.models.student import load_pretrained
from tests.fixtures.decode import tiny_llama, tiny_mamba2

VOCAB = 32


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A safetensors Llama, the same weights as pytorch_model.bin only, and a pickle named model.safetensors."""
    root = tmp_path_factory.mktemp("models")
    model = tiny_llama(vocab=VOCAB)
    model.save_pretrained(root / "safe")
    _save_pickle(model, root / "pickle")
    shutil.copytree(root / "pickle", root / "fake")
    (root / "fake" / "pytorch_model.bin").rename(root / "fake" / "model.safetensors")
    _save_pickle(tiny_mamba2(vocab=VOCAB), root / "mamba2-pickle")
    return root


def _save_pickle(model, path):
    """config.json + pytorch_model.bin (transformers 5 always writes safetensors, so pickle by hand)."""
    model.config.save_pretrained(path)
    torch.save(model.state_dict(), path / "pytorch_model.bin")


def _has_the_fixtures_weights(model) -> bool:
    """Key by key, the weights `dirs` saved (tiny_llama is seeded: building it again gives them)."""
    want, got = tiny_llama(vocab=VOCAB).state_dict(), model.state_dict()
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_safetensors_dir_loads(dirs):
    model = load_causal_lm(dirs / "safe")
    assert model.config.vocab_size == VOCAB and _has_the_fixtures_weights(model)
    assert not _has_the_fixtures_weights(tiny_llama(vocab=VOCAB, seed=1))  # the check can fail


@pytest.mark.parametrize("load", [
    lambda p: load_causal_lm(p),
    lambda p: load_pretrained(p),  # model.init_from
    lambda p: load_target(p),  # draftforge eval --target
], ids=["load_causal_lm", "init_from", "target"])
def test_pickle_only_dir_is_refused(dirs, load, monkeypatch):
    monkeypatch.delenv(loading.ALLOW_PICKLE_ENV, raising=False)
    with pytest.raises(CheckpointError, match=r"only pickle weights \[.pytorch_model.bin.\], no model.safetensors"):
        load(str(dirs / "pickle"))


def test_pickle_drafter_is_refused_by_eval_loader(dirs, monkeypatch):
    monkeypatch.delenv(loading.ALLOW_PICKLE_ENV, raising=False)
    target = load_target(str(dirs / "safe"))
    with pytest.raises(CheckpointError, match="only pickle weights"):
        load_drafter(str(dirs / "mamba2-pickle"), target)


def test_pickle_loads_only_on_explicit_opt_in(dirs, monkeypatch):
    monkeypatch.delenv(loading.ALLOW_PICKLE_ENV, raising=False)
    assert _has_the_fixtures_weights(load_causal_lm(dirs / "pickle", allow_pickle=True))
    monkeypatch.setenv(loading.ALLOW_PICKLE_ENV, "1")  # the CLI's opt-in (no flag: eval's command is shared)
    assert _has_the_fixtures_weights(load_target(str(dirs / "pickle")).model)
    with pytest.raises(CheckpointError, match="only pickle"):  # an explicit False wins over the environment
        load_causal_lm(dirs / "pickle", allow_pickle=False)


def test_pickle_named_safetensors_is_a_checkpoint_error(dirs, monkeypatch):
    monkeypatch.setenv(loading.ALLOW_PICKLE_ENV, "1")  # even with pickle allowed, a lying file name is an error
    with pytest.raises(CheckpointError, match=r"model.safetensors is not a safetensors file \(a pickle"):
        load_causal_lm(dirs / "fake")
    with pytest.raises(CheckpointError, match="not a safetensors file"):
        load_target(str(dirs / "fake"))


@pytest.mark.parametrize("name", ["/definitely/not/here", "runs/demo/no-such-run/export", "~/no-such-model-dir"])
def test_missing_local_path_says_it_does_not_exist(name):
    with pytest.raises(CheckpointError, match=r"cannot load the target: directory .*does not exist") as err:
        load_target(name)
    assert "Repo id" not in str(err.value)
    with pytest.raises(CheckpointError, match=r"cannot load the model.init_from: directory .*does not exist"):
        load_pretrained(name)


def test_file_or_dir_without_config_is_named(dirs, tmp_path):
    with pytest.raises(CheckpointError, match="is a file"):
        load_causal_lm(dirs / "safe" / "config.json")
    with pytest.raises(CheckpointError, match="holds no config.json"):
        load_causal_lm(tmp_path)


def test_cli_eval_missing_target_and_pickle_drafter_exit_2(dirs, tmp_path, capsys, monkeypatch):
    from draftforge.cli import main

    monkeypatch.delenv(loading.ALLOW_PICKLE_ENV, raising=False)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [1, 2, 3]}\n')
    common = ["--bench", str(prompts), "--max-new-tokens", "2", "--out", str(tmp_path / "out"), "--no-plots"]
    assert main(["eval", "--target", str(tmp_path / "missing"), "--methods", "ar", *common]) == 2
    assert f"error: cannot load the target: directory {tmp_path / 'missing'} does not exist" in capsys.readouterr().err
    assert main(["eval", "--target", str(dirs / "safe"), "--drafter", str(dirs / "mamba2-pickle"), *common]) == 2
    assert "only pickle weights" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_init_from_missing_path_is_one_clear_error(tmp_path, tiny_tokenizer_dir, tiny_corpus_dir):
    from draftforge.recipe import recipe_from_dict
    from draftforge.train import run

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"input_ids": [5, 6, 7, 8], "prompt_len": 2}\n')
    recipe = recipe_from_dict({
        "task": "sft", "output_dir": str(tmp_path / "run"),
        "model": {"init_from": str(tmp_path / "no-such-run"), "tokenizer": str(tiny_tokenizer_dir)},
        "data": {"sources": [str(rows)], "format": "tokens", "eval_fraction": 0.0},
        "train": {"max_steps": 1, "global_batch_size": 1, "micro_batch_size": 1, "block_size": 8,
                  "trackers": []}})
    with pytest.raises(CheckpointError, match=f"model.init_from: directory {tmp_path / 'no-such-run'} does not exist"):
        run(recipe)


def test_cuda_only_kernel_advice_and_deepspeed_cpu_warning_are_dropped():
    loading.quiet_known_notices()
    record = logging.makeLogRecord
    kernels = logging.getLogger("transformers.integrations.hub_kernels")
    assert not kernels.filter(record({"msg": "`mamba_chunk_scan_combined` is falling back to its reference PyTorch "
                                             "implementation because `mamba_ssm` is not installed."}))
    assert kernels.filter(record({"msg": "some other kernel notice"}))
    deepspeed = logging.getLogger("DeepSpeed")
    assert not deepspeed.filter(record({"msg": "Setting accelerator to CPU. If you have GPU or other accelerator, "
                                               "we were unable to detect it."}))
    assert deepspeed.filter(record({"msg": "ZeRO stage 3 enabled"}))


def test_one_line_in_our_words_once_per_process(monkeypatch, capsys):
    from draftforge.models import build_model

    monkeypatch.setattr(loading, "_state", {"quiet": False, "noted": False})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("RANK", raising=False)
    build_model("llama", VOCAB, size="tiny-drafter")
    assert "[draftforge]" not in capsys.readouterr().err  # nothing to say about a Transformer
    for _ in range(2):
        build_model("mamba2", VOCAB, size="tiny")
    err = capsys.readouterr().err
    assert err.count("[draftforge] CPU: Mamba layers run transformers' PyTorch path") == 1, err


def test_a_missing_path_is_named_by_where_it_came_from(tmp_path, monkeypatch):
    from draftforge.errors import RecipeError

    with pytest.raises(RecipeError, match=r"^recipe key 'model.target': directory .*nope does not exist"):
        loading.load_config(str(tmp_path / "nope"), "model.target")
    with pytest.raises(RecipeError, match=r"^--target: directory .*nope does not exist") as e:
        loading.load_config(str(tmp_path / "nope"), "--target")
    assert "recipe key" not in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(RecipeError, match=r"^--target: cannot read a model config") as e:
        loading.load_config(str(tmp_path / "empty"), "--target")
    assert "\n" not in str(e.value) and "Hub id" not in str(e.value)  # one line; a directory, not a Hub id
    # a bare name is tried as a Hub id: said so, in one line, not transformers' paragraph about the network
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError, match=r"^--target: cannot read a model config from 'nope' \(no such local "
                                          r"directory; tried it as a Hugging Face Hub id\): [^\n]*$"):
        loading.load_config("nope", "--target")


def test_org_slash_name_under_a_local_folder_is_a_local_path(tmp_path, monkeypatch):
    # runs/nope beside a runs/ folder went to the Hub as a repository id: a minute of retries where the Hub cannot
    # be reached, then transformers' error; it is a mistyped run directory
    from draftforge.errors import RecipeError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    assert loading.missing_local_path("runs/nope") == Path("runs/nope")
    assert loading.missing_local_path("HuggingFaceTB/SmolLM2-135M") is None  # no such folder here: a Hub id
    assert loading.missing_local_path("gpt2") is None
    with pytest.raises(RecipeError, match=r"^recipe key 'model.target': directory runs/nope does not exist$"):
        loading.load_config("runs/nope", "model.target")
    with pytest.raises(CheckpointError, match=r"cannot load the target: directory runs/nope does not exist"):
        load_target("runs/nope")


def test_models_load_without_hub_kernels(dirs, tmp_path, monkeypatch):
    """transformers 5.25 kernelizes in from_pretrained unless told not to (Hub downloads on CUDA; no load at all
    without the `kernels` package): both of draftforge's loaders must say use_kernels=False themselves."""
    import transformers

    from draftforge.models.gguf import load_gguf
    from tests.models.test_gguf import write_tiny_gguf

    original, seen = transformers.AutoModelForCausalLM.from_pretrained, []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("use_kernels", "not passed"))
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    load_causal_lm(dirs / "safe")
    load_target(dirs / "safe")
    load_gguf(write_tiny_gguf(tmp_path / "tiny.gguf"))
    assert seen == [False, False, False]
