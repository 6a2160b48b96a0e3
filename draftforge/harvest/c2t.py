"""Task `c2t`: the C2T classifier on harvested EAGLE-2 trees (C2T §4.1, App. B; docs/methods/c2t.md §4, §7).

Rows come from `draftforge harvest trees` (data.sources: harvest dirs). Trees are split by a hash
of their id (no tree is on both sides); the training split keeps every accepted node and
`negative_ratio` rejected ones per accepted node (negative sampling against the ~1% positives);
the held-out split is kept whole. The loss is BCE on the logit; Adam is the loop's AdamW with
optim.weight_decay: 0. Logged metrics (per row of a training batch): `pred_positive` (rate of
C >= threshold), `accepted` (rate of label 1), `hits` (rate of accepted nodes with C >= threshold),
so recall = hits / accepted. The export writes the head (models/c2t.py) with its held-out recall
and positive rate θ over the whole held-out split at several β, and prints them.

Legend: B rows, F features.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from draftforge.models.c2t import FEATURE_SETS, C2TClassifier, feature_matrix, save_head
from draftforge.recipe import doc, require

REPORT_BETAS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


@dataclass
class C2TConfig:
    features: str = doc("PHd", "feature set: PHd (default), PH, Pd or Hd (the paper's ablation, Table 1)")
    hidden: int = doc(48, "hidden width h of the classifier (the paper: 12-48 saturate)")
    negative_ratio: float = doc(10.0, "rejected nodes kept per accepted node in the training split (0: keep all)")
    eval_fraction: float = doc(0.05, "fraction of trees held out (the paper: 95:5, split by tree)")
    threshold: float = doc(0.5, "β at which the logged recall / positive rate are computed")

    def check(self, at: str) -> None:
        require(self.features in FEATURE_SETS, f"{at}.features", f"must be one of {', '.join(FEATURE_SETS)}")
        require(self.hidden > 0, f"{at}.hidden", "must be > 0")
        require(self.negative_ratio >= 0, f"{at}.negative_ratio", "must be >= 0")
        require(0.0 < self.eval_fraction < 1.0, f"{at}.eval_fraction", "must be in (0, 1)")
        require(0.0 < self.threshold < 1.0, f"{at}.threshold", "must be in (0, 1)")


def held_out(tree_id: str, fraction: float) -> bool:
    digest = hashlib.sha256(str(tree_id).encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < fraction


def split_rows(data, cfg: C2TConfig, seed: int):
    """(train rows with negative sampling, held-out rows whole) as datasets of P, H, d, label."""
    import datasets

    cols = data.select_columns(["tree_id", "P", "H", "d", "label"]).with_format("numpy")[:]
    trees, tree_of_row = np.unique(cols["tree_id"], return_inverse=True)
    out_mask = np.array([held_out(t, cfg.eval_fraction) for t in trees], dtype=bool)[tree_of_row]
    label = cols["label"].astype(np.float32)
    train_idx = np.flatnonzero(~out_mask)
    if cfg.negative_ratio > 0:
        pos, neg = train_idx[label[train_idx] == 1], train_idx[label[train_idx] == 0]
        n_neg = min(len(neg), round(cfg.negative_ratio * max(len(pos), 1)))
        neg = np.random.default_rng(seed).choice(neg, size=n_neg, replace=False)
        train_idx = np.sort(np.concatenate([pos, neg]))

    def subset(idx):
        return datasets.Dataset.from_dict({"P": cols["P"][idx].astype(np.float64), "H": cols["H"][idx].astype(np.float32),
                                           "d": cols["d"][idx].astype(np.float32), "label": label[idx]})
    return subset(train_idx), subset(np.flatnonzero(out_mask))


@torch.no_grad()
def heldout_report(model: C2TClassifier, rows, betas=REPORT_BETAS) -> dict:
    """Recall of accepted nodes and positive rate θ = P(C >= β) over all held-out rows, per β."""
    if rows is None or len(rows) == 0:
        return {}
    cols = rows.with_format("torch")[:]
    conf_B = model.eval().confidence(feature_matrix(cols, model.features))
    label_B = cols["label"] > 0.5
    out = {"rows": len(label_B), "accepted": int(label_B.sum())}
    for beta in betas:
        kept_B = conf_B >= beta
        recall = float((kept_B & label_B).sum() / label_B.sum().clamp(min=1))
        out[f"beta={beta:g}"] = {"recall": recall, "positive_rate": float(kept_B.float().mean())}
    return out


def build(recipe, accelerator, with_data: bool = True):
    from draftforge.train.spec import TaskSpec

    cfg: C2TConfig = recipe.task_options or C2TConfig()
    features = FEATURE_SETS[cfg.features]
    torch.manual_seed(recipe.train.seed)
    model = C2TClassifier(features, cfg.hidden)
    train = heldout = None
    stats = {}
    if with_data:
        train, heldout, stats = load_rows(recipe, cfg)
    top_m = entropy_top_m(recipe, with_data)

    def loss(m, batch):
        x_BF = feature_matrix(batch, features)
        label_B = batch["label"].float()
        logit_B = m(x_BF)
        kept_B = torch.sigmoid(logit_B.detach()) >= cfg.threshold
        metrics = {"pred_positive": kept_B.sum(), "accepted": label_B.sum(), "hits": (kept_B & (label_B > 0.5)).sum()}
        return F.binary_cross_entropy_with_logits(logit_B, label_B, reduction="sum"), label_B.numel(), metrics

    def export(trained, out_dir, metadata, overwrite=False):
        report = heldout_report(trained, heldout) if heldout is not None else {}
        if report:
            best = report.get(f"beta={cfg.threshold:g}", {})
            print(f"[c2t] held-out ({report['rows']} nodes, {report['accepted']} accepted): recall "
                  f"{best.get('recall', float('nan')):.3f}, positive rate {best.get('positive_rate', float('nan')):.4f} "
                  f"at β={cfg.threshold:g}")
        # `draftforge export RUN_DIR` reads no data: the run's own export's figures come in `metadata` then
        return save_head(trained, out_dir, {**metadata, **({"heldout": report} if report else {})},
                         overwrite=overwrite)

    return TaskSpec(model=model, loss=loss, train_data=train, eval_data=heldout, export=export,
                    export_metadata={**({"harvest": stats} if stats else {}), "entropy_top_m": top_m}, unit="nodes",
                    units=lambda b: len(b["label"]), data_stats=stats,
                    run_files={HARVEST_FILE: json.dumps({"entropy_top_m": top_m})})


HARVEST_FILE = "c2t_harvest.json"  # in the run dir: what `draftforge export RUN_DIR` needs of the harvest


def entropy_top_m(recipe, with_data: bool) -> int:
    """The harvest's M (H is the entropy of the parent's top-M): the decoder must compute H as the head learnt it.
    An export without data reads the run's own record (the harvest may be gone since)."""
    from pathlib import Path

    from draftforge.harvest.c2t import harvest_top_m

    saved = Path(recipe.output_dir) / HARVEST_FILE
    if not with_data and saved.is_file():
        return int(json.loads(saved.read_text())["entropy_top_m"])
    return harvest_top_m(recipe.data.sources)


def load_rows(recipe, cfg: C2TConfig):
    from draftforge.harvest.c2t import load_harvest, summarize
    from draftforge.train.parts import local_tokenizer

    data = load_harvest(recipe.data.sources, target_fingerprint(recipe.model.target), local_tokenizer(recipe))
    train, heldout = split_rows(data, cfg, recipe.train.seed)
    if len(train) == 0 or len(heldout) == 0:
        from draftforge.errors import DataError

        raise DataError(f"the harvest has too few trees to split ({len(train)} training rows, {len(heldout)} held-out "
                        "rows); harvest more prompts or raise c2t.eval_fraction")
    stats = {**summarize(data), "train_rows": len(train), "heldout_rows": len(heldout)}
    return train, heldout, stats


def target_fingerprint(target: str | None, fingerprint=None) -> str | None:
    """The fingerprint of the recipe's target (`fingerprint`, default the C2T harvest's): None when model.target is
    not set or names a Hub id (not checked); a local path that does not exist is refused (a typo trained
    unchecked)."""
    from pathlib import Path

    from draftforge.loading import check_local

    if not target:
        return None
    check_local(target, "model.target")
    if not Path(target).expanduser().is_dir():
        return None
    from draftforge.harvest.c2t import model_fingerprint
    from draftforge.loading import load_causal_lm

    return (fingerprint or model_fingerprint)(load_causal_lm(target, what="target"))
