"""`draftforge harvest theta` with an EESD early-exit drafter: the rows are what real decode rounds see and
accept (full and reduced draft vocabulary), a θ predictor trained on them keeps cali_ts lossless, and a
predictor is refused for another kind of drafter or another exit layer N.

Oracle: from each anchor of the target's greedy continuation, one real round of the early-exit drafter on its
paired target: the hidden_D its stop rule gets after draft i, and how many drafts the target's verify accepts.
"""

from __future__ import annotations

import json

import pytest
import torch

from draftforge.cli import main as cli_main
from draftforge.harvest.cali_ts import harvest_theta, load_harvest
from draftforge.decode import StoppableChain, StopRule, build_decoder, load_drafter, load_target
from draftforge.decode.sampling import SamplingParams
from draftforge.errors import CompatibilityError
from draftforge.models.eesd import ExitHead, split_target
from draftforge.models.eesd_export import save_exit_head, target_identity
from draftforge.models.cali_ts import ThetaPredictor
from draftforge.train.cali_ts import export_predictor, pair_metadata
from tests.fixtures.decode import greedy_reference, noisy_copy, tiny_llama

VOCAB, LAYERS, K, STRIDE, NEW = 16, 4, 4, 3, 24
PROMPTS = [[4, 9, 1], [3, 5, 7, 2], [(7 * i + 3) % VOCAB for i in range(6)]]
KEEP = [0, 1, 2, 4, 5, 7, 8, 10, 11, 13, 15]  # a reduced draft vocabulary: 11 of the 16 target ids


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny Llama target, EESD exports at N = 2 (full and reduced head) and N = 3, a plain drafter, prompt rows.
    At N = 2 the untrained exit heads accept anything from 0 to all K+1 drafts, so both labels get checked."""
    root = tmp_path_factory.mktemp("eesd-theta")
    model = tiny_llama(vocab=VOCAB, layers=LAYERS, dtype=torch.float64)
    model.save_pretrained(root / "target")
    noisy_copy(model, noise=0.02).save_pretrained(root / "plain")
    parts = split_target(load_target(str(root / "target")).model)
    for name, n, keep in (("eesd", 2, None), ("eesd-reduced", 2, KEEP), ("eesd-n3", 3, None)):
        save_exit_head(ExitHead.from_target(parts, n, draft_vocab=keep), target_identity(parts, n), None, root / name,
                       {"task": "eesd", "target": str(root / "target")})
    (root / "rows.jsonl").write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    return root


def harvest(files, drafter, out, **kw):
    return harvest_theta(files / "target", files / drafter, [str(files / "rows.jsonl")], out, max_offset=K,
                         anchor_stride=STRIDE, generate=NEW, shard_size=2, progress=False, **{"dtype": "float32", **kw})


class Recorder(StopRule):
    """Never stops; keeps the hidden_D of every drafted depth."""

    wants_hidden = True

    def start_round(self):
        self.hidden = {}

    def should_stop(self, step):
        self.hidden[step.depth] = step.hidden_D.clone()
        return False


def decode_round(target, drafter, seq):
    """One real greedy round from committed `seq`: (drafts accepted by verify, hidden_D per depth 1..K)."""
    paired = drafter.paired_target(target)
    paired.prefill(seq)
    drafter.reset()
    rule = Recorder()
    tree = drafter.draft(seq, StoppableChain(K + 1, rule), SamplingParams(), torch.Generator().manual_seed(0))
    target_tok = paired.verify(seq[-1], tree).argmax(-1).tolist()
    accepted = 0
    while accepted < len(tree.tokens) and tree.tokens[accepted] == target_tok[accepted]:
        accepted += 1
    return accepted, rule.hidden


@pytest.mark.parametrize("drafter_dir", ["eesd", "eesd-reduced"])
def test_eesd_rows_are_what_a_real_round_sees_and_accepts(files, tmp_path, drafter_dir):
    manifest = harvest(files, drafter_dir, tmp_path / "h")
    assert manifest["drafter_kind"] == "early_exit" and manifest["exit_after_layer"] == 2
    rows, _ = load_harvest(tmp_path / "h")
    target = load_target(str(files / "target"))
    drafter = load_drafter(str(files / drafter_dir), target)
    assert (drafter.d2t is not None) == (drafter_dir == "eesd-reduced")
    r, checked, labels_seen, longest = 0, 0, set(), 0
    for prompt in PROMPTS:
        ids = prompt + greedy_reference(target, prompt, NEW)
        with torch.no_grad():
            h_target = target.model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        for c in range(len(prompt), len(ids), STRIDE):
            accepted, hidden = decode_round(target, drafter, ids[: c + 1])
            longest = max(longest, accepted)
            for i in range(1, K + 1):
                if c + i >= len(ids):  # the early-exit drafter's row for offset i sits at c+i
                    break
                row = rows[r]
                r += 1
                assert row["offset"] == i
                torch.testing.assert_close(torch.tensor(row["h_target"]), h_target[c - 1].float())
                if i <= accepted:  # drafts 1..i accepted: teacher forcing is this round's exact path
                    torch.testing.assert_close(torch.tensor(row["h_draft"]), hidden[i].float(), rtol=1e-5, atol=1e-5)
                    assert row["label"] == int(accepted >= i + 1), (c, i, accepted)  # χ: is draft i+1 accepted?
                    checked += 1
                    labels_seen.add(row["label"])
    assert r == len(rows) == manifest["rows"]
    assert longest >= 2 and labels_seen == {0, 1} and checked >= 10  # the oracle really tested both outcomes


def test_cli_harvests_an_eesd_export(files, tmp_path, capsys):
    assert cli_main(["harvest", "theta", "--target", str(files / "target"), "--drafter", str(files / "eesd"),
                     "--data", str(files / "rows.jsonl"), "--generate", "8", "--max-offset", "3",
                     "--out", str(tmp_path / "h")]) == 0
    assert "harvested" in capsys.readouterr().out
    assert json.loads((tmp_path / "h" / "harvest.json").read_text())["drafter_kind"] == "early_exit"


def test_a_theta_predictor_for_eesd_trains_and_cali_ts_stays_lossless(files, tmp_path):
    from draftforge.recipe import recipe_from_dict
    from draftforge.train import run
    from tests.train.test_theta import theta_recipe

    harvest(files, "eesd", tmp_path / "h")
    recipe = theta_recipe(tmp_path / "run", files / "target", tmp_path / "h", max_offset=K, eval_fraction=0.0,
                          steps=20, batch=32)
    result = run(recipe_from_dict(recipe))
    meta = json.loads((result.export_dir / "draftforge.json").read_text())
    assert meta["drafter_kind"] == "early_exit" and meta["exit_after_layer"] == 2
    target = load_target(str(files / "target"))
    drafter = load_drafter(str(files / "eesd"), target)
    dec = build_decoder("cali_ts", target, drafter, theta_predictor=str(result.export_dir), max_draft=6)
    predictor, calls = dec.controller.predictor, []
    theta_from_terms = predictor.theta_from_terms
    predictor.theta_from_terms = lambda *a: calls.append(a) or theta_from_terms(*a)
    for prompt in PROMPTS:
        for max_new in (1, 9, 20):
            assert dec.generate(prompt, max_new_tokens=max_new).tokens == greedy_reference(target, prompt, max_new)
    assert calls and all(h.shape == (32,) for _, h, _ in calls)  # θ_M really came from the exit states


def test_theta_predictors_are_refused_across_drafter_kinds_and_exit_layers(files, tmp_path):
    target = load_target(str(files / "target"))
    exports = {}
    for name in ("eesd", "plain"):
        manifest = harvest(files, name, tmp_path / f"h-{name}")
        pred = ThetaPredictor(manifest["target_dim"], manifest["draft_dim"], K, manifest["mean_label"])
        exports[name] = str(export_predictor(pred, tmp_path / f"theta-{name}", pair_metadata(manifest)))
    eesd, plain, eesd_n3 = (load_drafter(str(files / d), target) for d in ("eesd", "plain", "eesd-n3"))
    assert eesd.model.config.hidden_size == plain.model.config.hidden_size  # only the kind tells them apart
    for drafter, export in ((eesd, exports["eesd"]), (plain, exports["plain"])):
        build_decoder("cali_ts", target, drafter, theta_predictor=export)  # its own pair loads
    eesd_export = r"harvested for an early-exit \(EESD export, exit after layer 2\) drafter"
    cases = ((plain, exports["eesd"], eesd_export + ", this is a transformer drafter"),
             (eesd, exports["plain"], "harvested for a transformer drafter, this is an early-exit"),
             (eesd_n3, exports["eesd"], eesd_export + r", this is an early-exit \(EESD export, exit after layer 3\)"))
    for drafter, export, message in cases:
        with pytest.raises(CompatibilityError, match=message):
            build_decoder("cali_ts", target, drafter, theta_predictor=export)
