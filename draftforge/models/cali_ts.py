"""The Cali-TS θ predictor (EESD §3.3 Eq. 5): θ_M = softmax(W_p [W^{min(i,10)} H_t^T ; H^D_i])[1].

W^1..W^O (O = 10) are per-offset d_T x d_T maps of the target's hidden state; W_p maps the concatenation to
two logits; no biases (the concrete reading in docs/methods/cali-ts.md §4). The paper's drafter shares the
target's width; here the drafter may be any model, so W_p takes d_T + d_D inputs. Since W_p is linear,
W_p [W^i h_T ; h_D] = (W_p,T W^i) h_T + W_p,D h_D: per round `target_terms` computes the (O, 2) first part
once, and each drafted token costs one 2 x d_D product (`theta_from_terms`).

What the predictor reads at decode time, and what the harvest must write the same way:
  H_t^T  the target's final-normed hidden state at the row that emitted the last committed token;
  H^D_i  the drafter's final-normed hidden state whose logits chose draft i (after drafts 1..i-1);
  label  χ_i = 1[draft i == the target's token there], teacher-forced (earlier drafts accepted).
The paper's index also reads as the state *after* draft i (predicting draft i+1); we use the state that chose draft i,
which every drafter has for free (a Mamba drafter never feeds its last draft) and which asks the question
the stop decision after draft i needs first: was draft i accepted? The early-exit drafter feeds every
draft anyway and gives that state (`Drafter.hidden_after_token`); its harvest pairs that state with
χ of draft i+1. A predictor is tied to one drafter: kind, width, weights and, for EESD, N (`check_pair`).

Legend: B rows, O offsets, T target width d_T, D drafter width d_D.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftforge.errors import CheckpointError, CompatibilityError, first_line
from draftforge.fsutil import read_json, read_safetensors

MAX_OFFSET = 10
WEIGHTS_FILE = "theta.safetensors"
META_FILE = "draftforge.json"


class ThetaPredictor(nn.Module):
    def __init__(self, target_dim: int, draft_dim: int, max_offset: int = MAX_OFFSET, mean_label: float = 0.5,
                 logit_shift: float = 0.0):
        super().__init__()
        self.target_dim, self.draft_dim, self.max_offset = int(target_dim), int(draft_dim), int(max_offset)
        self.mean_label = float(mean_label)  # mean training acceptance: Cali-TS's default θ̂₀
        # log(w_accept / w_reject) of a class-weighted training loss: its optimum logit is the calibrated one plus
        # this, so θ_M = sigmoid(logit - shift) stays a probability (0 when the classes were not weighted)
        self.logit_shift = float(logit_shift)
        # identity maps to start: W^i h_T = h_T until training says otherwise
        self.offset_maps_OTT = nn.Parameter(torch.eye(target_dim).repeat(max_offset, 1, 1))
        self.head_2X = nn.Parameter(torch.randn(2, target_dim + draft_dim) * (target_dim + draft_dim) ** -0.5)
        self._terms_cache = None

    def offset_index(self, offset_B: torch.Tensor) -> torch.Tensor:
        """1-based draft offsets -> 0-based map index, min(i, O) - 1 (offsets past O share W^O)."""
        return offset_B.clamp(1, self.max_offset) - 1

    def forward(self, h_target_BT: torch.Tensor, h_draft_BD: torch.Tensor, offset_B: torch.Tensor) -> torch.Tensor:
        """Two logits per row [B, 2]; θ_M = softmax(.)[:, 1]."""
        h_target_BT = h_target_BT.to(self.offset_maps_OTT.dtype)
        index_B = self.offset_index(offset_B)
        mapped_BT = torch.zeros_like(h_target_BT)
        for o in index_B.unique().tolist():  # one matmul per offset, not a d_T x d_T matrix per row
            rows = index_B == o
            # under bf16 autocast the product comes out in bf16: keep the sum in the parameters' dtype
            mapped_BT = mapped_BT.index_put((rows,), (h_target_BT[rows] @ self.offset_maps_OTT[o].T).to(mapped_BT.dtype))
        return F.linear(torch.cat([mapped_BT, h_draft_BD.to(mapped_BT.dtype)], dim=-1), self.head_2X)

    @torch.no_grad()
    def target_terms(self, h_target_T: torch.Tensor) -> torch.Tensor:
        """(W_p,T W^i) h_T for every offset i: [O, 2] (once per round)."""
        if self._terms_cache is None or self._terms_cache.device != h_target_T.device:
            # the products W_p,T W^i do not change at decode time: fold them once
            self._terms_cache = torch.einsum("ct,ots->ocs", self.head_2X[:, : self.target_dim], self.offset_maps_OTT)
        return self._terms_cache @ h_target_T.to(self._terms_cache.dtype)

    @torch.no_grad()
    def theta_from_terms(self, terms_O2: torch.Tensor, h_draft_D: torch.Tensor, offset: int) -> float:
        """θ_M of draft `offset` (1-based) from the round's target terms and the drafter's hidden state."""
        logits_2 = terms_O2[min(offset, self.max_offset) - 1] + self.head_2X[:, self.target_dim :] @ h_draft_D.to(
            terms_O2.dtype)
        return float(torch.sigmoid(logits_2[1] - logits_2[0] - self.logit_shift))

    def train(self, mode: bool = True):
        self._terms_cache = None  # weights may change while training
        return super().train(mode)


def model_fingerprint(model: nn.Module) -> str:
    """sha256 over each parameter's name, shape and a strided sample of its values rounded to bfloat16
    (the same weights loaded in fp32 or bf16 agree; another checkpoint does not). Cheap for a 135M target."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            flat = p.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 4096)].to("cpu", torch.bfloat16).view(torch.int16)
            h.update(f"{name}:{tuple(p.shape)}:".encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()


def hidden_size(model: nn.Module) -> int:
    config = model.config
    return int(getattr(config, "hidden_size", None) or config.d_model)


def save_predictor(predictor: ThetaPredictor, out_dir: Path, metadata: dict) -> None:
    """Weights + draftforge.json into an existing directory (the caller makes the write atomic)."""
    from safetensors.torch import save_file

    state = {k: v.detach().contiguous().cpu() for k, v in predictor.state_dict().items()}
    save_file(state, str(Path(out_dir) / WEIGHTS_FILE))
    from draftforge.export import FORMAT_VERSION

    meta = {**metadata, "task": "theta", "format_version": FORMAT_VERSION, "target_dim": predictor.target_dim,
            "draft_dim": predictor.draft_dim, "max_offset": predictor.max_offset, "mean_label": predictor.mean_label,
            "logit_shift": predictor.logit_shift}
    (Path(out_dir) / META_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n")


def read_predictor_meta(path) -> dict:
    path = Path(path)
    meta_path = path / META_FILE
    if not (path / WEIGHTS_FILE).is_file() or not meta_path.is_file():
        raise CheckpointError(f"{path} is not a θ predictor export (needs {WEIGHTS_FILE} and {META_FILE}); "
                              "train one with `draftforge train` on a recipe with task: theta")
    meta = read_json(meta_path, "re-export the θ predictor")
    if meta.get("task") != "theta":
        raise CheckpointError(f"{path} is a {meta.get('task')!r} export, but a 'theta' predictor is needed")
    from draftforge.export import check_format_version

    check_format_version(meta, meta_path)
    return meta


EARLY_EXIT = "early_exit"  # decode/methods/eesd.py EarlyExitDrafter.kind


def drafter_identity(drafter) -> dict:
    """What a θ predictor records of the harness drafter (load_drafter) it was harvested for: its kind, width
    and weights fingerprint, and an early-exit drafter's N (its exit head alone does not say where it sits)."""
    return {"drafter_kind": drafter.kind, "draft_dim": hidden_size(drafter.model),
            "drafter_fingerprint": model_fingerprint(drafter.model),
            "exit_after_layer": drafter.n if drafter.kind == EARLY_EXIT else None}


def _kind_phrase(kind: str, exit_after) -> str:
    if kind == EARLY_EXIT:
        return f"an early-exit (EESD export, exit after layer {exit_after})"
    return f"a {kind}"


def check_pair(meta: dict, target_model, drafter, where) -> None:
    """One CompatibilityError naming every way this target / harness drafter differs from the predictor's
    (predictors exported before drafter kinds were recorded are matched by width and fingerprint only)."""
    problems = []
    if hidden_size(target_model) != meta["target_dim"]:
        problems.append(f"target hidden size {hidden_size(target_model)} != {meta['target_dim']}")
    elif meta.get("target_fingerprint") and model_fingerprint(target_model) != meta["target_fingerprint"]:
        problems.append("target weights differ (fingerprint)")
    have = drafter_identity(drafter)
    kind, exit_after = meta.get("drafter_kind"), meta.get("exit_after_layer")
    if kind is not None and (kind, exit_after) != (have["drafter_kind"], have["exit_after_layer"]):
        problems.append(f"it was harvested for {_kind_phrase(kind, exit_after)} drafter, this is "
                        f"{_kind_phrase(have['drafter_kind'], have['exit_after_layer'])} drafter")
    elif have["draft_dim"] != meta["draft_dim"]:
        problems.append(f"drafter hidden size {have['draft_dim']} != {meta['draft_dim']}")
    elif meta.get("drafter_fingerprint") and have["drafter_fingerprint"] != meta["drafter_fingerprint"]:
        problems.append("drafter weights differ (fingerprint)")
    if problems:
        theirs = f"target {meta.get('target') or '?'}, drafter {meta.get('drafter') or '?'}"
        ours = (f"target {getattr(getattr(target_model, 'config', None), '_name_or_path', '') or '?'}, "
                f"a {have['drafter_kind']} drafter")
        raise CompatibilityError(
            f"θ predictor {where} was trained for another target/drafter pair ({'; '.join(problems)}; it was "
            f"trained for {theirs}, this is {ours}); harvest and train a θ predictor for this pair (draftforge "
            "harvest theta, then task: theta)")


def load_predictor(path, target_model, drafter, device="cpu") -> ThetaPredictor:
    """A θ predictor export, refused unless it was trained for exactly this target and (harness) drafter."""
    meta = read_predictor_meta(path)
    check_pair(meta, target_model, drafter, path)
    predictor = ThetaPredictor(meta["target_dim"], meta["draft_dim"], meta["max_offset"], meta["mean_label"],
                               meta.get("logit_shift", 0.0))  # exports from before the key: none was balanced right
    try:
        predictor.load_state_dict(read_safetensors(Path(path) / WEIGHTS_FILE, "re-export the theta run"))
    except RuntimeError as e:  # shapes other than its draftforge.json says
        raise CheckpointError(f"{Path(path) / WEIGHTS_FILE} does not match its {META_FILE} ({first_line(e)}); "
                              "re-export the theta run") from None
    finite = all(bool(torch.isfinite(t).all()) for t in predictor.state_dict().values())
    if not finite or not all(math.isfinite(float(x)) for x in (predictor.mean_label, predictor.logit_shift)):
        # a NaN θ reads as 0 at decode time: Cali-TS would stop after every draft, slowly and silently
        raise CheckpointError(f"the θ predictor {path} holds non-finite weights or calibration values; "
                              "re-export the theta run (or train it again)")
    return predictor.to(device).eval()
