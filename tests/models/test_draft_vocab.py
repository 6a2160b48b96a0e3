"""Reduced draft vocabulary (EAGLE-3's d2t): counting, training, export/load, lossless decoding, exact q."""

from __future__ import annotations

import contextlib
import json
import logging

import pytest
import torch

from draftforge.decode import build_decoder, load_drafter, load_target
from draftforge.decode.drafters.base import propose_children
from draftforge.decode.sampling import SamplingParams
from draftforge.errors import CompatibilityError, RecipeError
from draftforge.models.draft_vocab import (
    attach_reduced_head,
    frequent_tokens,
    to_target_logits,
)
from tests.decode.test_sampling import assert_two_tokens_follow_target
from tests.fixtures.decode import greedy_reference, tiny_llama, tiny_mamba, tiny_mamba2

VOCAB = 12
KEEP = [0, 2, 3, 5, 7, 8, 11]


def test_frequent_tokens_by_hand():
    rows = [[1, 1, 1, 4, 4, -100, 2], [4, 9, 9, 9, 9]]  # counts: 9:4, 4:3, 1:3, 2:1
    assert frequent_tokens(rows, 10, 3) == [1, 4, 9]  # ties (1 and 4 at 3) go to the lower id
    assert frequent_tokens(rows, 10, 3, always=(0,)) == [0, 1, 9]  # 0 forced in; 9, then 1 (tie with 4)
    with pytest.raises(RecipeError, match="model.draft_vocab"):
        frequent_tokens(rows, 10, 11)


def test_scattered_logits_and_q_are_zero_outside_the_draft_vocabulary():
    d2t = torch.tensor(KEEP)
    logits = torch.randn(2, len(KEEP), dtype=torch.float64)
    full = to_target_logits(logits, d2t, VOCAB)
    assert torch.equal(full[:, d2t], logits) and torch.isinf(full[:, [1, 4, 6, 9, 10]]).all()
    gen = torch.Generator().manual_seed(0)
    kids, q = propose_children(logits, 3, SamplingParams(temperature=1.0), VOCAB, gen, d2t)
    assert set(kids.flatten().tolist()) <= set(KEEP)
    torch.testing.assert_close(q.sum(-1), torch.ones(2, dtype=torch.float64))
    assert (q[:, [1, 4, 6, 9, 10]] == 0).all()
    greedy, _ = propose_children(logits, 2, SamplingParams(), VOCAB, gen, d2t)
    assert greedy.tolist() == d2t[logits.topk(2).indices].tolist()


@contextlib.contextmanager
def recorded_warnings(logger_name: str):
    """Messages of `logger_name` at WARNING and above, as its own handlers would get them."""
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    log, keep = logging.getLogger(logger_name), Keep(logging.WARNING)
    log.addHandler(keep)
    try:
        yield seen
    finally:
        log.removeHandler(keep)


@pytest.fixture(scope="module")
def target():
    return load_target(tiny_llama(vocab=VOCAB, dtype=torch.float64))


reference = greedy_reference


@pytest.mark.parametrize("make", [tiny_mamba, tiny_mamba2, lambda **k: tiny_llama(seed=5, **k)],
                         ids=["mamba", "mamba2", "llama"])
def test_reduced_drafter_saved_loaded_and_lossless(target, make, tmp_path):
    model = attach_reduced_head(make(vocab=VOCAB, dtype=torch.float64), KEEP)
    assert model.get_output_embeddings().weight.shape[0] == len(KEEP)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab"] == KEEP
    with recorded_warnings("transformers.modeling_utils") as seen:
        drafter = load_drafter(tmp_path, target, dtype=torch.float64)
    assert not [m for m in seen if "MISMATCH" in m]  # the expected head-size report is muted, not alarming users
    assert drafter.d2t.tolist() == KEEP
    assert torch.equal(drafter.model.get_output_embeddings().weight, model.get_output_embeddings().weight)
    for method, opts in [("chain", {"chain_length": 3}), ("tree", {"tree": (3, 2, 1)})]:
        dec = build_decoder(method, target, drafter, **opts)
        for prompt in ([4], [3, 5, 7, 1, 2]):
            assert dec.generate(prompt, max_new_tokens=13).tokens == reference(target, prompt, 13)


def test_map_outside_the_target_vocabulary_is_refused(target):
    model = attach_reduced_head(tiny_mamba(vocab=VOCAB), [0, 3, 5])
    model.config.draft_vocab = [0, 3, VOCAB + 2]  # a map made for a larger target
    with pytest.raises(CompatibilityError, match="outside the target's vocabulary"):
        load_drafter(model, target)


def test_pretrain_with_a_draft_vocabulary(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    from draftforge.cli import main as cli_main
    from draftforge.recipe import recipe_from_dict
    from draftforge.train import run
    from tests.train.test_loop import tiny_recipe

    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=8, export=True)
    values["model"]["draft_vocab"] = 64
    values["optim"]["lr"] = 1e-2
    result = run(recipe_from_dict(values))
    assert result.losses[-1] < result.losses[0]
    config = json.loads((result.export_dir / "config.json").read_text())
    assert len(config["draft_vocab"]) == 64 and config["tie_word_embeddings"] is False
    saved = json.loads((result.run_dir / "draft_vocab.json").read_text())
    assert saved == config["draft_vocab"]
    again = tmp_path / "again"  # `draftforge export` rebuilds the reduced head from the run's map
    assert cli_main(["export", str(result.run_dir), "--out", str(again)]) == 0
    from safetensors.torch import load_file

    a, b = load_file(str(result.export_dir / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_reduced_tree_sampling_follows_the_target():
    from tests.decode.test_sampling import VOCAB as V8

    target = load_target(tiny_llama(vocab=V8, hidden=16, layers=1, dtype=torch.float64))
    drafter = load_drafter(attach_reduced_head(tiny_mamba(V8, dtype=torch.float64), [0, 1, 3, 4, 6]), target)
    assert_two_tokens_follow_target(build_decoder("tree", target, drafter, tree=(3, 2)), target, [1, 2, 3])


def test_draft_vocabulary_counted_on_other_token_rows(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    """model.draft_vocab_from: the head's ids are the most frequent loss ids of those rows, not the corpus's."""
    from draftforge.errors import DataError
    from draftforge.recipe import recipe_from_dict
    from draftforge.train.lm import build_model, load_tokenizer
    from tests.train.test_loop import tiny_recipe

    rows = tmp_path / "answers.jsonl"
    rows.write_text('{"input_ids": [5, 6, 7, 9, 9, 9], "prompt_len": 2}\n{"input_ids": [40, 41, 9, 41], "prompt_len": 1}\n')
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir)
    values["model"].update(draft_vocab=3, draft_vocab_from=str(rows))
    recipe = recipe_from_dict(values)
    tokenizer = load_tokenizer(recipe)
    model = build_model(recipe, tokenizer, data=object())  # the data is not read when draft_vocab_from is set
    eos = tokenizer.eos_token_id  # always kept; then 9 (x4) and 41 (x2); prompt ids 5, 6, 40 carry no loss
    assert json.loads(json.dumps(model.config.draft_vocab)) == sorted({eos, 9, 41})
    values["model"]["draft_vocab_from"] = str(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="does not exist"):
        build_model(recipe_from_dict(values), tokenizer, data=object())
    values["model"].pop("draft_vocab")
    with pytest.raises(RecipeError, match="model.draft_vocab_from"):
        recipe_from_dict(values)
