"""C2T: the tree rule on a hand-built example, lossless decoding with every drafter, bad input.

The classifier here is hand-set (C = sigmoid(40·P - 2), i.e. C >= 0.5 exactly when P >= 0.05) or a
stand-in whose confidence is a feature itself, so the expected trees can be worked out by hand.
"""

from __future__ import annotations

import json

import pytest
import torch

from draftforge.decode import build_decoder
from draftforge.decode.methods.c2t import C2TBuilder
from draftforge.errors import CheckpointError, CompatibilityError, RecipeError
from draftforge.models.c2t import C2TClassifier, load_head, save_head
from tests.fixtures.decode import greedy_runs

VOCAB = 12
PROMPTS = [[4], [3, 5, 7], [(7 * i + 3) % VOCAB for i in range(23)]]


class ConfidenceIs:
    """A stand-in classifier: C is one of its features (and it remembers what it was shown)."""

    def __init__(self, feature="P"):
        self.features, self.column, self.seen = ("P", "H", "d"), ("P", "H", "d").index(feature), []

    def confidence(self, x_BF):
        self.seen.append(x_BF.clone())
        return x_BF[..., self.column]


def test_c2t_rule_on_a_hand_built_layer():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.45, 0.35, 0.12, 0.08]], dtype=torch.float32)
    logits_BV, joint_B = probs.log(), torch.tensor([0.8, 0.5], dtype=torch.float64)
    # P of the top-3 children: row 0: .4 .24 .12; row 1: .225 .175 .06
    clf = ConfidenceIs("P")
    builder = C2TBuilder(clf, beta=0.2, top_k=3, second_top_k=0)
    assert builder.expand(3, logits_BV, joint_B) == [[0, 1], [0]]
    x = clf.seen[-1]
    entropy = -(probs * probs.log()).sum(-1)
    torch.testing.assert_close(x[..., 1], entropy[:, None].expand(2, 3))  # H: the parent's entropy, siblings share it
    assert (x[..., 2] == 2).all()  # d: depth 3 is the third draft layer, d = 2 (first layer d = 0)
    # β edge: a node whose C equals β exactly is kept; just above it, dropped
    c_edge = float(x[0, 2, 0])  # C of row 0's third child, as the builder computed it
    assert c_edge == pytest.approx(0.8 * 0.15, rel=1e-6)  # the parent's joint x the child's probability
    assert C2TBuilder(clf, beta=c_edge, top_k=3, second_top_k=0).expand(3, logits_BV, joint_B)[0] == [0, 1, 2]
    above = float(torch.nextafter(torch.tensor(c_edge), torch.tensor(1.0)))
    assert C2TBuilder(clf, beta=above, top_k=3, second_top_k=0).expand(3, logits_BV, joint_B)[0] == [0, 1]
    # second top-K: the best 3 survivors of the whole layer by C (ties keep the earlier row)
    assert C2TBuilder(clf, beta=0.1, top_k=3, second_top_k=3).expand(3, logits_BV, joint_B) == [[0, 1], [0]]
    # a real tie: two frontier rows with the same distribution and joint, so each child's C equals its cousin's;
    # the top 3 by C are row 0's first, row 1's first, then row 0's second (the earlier row wins the tie)
    same_BV = probs[:1].expand(2, 4)
    tied = torch.tensor([0.5, 0.5], dtype=torch.float64)
    assert C2TBuilder(clf, beta=0.01, top_k=3, second_top_k=3).expand(3, same_BV.log(), tied) == [[0, 1], [0]]
    # chain mode: K = 1, one child per node
    assert C2TBuilder(clf, beta=0.3, top_k=1).expand(1, logits_BV, joint_B) == [[0], []]


def test_entropy_is_over_the_top_m_without_renormalising():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    clf = ConfidenceIs("H")
    C2TBuilder(clf, beta=0.5, top_k=1, top_m=2).expand(1, probs.log(), torch.tensor([1.0]))
    expected = -(0.4 * torch.log(torch.tensor(0.4)) + 0.3 * torch.log(torch.tensor(0.3)))
    torch.testing.assert_close(clf.seen[-1][0, 0, 1], expected)


def hand_set_head(path, features=("P", "H", "d")):
    """C = sigmoid(40·P - 2): C >= 0.5 exactly when P >= 0.05."""
    model = C2TClassifier(features, hidden=1)
    with torch.no_grad():
        model.net[0].weight.zero_()
        model.net[0].weight[0, features.index("P")] = 1.0
        model.net[0].bias.zero_()
        model.net[2].weight.fill_(40.0)
        model.net[2].bias.fill_(-2.0)
    return save_head(model, path)


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    return hand_set_head(tmp_path_factory.mktemp("c2t") / "head")


@pytest.mark.parametrize("kind", ["transformer", "mamba", "mamba2", "eagle3", "feature_mamba2"])
@pytest.mark.parametrize("k", [4, 1], ids=["tree", "chain"])
def test_c2t_is_lossless_with_every_drafter(target, drafters, head, kind, k):
    dec = build_decoder("c2t", target, drafters[kind], c2t=str(head), beta=0.5, c2t_top_k=k, c2t_depth=4)
    sizes = []
    for _, res in greedy_runs(dec, target, PROMPTS, (1, 2, 15)):
        sizes += res.stats.drafted_per_round
    assert len(set(sizes)) > 1 and max(sizes) <= (4 if k == 1 else 4 * 4)  # the classifier shapes the trees


def test_c2t_bad_input(target, drafters, head, tmp_path):
    mamba = drafters["mamba"]
    for beta in (0.0, 1.0, -0.2, 1.5):
        with pytest.raises(RecipeError, match=r"--beta must be in \(0, 1\)"):
            build_decoder("c2t", target, mamba, c2t=str(head), beta=beta)
    with pytest.raises(RecipeError, match="--c2t PATH"):
        build_decoder("c2t", target, mamba)
    with pytest.raises(RecipeError, match="larger than the drafter's vocabulary"):
        build_decoder("c2t", target, mamba, c2t=str(head), c2t_top_k=VOCAB + 1)
    with pytest.raises(CheckpointError, match="not an exported C2T classifier"):
        build_decoder("c2t", target, mamba, c2t=str(tmp_path))
    for change, match in [({"depth_origin": 1}, "counts depth from 1"),
                          ({"features": ["logP", "H", "d"]}, "uses features"),
                          ({"feature_defs": {"P": "log joint", "H": "x", "d": "y"}}, "differently")]:
        bad = hand_set_head(tmp_path / "bad")
        meta = json.loads((bad / "draftforge.json").read_text())
        (bad / "draftforge.json").write_text(json.dumps({**meta, **change}))
        with pytest.raises(CompatibilityError, match=match):
            build_decoder("c2t", target, mamba, c2t=str(bad))
    for name, cut in (("c2t.safetensors", 16), ("draftforge.json", 8)):  # each a traceback before
        bad = hand_set_head(tmp_path / f"cut-{name}")
        (bad / name).write_bytes((bad / name).read_bytes()[:-cut])
        with pytest.raises(CheckpointError, match=rf"{name} (cannot be read|is corrupt) \(.*\); re-export the c2t run"):
            build_decoder("c2t", target, mamba, c2t=str(bad))


def test_head_round_trips(tmp_path):
    model = C2TClassifier(("P", "d"), hidden=6)
    save_head(model, tmp_path / "h")
    loaded, meta = load_head(tmp_path / "h")
    assert meta["features"] == ["P", "d"] and meta["depth_origin"] == 0 and loaded.features == ("P", "d")
    x = torch.rand(5, 2)
    torch.testing.assert_close(loaded.confidence(x), model.confidence(x))
    # the export says which layout it is, so a later draftforge can change it; a newer one is refused here
    assert meta["format_version"] == 1
    meta_file = tmp_path / "h" / "draftforge.json"
    meta_file.write_text(json.dumps({**meta, "format_version": 2}))
    with pytest.raises(CheckpointError, match=r"draftforge.json has format_version 2, newer than this draftforge "
                                              r"\(1\)"):
        load_head(tmp_path / "h")
    del meta["format_version"]  # a head exported before the field existed reads as version 1
    meta_file.write_text(json.dumps(meta))
    assert load_head(tmp_path / "h")[1]["features"] == ["P", "d"]
    for damaged in ("{not json", "[1, 2]"):  # a traceback (JSONDecodeError, AttributeError) before
        meta_file.write_text(damaged)
        with pytest.raises(CheckpointError, match="holds files that are not a C2T classifier"):
            save_head(model, tmp_path / "h")
        assert meta_file.read_text() == damaged


def test_eval_flags_reach_the_methods():
    import argparse

    from draftforge.eval.command import config_from_args, configure
    from draftforge.eval.runner import validate

    parser = configure(argparse.ArgumentParser())
    args = parser.parse_args(["--target", "t", "--drafter", "d", "--bench", "b", "--methods", "eagle2,c2t",
                              "--c2t", "head", "--beta", "0.35", "--total-tokens", "40", "--eagle-top-k", "8"])
    cfg = config_from_args(args)
    assert cfg.methods == ("eagle2", "c2t")
    assert cfg.method_options["c2t"]["beta"] == 0.35 and cfg.method_options["c2t"]["c2t"] == "head"
    assert cfg.method_options["eagle2"]["total_tokens"] == 40 and cfg.method_options["eagle2"]["eagle_top_k"] == 8
    bad = config_from_args(parser.parse_args(["--target", "t", "--drafter", "d", "--bench", "b",
                                              "--methods", "c2t", "--beta", "1.5"]))
    with pytest.raises(RecipeError, match="--beta"):
        validate(bad)  # refused before any model is loaded
