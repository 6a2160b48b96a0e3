"""An EAGLE-3 export: one directory that vLLM reads as a `speculators` checkpoint and draftforge loads as a drafter.

- `config.json`: the `speculators` format (speculators_model_type "eagle3", `transformer_layer_config` = the
  target's config cut to one layer, `draft_vocab_size`, `eagle_aux_hidden_state_layer_ids`, the norm flags written
  out, since vLLM's default for `norm_before_residual` is true and this head's residual is the raw feature, and
  `speculators_config` naming the verifier).
- `model.safetensors`: `fc`, `layers.0.*`, `norm`, `lm_head` and, for a reduced draft vocabulary, `d2t` (int64,
  the *offset* target_id − draft_id of every draft id, as speculators and vLLM define it) and `t2d` (bool over
  the target vocabulary). The embedding is not stored: the head reads the verifier's.
- `draftforge.json`: task "eagle3", the head's shape (models/eagle3.Eagle3Config), the target it was trained on,
  the tokenizer's fingerprint and the run's metadata; plus the tokenizer's files.
The feature-conditioned Mamba2 drafter (models/feature_mamba.py, `head.body` "mamba2") exports the same way
without `config.json`: no engine serves a Mamba2 EAGLE-style drafter, and a config vLLM would read as an
attention head must not exist for it.
Written atomically (temp dir beside it, then a rename); loading checks the target's shape and the maps.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import draftforge
from draftforge.errors import CheckpointError, CompatibilityError
from draftforge.export import FORMAT_VERSION, METADATA_FILE, _check_destination, _jsonable, read_export_metadata
from draftforge.export import tokenizer_fingerprint
from draftforge.fsutil import write_dir_atomically
from draftforge.models.draft_vocab import check_map
from draftforge.models.eagle3 import HEAD_KIND, Eagle3Config, Eagle3Head
from draftforge.models.feature_mamba import BODY as MAMBA_BODY
from draftforge.models.feature_mamba import FeatureMamba2Head, FeatureMambaConfig

WEIGHTS_FILE = "model.safetensors"
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose format this writes (its loader is tested against it)
LAYER_CONFIG_DROP = ("architectures", "_name_or_path", "transformers_version", "dtype", "torch_dtype",
                     "_model_name_or_path", "id2label", "label2id")


def offsets_of(d2t: list[int]) -> torch.Tensor:
    """speculators' d2t: target_id − draft_id for every draft id (int64). The format keeps draft ids in ascending
    target-id order (its t2d mask says which ids, not their order; its loaders take head rows as lm_head[t2d]), so
    a map in another order is refused rather than exported with rows the mask would pair wrongly."""
    ids = torch.tensor(d2t, dtype=torch.long)
    if len(ids) > 1 and not bool((ids[1:] > ids[:-1]).all()):
        from draftforge.errors import CompatibilityError

        raise CompatibilityError("the head's draft vocabulary is not in ascending target-id order, which the "
                                 "speculators format assumes; every draftforge run writes it sorted: retrain or "
                                 "re-export from a run that did")
    return ids - torch.arange(len(d2t))


def t2d_mask(d2t: list[int], vocab_size: int) -> torch.Tensor:
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[torch.tensor(d2t, dtype=torch.long)] = True
    return mask


def speculators_config(head: Eagle3Head, target_config, target_name: str, steps: int) -> dict:
    """config.json in the speculators eagle3 format (the fields vLLM reads, each written out)."""
    c = head.config
    layer = {k: v for k, v in target_config.to_dict().items() if k not in LAYER_CONFIG_DROP}
    # the head's own layer: no biases (a target's attention_bias / mlp_bias would give vLLM unloaded bias tensors),
    # and the fc's width in aux states (vLLM reads num_aux_hidden_states, else assumes 3)
    layer.update(num_hidden_layers=1, model_type=target_config.model_type, vocab_size=c.vocab_size,
                 tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                 num_aux_hidden_states=len(c.aux_layers))
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": HEAD_KIND,
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": c.head_rows,
        "target_hidden_size": c.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(c.aux_layers),
        "norm_before_residual": False,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "torch_dtype": str(head.dtype).removeprefix("torch."),
        "speculators_config": {
            "algorithm": HEAD_KIND,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": steps}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(target_name),
                         "architectures": list(getattr(target_config, "architectures", None) or [])},
        },
    }


def writes_maps(config) -> bool:
    """Whether the export carries d2t / t2d: only for a draft vocabulary smaller than the target's. One holding every
    id (ascending: the identity) gets none, as vLLM expects of a head with draft_vocab_size == vocab_size: it drops
    its map then and refuses a checkpoint that still holds d2t (llama_eagle3.py, vLLM 0.32)."""
    return config.draft_vocab is not None and len(config.draft_vocab) < config.vocab_size


def head_tensors(head: Eagle3Head) -> dict[str, torch.Tensor]:
    """The state dict as written: trained weights, plus d2t / t2d for a reduced draft vocabulary."""
    tensors = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    if head.config.draft_vocab is not None:  # every id in another order: no map would tell an engine so
        offsets_of(head.config.draft_vocab)
    if writes_maps(head.config):
        tensors["d2t"] = offsets_of(head.config.draft_vocab)
        tensors["t2d"] = t2d_mask(head.config.draft_vocab, head.config.vocab_size)
    return tensors


def save_head(head: Eagle3Head, target_config, tokenizer, out_dir, metadata: dict, steps: int = 3,
              overwrite: bool = False) -> Path:
    """Write the export directory atomically; `metadata` carries task/target/recipe/metrics (target: the verifier
    vLLM is told to load, a local directory or a Hub id)."""
    out_dir = Path(out_dir).resolve()
    target_name = metadata.get("target") or getattr(target_config, "_name_or_path", "") or ""
    if target_name and Path(target_name).expanduser().is_dir():  # a relative path would depend on where vLLM runs
        target_name = str(Path(target_name).expanduser().resolve())
    record = {**_jsonable(metadata), "task": HEAD_KIND, "head": head.config.to_dict(),
              "format_version": FORMAT_VERSION, "draftforge_version": draftforge.__version__,
              "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer) if tokenizer is not None else None,
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    _check_destination(out_dir, {k: record.get(k) for k in ("task", "target", "recipe", "run_dir")}, overwrite)
    config = None if isinstance(head, FeatureMamba2Head) else speculators_config(head, target_config, target_name,
                                                                                     steps)

    def fill(tmp: Path) -> None:
        save_file(head_tensors(head), str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        if config is not None:
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / METADATA_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    return write_dir_atomically(out_dir, fill)


def is_eagle3_export(path) -> bool:
    """True for a local directory holding a draftforge EAGLE-3 export."""
    if not isinstance(path, (str, Path)):
        return False
    try:
        return (Path(path) / METADATA_FILE).is_file() and read_export_metadata(path).get("task") == HEAD_KIND
    except (OSError, CheckpointError):
        return False


def load_head(path, target_config=None) -> tuple[Eagle3Head | FeatureMamba2Head, dict]:
    """(head with the exported weights, metadata); checked against `target_config` when given."""
    path = Path(str(path))
    meta = read_export_metadata(path)
    if meta.get("task") != HEAD_KIND:
        raise CheckpointError(f"{path} is a {meta.get('task')!r} export, not an EAGLE-3 head")
    mamba = isinstance(meta.get("head"), dict) and meta["head"].get("body") == MAMBA_BODY
    config_class, head_class = (FeatureMambaConfig, FeatureMamba2Head) if mamba else (Eagle3Config, Eagle3Head)
    try:
        config = config_class(**meta["head"])
    except (KeyError, TypeError) as err:
        raise CheckpointError(f"{path}/{METADATA_FILE}: the head's shape is missing or malformed ({err}); "
                              "re-export the eagle3 run") from None
    if target_config is not None:
        config.check_target(target_config, str(path))
    if config.draft_vocab is not None:
        check_map(config.draft_vocab, config.vocab_size)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise CheckpointError(f"{path} has no {WEIGHTS_FILE}; re-export the eagle3 run")
    try:
        state = load_file(str(weights))
    except Exception as err:  # a truncated or foreign file
        raise CheckpointError(f"{weights} cannot be read ({err}); re-export the eagle3 run") from None
    d2t, t2d = state.pop("d2t", None), state.pop("t2d", None)
    if writes_maps(config) or (config.draft_vocab is not None and (d2t is not None or t2d is not None)):
        if d2t is None or not torch.equal(d2t, offsets_of(config.draft_vocab)) or t2d is None or \
                not torch.equal(t2d, t2d_mask(config.draft_vocab, config.vocab_size)):
            raise CompatibilityError(f"{weights}: d2t / t2d do not match the draft vocabulary in {METADATA_FILE}; "
                                     "re-export the eagle3 run")
    head = head_class(config)
    try:
        missing, unexpected = head.load_state_dict(state, strict=False)
    except RuntimeError as err:
        raise CheckpointError(f"{weights} does not fit the head {METADATA_FILE} describes "
                              f"({str(err).splitlines()[-1].strip()}); re-export the eagle3 run") from None
    if missing or unexpected:
        raise CheckpointError(f"{weights} does not match an EAGLE-3 head (missing {missing[:3]}, unexpected "
                              f"{unexpected[:3]}); re-export the eagle3 run")
    dtype = next(iter(state.values())).dtype
    return head.to(dtype).eval(), meta
