"""The C2T classifier F: (P, H, d) -> confidence C that the target accepts a draft node (C2T §4.1, App. E).

Features (docs/methods/c2t.md §3), raw values, no normalisation:
  P  joint probability of the node, exp(sum of log p along its root path), in [0, 1];
  H  entropy (natural log) of the parent's full-vocabulary softmax over its top-M tokens, not renormalised;
  d  draft layer of the node, DEPTH_ORIGIN for the first draft layer (Alg. 1).
An exported head is `c2t.safetensors` + `draftforge.json` holding these definitions; a head whose
definitions or depth origin differ from the ones this code computes is refused when loaded.

Legend: B nodes, F features.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draftforge.errors import CheckpointError, CompatibilityError

DEPTH_ORIGIN = 0  # d of the first draft layer (C2T Alg. 1); harvest, training and the builder all use it
ENTROPY_TOP_M = 1000
FEATURE_DEFS = {
    "P": "joint probability exp(sum log p) along the root path, in [0, 1]",
    "H": "entropy -sum p ln p of the parent's full softmax over its top-M tokens, not renormalised",
    "d": "draft layer, 0 for the first draft layer",
}
FEATURE_SETS = {"PHd": ("P", "H", "d"), "PH": ("P", "H"), "Pd": ("P", "d"), "Hd": ("H", "d")}
WEIGHTS_FILE, META_FILE, KIND = "c2t.safetensors", "draftforge.json", "c2t-classifier"


class C2TClassifier(torch.nn.Module):
    """Linear(F -> h) -> ReLU -> Linear(h -> 1); `forward` gives the logit, `confidence` sigmoid(logit)."""

    def __init__(self, features=("P", "H", "d"), hidden: int = 48):
        super().__init__()
        self.features, self.hidden = tuple(features), hidden
        self.net = torch.nn.Sequential(torch.nn.Linear(len(self.features), hidden), torch.nn.ReLU(),
                                       torch.nn.Linear(hidden, 1))

    def forward(self, x_BF: torch.Tensor) -> torch.Tensor:
        return self.net(x_BF).squeeze(-1)

    @torch.no_grad()
    def confidence(self, x_BF: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.forward(x_BF))


def feature_matrix(columns: dict[str, torch.Tensor], features) -> torch.Tensor:
    """[B, F] float32 from per-feature columns (P, H, d), in the head's feature order."""
    return torch.stack([columns[name].float() for name in features], dim=-1)


def head_metadata(model: C2TClassifier, extra: dict | None = None) -> dict:
    from draftforge.export import FORMAT_VERSION

    return {"kind": KIND, "format_version": FORMAT_VERSION, "features": list(model.features), "hidden": model.hidden,
            "feature_defs": {f: FEATURE_DEFS[f] for f in model.features}, "depth_origin": DEPTH_ORIGIN,
            "entropy_top_m": ENTROPY_TOP_M, **(extra or {})}


def save_head(model: C2TClassifier, out_dir, extra: dict | None = None, overwrite: bool = True) -> Path:
    """Write the head atomically: a temp dir beside `out_dir` renamed into place. Never replaces a directory
    that is not a C2T head; replaces a head only with `overwrite`."""
    from safetensors.torch import save_file

    from draftforge.fsutil import write_dir_atomically

    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        meta_file = out_dir / META_FILE
        try:  # a damaged draftforge.json cannot show the folder is a head: it is refused as someone's files
            is_head = meta_file.is_file() and json.loads(meta_file.read_text()).get("kind") == KIND
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            is_head = False
        if not is_head:
            raise CheckpointError(f"{out_dir} holds files that are not a C2T classifier; choose another --out")
        if not overwrite:
            raise CheckpointError(f"{out_dir} already holds a C2T classifier; choose another --out or pass --overwrite")
    def fill(tmp: Path) -> None:
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, str(tmp / WEIGHTS_FILE))
        (tmp / META_FILE).write_text(json.dumps(head_metadata(model, extra), indent=2, default=str))

    return write_dir_atomically(out_dir, fill)


def load_head(path) -> tuple[C2TClassifier, dict]:
    """(classifier in eval mode, metadata); refuses heads whose feature definitions this code does not compute."""
    from draftforge.fsutil import read_json, read_safetensors
    from draftforge.export import check_format_version

    path = Path(path)
    meta_file, weights = path / META_FILE, path / WEIGHTS_FILE
    if not meta_file.is_file() or not weights.is_file():
        raise CheckpointError(f"{path} is not an exported C2T classifier (needs {WEIGHTS_FILE} and {META_FILE}; "
                              "train one with `draftforge train` and task: c2t)")
    meta = read_json(meta_file, "re-export the c2t run")
    if not isinstance(meta, dict) or meta.get("kind") != KIND:
        raise CheckpointError(f"{path} holds a {meta.get('kind') or meta.get('task')!r} export, not a C2T classifier")
    check_format_version(meta, meta_file)
    check_definitions(meta, str(path))
    model = C2TClassifier(meta["features"], int(meta["hidden"]))
    try:
        model.load_state_dict(read_safetensors(weights, "re-export the c2t run"))
    except RuntimeError as e:
        raise CheckpointError(f"{weights} does not match its {META_FILE} (features/hidden): {e}") from None
    return model.eval(), meta


def check_definitions(meta: dict, where: str) -> None:
    """The head's features must be ours, with the same definitions and depth origin."""
    features = meta.get("features") or []
    unknown = [f for f in features if f not in FEATURE_DEFS]
    if not features or unknown or tuple(features) not in FEATURE_SETS.values():
        raise CompatibilityError(f"C2T classifier {where} uses features {features}; this code computes "
                                 f"{', '.join(FEATURE_SETS)} sets of {list(FEATURE_DEFS)}; retrain it on a harvest "
                                 "from `draftforge harvest trees`")
    defs = meta.get("feature_defs") or {}
    changed = [f for f in features if defs.get(f) != FEATURE_DEFS[f]]
    if changed:
        raise CompatibilityError(f"C2T classifier {where} defines feature(s) {changed} differently from this code "
                                 f"({ {f: defs.get(f) for f in changed} }); retrain it on a fresh harvest")
    if meta.get("depth_origin") != DEPTH_ORIGIN:
        raise CompatibilityError(f"C2T classifier {where} counts depth from {meta.get('depth_origin')!r}, this code "
                                 f"gives the first draft layer d={DEPTH_ORIGIN}; retrain it on a fresh harvest")
