"""An EESD export: only the trained exit head plus what the harness needs to attach it to its target.

Directory: `exit_head.safetensors` (layer + norm + head), the tokenizer, and `draftforge.json` with
task "eesd", the target, N, whether there is an exit layer, the target's shape (model type, layers,
hidden size, vocabulary) and a fingerprint of its frozen part (embeddings + layers 1..N), so an
export is refused for any other target; a reduced head's d2t map (`draft_vocab`: the target ids of its
rows) is recorded there too. Written atomically (temp dir beside it, then a rename).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from safetensors.torch import save_file

import draftforge
from draftforge.errors import CheckpointError, CompatibilityError
from draftforge.export import (
    FORMAT_VERSION,
    METADATA_FILE,
    _check_destination,
    _jsonable,
    read_export_metadata,
    tokenizer_fingerprint,
)
from draftforge.fsutil import read_safetensors, write_dir_atomically
from draftforge.models.draft_vocab import check_map
from draftforge.models.eesd import (
    ExitHead,
    TargetParts,
    frozen_fingerprint,
    split_target,
)

WEIGHTS_FILE = "exit_head.safetensors"
TASK = "eesd"


# config fields the frozen layers 1..N compute with besides their weights (positions, norms, attention layout):
# the same weights under another RoPE base or scaling give other states H^N, which the head was not trained on
TRUNK_CONFIG_KEYS = ("rope_theta", "rope_scaling", "rope_parameters", "partial_rotary_factor", "rms_norm_eps",
                     "layer_norm_eps", "hidden_act", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "attention_bias", "mlp_bias", "sliding_window", "attn_logit_softcapping")


def trunk_config(parts: TargetParts) -> dict:
    """The TRUNK_CONFIG_KEYS the target's config has, as JSON stores them."""
    c = parts.config
    return json.loads(json.dumps({k: getattr(c, k) for k in TRUNK_CONFIG_KEYS if hasattr(c, k)}, default=str))


def target_identity(parts: TargetParts, n: int) -> dict:
    """What an exit head needs of its target: shape, the fingerprint of the frozen part and the config it runs by."""
    c = parts.config
    return {"model_type": c.model_type, "num_layers": parts.num_layers, "hidden_size": c.hidden_size,
            "vocab_size": parts.head.out_features, "exit_after_layer": n,
            "frozen_fingerprint": frozen_fingerprint(parts, n), "trunk_config": trunk_config(parts)}


def save_exit_head(head: ExitHead, identity: dict, tokenizer, out_dir, metadata: dict, overwrite=False) -> Path:
    """Write the export directory atomically; `metadata` carries task/target/recipe/metrics."""
    out_dir = Path(out_dir).resolve()
    record = {**_jsonable(metadata), **identity, "task": TASK, "exit_layer": head.layer is not None,
              "draft_vocab": head.config.draft_vocab,
              "format_version": FORMAT_VERSION, "draftforge_version": draftforge.__version__,
              "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer) if tokenizer is not None else None,
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    _check_destination(out_dir, {k: record.get(k) for k in ("task", "target", "recipe", "run_dir")}, overwrite)
    def fill(tmp: Path) -> None:
        save_file({k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}, str(tmp / WEIGHTS_FILE))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / METADATA_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    return write_dir_atomically(out_dir, fill)


def is_eesd_export(path) -> bool:
    """True for a local directory holding an EESD export (a model object or a Hub id is not one)."""
    if not isinstance(path, (str, Path)):
        return False
    p = Path(path)
    try:
        if not (p / METADATA_FILE).is_file():
            return False
    except OSError:  # e.g. a name too long for a path
        return False
    try:
        return read_export_metadata(p).get("task") == TASK
    except CheckpointError:
        return False


def check_target(meta: dict, parts: TargetParts, where: str) -> None:
    """CompatibilityError unless `parts` is the target the head was trained on (shape, then fingerprint)."""
    n = meta["exit_after_layer"]
    trained_on = meta.get("target") or "its training target"
    have = {"model_type": parts.config.model_type, "num_layers": parts.num_layers,
            "hidden_size": parts.config.hidden_size, "vocab_size": parts.head.out_features}
    diff = [f"{k} {meta.get(k)!r} vs {v!r}" for k, v in have.items() if meta.get(k) != v]
    if not diff and n < parts.num_layers and frozen_fingerprint(parts, n) != meta.get("frozen_fingerprint"):
        diff = [f"the embeddings / layers 1..{n} differ (frozen-weight fingerprint mismatch)"]
    if not diff and "trunk_config" in meta:  # exports from before it was recorded are checked by weights only
        # only the fields both configs have: a transformers release may name one differently (rope_theta inside
        # rope_parameters), which is no evidence that the target differs
        theirs, ours = meta["trunk_config"], trunk_config(parts)
        diff = [f"config {k} {theirs[k]!r} vs {ours[k]!r}" for k in sorted(set(theirs) & set(ours))
                if theirs[k] != ours[k]]
    if diff:
        raise CompatibilityError(f"EESD export {where} was trained on {trained_on} and cannot attach to this target: "
                                 f"{'; '.join(diff)}; use the target it was trained on or train an exit head for "
                                 "this one (task eesd)")


def load_exit_head(path, target_model):
    """(ExitHead with the exported weights, metadata, tokenizer or None), checked against `target_model`."""
    path = Path(str(path))
    meta = read_export_metadata(path)
    if meta.get("task") != TASK:
        raise CheckpointError(f"{path} is a {meta.get('task')!r} export, not an EESD exit head")
    parts = split_target(target_model)
    check_target(meta, parts, str(path))
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{path} has no {WEIGHTS_FILE}; re-export the eesd run")
    d2t = meta.get("draft_vocab")
    if d2t is not None:
        if not isinstance(d2t, list) or not d2t or not all(isinstance(t, int) and not isinstance(t, bool) for t in d2t):
            raise CheckpointError(f"{path}/{METADATA_FILE}: draft_vocab must be a non-empty list of target token ids; "
                                  "re-export the eesd run")
        check_map(d2t, parts.head.out_features)
    head = ExitHead.empty_like(parts, with_layer=bool(meta.get("exit_layer", True)), draft_vocab=d2t)
    state = read_safetensors(weights, "re-export the eesd run")
    try:
        missing, unexpected = head.load_state_dict(state, strict=False)
    except RuntimeError as err:  # a shape mismatch, e.g. a head with more rows than draft_vocab lists
        raise CheckpointError(f"{weights} does not fit the exit head {METADATA_FILE} describes ("
                              f"{str(err).splitlines()[-1].strip()}); re-export the eesd run") from None
    if missing or unexpected:
        raise CheckpointError(f"{weights} does not match an exit head (missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]}); re-export the eesd run")
    from draftforge.loading import read_tokenizer

    return head, meta, read_tokenizer(path, "exit head")
