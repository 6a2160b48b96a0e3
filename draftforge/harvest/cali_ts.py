"""Task `theta`: the Cali-TS θ predictor (EESD §3.3 Eq. 5, App. B; docs/methods/cali-ts.md §4-§5) on harvested rows.

The rows come from `draftforge harvest theta` (data.sources: [HARVEST_DIR]); target and drafter were run
there, so training touches neither (they are frozen by construction: only their hidden states are read).
Loss: cross-entropy of the two logits against χ, optionally class-balanced when acceptance is far from
0.5 (docs/methods/cali-ts.md §5). The export is the predictor alone plus the harvest's target/drafter
fingerprints and widths, so the harness refuses it for another pair (models/cali_ts.py `load_predictor`).

Legend: B rows, T target width, D drafter width.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from draftforge.models.cali_ts import MAX_OFFSET, ThetaPredictor, save_predictor
from draftforge.recipe import doc, require


@dataclass
class ThetaConfig:
    max_offset: int = doc(MAX_OFFSET, "per-offset maps W^1..W^N; later offsets share W^N (EESD: 10)")
    balance: bool = doc(False, "weight the two classes by their inverse frequency (when acceptance is far "
                               "from 0.5); the export takes the weighting's log-odds shift back out, so θ_M "
                               "stays a calibrated probability")

    def check(self, at: str) -> None:
        require(self.max_offset >= 1, f"{at}.max_offset", "must be >= 1")


def theta_collate(columns: dict, device) -> dict:
    return {"h_target": torch.tensor(columns["h_target"], dtype=torch.float32, device=device),
            "h_draft": torch.tensor(columns["h_draft"], dtype=torch.float32, device=device),
            "offset": torch.tensor(columns["offset"], device=device),
            "label": torch.tensor(columns["label"], device=device)}


def make_loss(class_weight_2: torch.Tensor | None, logit_shift: float = 0.0):
    def loss(model, batch):
        logits_B2 = model(batch["h_target"], batch["h_draft"], batch["offset"])
        label_B = batch["label"]
        weight = None if class_weight_2 is None else class_weight_2.to(logits_B2.device)
        loss_sum = F.cross_entropy(logits_B2.float(), label_B, weight=weight, reduction="sum")
        # θ_M as the decoder reads it (the weighted loss's shift taken out), so accuracy and Brier score that
        theta_B = torch.sigmoid(logits_B2.float()[:, 1] - logits_B2.float()[:, 0] - logit_shift)
        metrics = {"accuracy": ((theta_B > 0.5).long() == label_B).sum().float(),
                   "brier": ((theta_B - label_B.float()) ** 2).sum()}  # its root is the RMSE, a start for σ_M
        return loss_sum, label_B.numel(), metrics
    return loss


def _split(rows, fraction: float, seed: int):
    """Held-out rows: whole sequences, a seeded `fraction` of them (at least one). Rows of one sequence share
    anchors (its rows at offsets 1..N repeat h_target) and its text, so a split by row scored the predictor on
    states it trained on. A harvest from before the `sequence` column is split by row, with a notice."""
    if fraction <= 0 or len(rows) < 2:
        return rows, None
    if "sequence" not in rows.column_names:
        from draftforge.data.provenance import notice

        notice(["θ harvest"], "the harvest records no sequence ids (an older draftforge wrote it): its rows are "
                              "held out one by one, so the held-out numbers are optimistic; harvest again to hold "
                              "out whole sequences")
        parts = rows.train_test_split(test_size=max(1, int(len(rows) * fraction)), seed=seed)
        return parts["train"], parts["test"]
    import numpy as np

    sequence_R = np.asarray(rows["sequence"])
    sequences = np.unique(sequence_R)
    if len(sequences) < 2:
        from draftforge.data.provenance import notice

        notice(["θ harvest"], "its rows come from one sequence, so none can be held out: the run has no eval")
        return rows, None
    pick = np.random.default_rng(seed).permutation(len(sequences))[: max(1, int(len(sequences) * fraction))]
    held_R = np.isin(sequence_R, sequences[pick])
    return rows.select(np.flatnonzero(~held_R)), rows.select(np.flatnonzero(held_R))


def build_theta_task(recipe, accelerator, with_data: bool = True):
    from draftforge.harvest.cali_ts import load_harvest
    from draftforge.errors import RecipeError
    from draftforge.train.parts import local_tokenizer
    from draftforge.train.spec import TaskSpec

    cfg = recipe.task_options or ThetaConfig()
    if len(recipe.data.sources) != 1:
        raise RecipeError("data.sources: task theta reads exactly one harvest directory (draftforge harvest theta)")
    rows, manifest = load_harvest(recipe.data.sources[0], tokenizer=local_tokenizer(recipe))
    check_harvest_target(recipe, manifest)
    import math

    mean = manifest["mean_label"]
    weight, shift = None, 0.0
    if cfg.balance and 0 < mean < 1:
        weight = torch.tensor([0.5 / (1 - mean), 0.5 / mean])
        shift = math.log((1 - mean) / mean)  # log(w_accept / w_reject): what the weighting adds to the logit
    model = ThetaPredictor(manifest["target_dim"], manifest["draft_dim"], cfg.max_offset, mean, shift)
    train = eval_ = None
    if with_data:
        train, eval_ = _split(rows, recipe.data.eval_fraction, recipe.train.seed)

    def export(trained, out_dir, metadata, overwrite=False):  # metadata: the caller's + the pair's (below)
        return export_predictor(trained, Path(out_dir), metadata, overwrite)

    return TaskSpec(model=model, loss=make_loss(weight, shift), train_data=train, eval_data=eval_,
                    collate=theta_collate, export=export,
                    export_metadata={**pair_metadata(manifest), "harvest_rows": manifest["rows"]},
                    unit="rows", units=lambda b: len(b["label"]))


def check_harvest_target(recipe, manifest: dict) -> None:
    """model.target, where the recipe names one, must be the target the θ harvest ran (C2T checks its harvest the
    same way): a predictor trained on another target's states was exported and refused only by eval."""
    from draftforge.errors import CompatibilityError
    from draftforge.models.cali_ts import model_fingerprint
    from draftforge.train.c2t import target_fingerprint

    ours = target_fingerprint(recipe.model.target, model_fingerprint)
    theirs = manifest.get("target_fingerprint")
    if ours is not None and theirs and ours != theirs:
        raise CompatibilityError(f"the θ harvest {recipe.data.sources[0]} ran target {manifest.get('target') or '?'} "
                                 f"(fingerprint {theirs}), but model.target is {recipe.model.target} (fingerprint "
                                 f"{ours}); set model.target to the harvest's target, or harvest again for this one")


def pair_metadata(manifest: dict) -> dict:
    """What the export keeps of the harvest's target/drafter pair, for the harness's check (models/cali_ts.py)."""
    keys = ("target", "drafter", "target_fingerprint", "drafter_fingerprint", "drafter_kind", "exit_after_layer")
    return {k: manifest.get(k) for k in keys}


def export_predictor(model: ThetaPredictor, out_dir: Path, metadata: dict, overwrite: bool = False) -> Path:
    """Write the predictor into `out_dir` atomically (temp dir beside it, then a rename)."""
    from draftforge.errors import CheckpointError
    from draftforge.fsutil import write_dir_atomically

    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise CheckpointError(f"{out_dir} already holds files; choose another --out or pass --overwrite")
    return write_dir_atomically(out_dir, lambda tmp: save_predictor(model, tmp, metadata))
