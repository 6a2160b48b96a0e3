"""Start a drafter's token embedding (and head) from the target's own embedding.

A small drafter's 49,152 x D embedding is most of its parameters, and in a short run most rows are
seen a handful of times. The target already knows which tokens are alike; EAGLE and Medusa share its
embedding outright. A drafter narrower than the target gets the target's embedding projected onto its
top-D principal directions (PCA of the V x D_target matrix): the D-dimensional linear map that keeps
most of the rows' geometry. Same width: a plain copy. The head rows start from the same rows (the
SmolLM2/Llama-family targets tie head and embedding), so a reduced draft head starts as the target's
head restricted to the draft vocabulary, seen through the same projection.
Legend: V vocabulary, E target width, D drafter width.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftforge.errors import CheckpointError, CompatibilityError

EMBED_SUFFIXES = ("embed_tokens.weight", "embeddings.weight", "wte.weight")


def read_target_embedding(target_dir: str) -> torch.Tensor:
    """The target's V x E input embedding, read from its safetensors without building the model."""
    from safetensors import safe_open

    root = Path(target_dir)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"model.embed_from_target: {root} has no *.safetensors file to read the target's "
                              "embedding from (a local target directory is needed)")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if key.endswith(EMBED_SUFFIXES):
                    return f.get_tensor(key).float()
    raise CheckpointError(f"model.embed_from_target: no tensor ending in {' / '.join(EMBED_SUFFIXES)} in "
                          f"{', '.join(p.name for p in files)}")


def project_rows(emb_VE: torch.Tensor, width: int) -> torch.Tensor:
    """emb projected onto its top-`width` principal directions (centred; a copy when width == E)."""
    if width == emb_VE.shape[1]:
        return emb_VE.clone()
    if width > emb_VE.shape[1]:
        raise CompatibilityError(f"model.embed_from_target: the drafter is wider ({width}) than the target "
                                 f"({emb_VE.shape[1]}); a projection only narrows")
    centred_VE = emb_VE - emb_VE.mean(0, keepdim=True)
    _, _, vh_EE = torch.linalg.svd(centred_VE, full_matrices=False)
    return centred_VE @ vh_EE[:width].T


def init_embeddings_from_target(model, target_dir: str) -> dict:
    """Copy (or PCA-project) the target's embedding into `model`'s embedding and full-vocab head, in place.

    Returns what was done, for the run log: widths and the share of the embedding's variance kept.
    """
    emb_VE = read_target_embedding(target_dir)
    mine = model.get_input_embeddings().weight
    if mine.shape[0] != emb_VE.shape[0]:
        raise CompatibilityError(f"model.embed_from_target: the drafter has {mine.shape[0]} embedding rows, "
                                 f"the target {emb_VE.shape[0]}")
    rows_VD = project_rows(emb_VE, mine.shape[1])
    centred = emb_VE - emb_VE.mean(0, keepdim=True)
    kept = float(rows_VD.pow(2).sum() / centred.pow(2).sum()) if rows_VD.shape[1] < emb_VE.shape[1] else 1.0
    with torch.no_grad():
        mine.copy_(rows_VD.to(mine.dtype))
        head = model.get_output_embeddings()
        if head is not None and head.weight is not mine and head.weight.shape == mine.shape:
            head.weight.copy_(rows_VD.to(head.weight.dtype))
    return {"target_width": emb_VE.shape[1], "drafter_width": mine.shape[1], "variance_kept": round(kept, 4)}
