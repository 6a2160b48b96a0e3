"""model.embed_from_target: the drafter's embedding starts as the target's (copy, or PCA to a narrower width)."""

from __future__ import annotations

import pytest
import torch

from draftforge.errors import CompatibilityError, RecipeError
from draftforge.models.draft_vocab import attach_reduced_head
from draftforge.models.target_embed import init_embeddings_from_target, read_target_embedding
from tests.fixtures.decode import tiny_llama, tiny_mamba2

VOCAB = 40


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    tiny_llama(vocab=VOCAB, hidden=48, seed=3).save_pretrained(path)
    return path


def test_same_width_copies_the_target_rows(target_dir):
    drafter = tiny_llama(vocab=VOCAB, hidden=48, seed=9)
    info = init_embeddings_from_target(drafter, str(target_dir))
    assert torch.equal(drafter.get_input_embeddings().weight, read_target_embedding(str(target_dir)))
    assert info["variance_kept"] == 1.0


def test_narrower_drafter_gets_the_top_principal_directions(target_dir):
    emb = read_target_embedding(str(target_dir)).double()
    drafter = tiny_mamba2(vocab=VOCAB)  # width 32, tied head until the reduced head is cut
    width = drafter.get_input_embeddings().weight.shape[1]
    assert width < emb.shape[1]
    info = init_embeddings_from_target(drafter, str(target_dir))
    rows = drafter.get_input_embeddings().weight.double()
    # Oracle: the Gram matrix of the projected rows is the centred Gram matrix's best rank-`width` part,
    # computed here from the covariance's eigenvectors (not the SVD the module uses).
    centred = emb - emb.mean(0)
    _, vecs = torch.linalg.eigh(centred.T @ centred)
    top = vecs[:, -width:]
    torch.testing.assert_close(rows @ rows.T, centred @ top @ top.T @ centred.T, atol=1e-5, rtol=1e-5)
    kept = (centred @ top).pow(2).sum() / centred.pow(2).sum()
    assert info["variance_kept"] == pytest.approx(float(kept), abs=1e-4)
    assert 0 < info["variance_kept"] < 1
    head = attach_reduced_head(drafter, [1, 4, 7, 30]).get_output_embeddings().weight
    assert torch.equal(head, drafter.get_input_embeddings().weight[[1, 4, 7, 30]])  # the head starts alike


def test_bad_shapes_are_refused(target_dir):
    with pytest.raises(CompatibilityError, match="embedding rows"):
        init_embeddings_from_target(tiny_llama(vocab=VOCAB + 1, hidden=48), str(target_dir))
    with pytest.raises(CompatibilityError, match="wider"):
        init_embeddings_from_target(tiny_llama(vocab=VOCAB, hidden=64), str(target_dir))


def test_recipe_rules(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    from draftforge.recipe import recipe_from_dict
    from tests.train.test_loop import tiny_recipe

    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=2)
    values["model"]["embed_from_target"] = True
    values["model"].pop("target", None)
    with pytest.raises(RecipeError, match="model.embed_from_target"):
        recipe_from_dict(values)
    values["model"]["target"] = str(tmp_path)
    values["model"]["init_from"] = str(tmp_path)
    with pytest.raises(RecipeError, match="init_from already has one"):
        recipe_from_dict(values)
