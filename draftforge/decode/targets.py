"""Targets: a HF decoder-only Transformer with a KV cache that is trimmed to the accepted prefix
after each round, and tree verification in one forward (packed tree, 4D mask, depth positions).

Legend: Q query tokens, V vocabulary, L tokens held in the KV cache.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

from draftforge.decode.tree import DraftTree, ancestor_matrix, packed_tree_mask
from draftforge.errors import CheckpointError, CompatibilityError

SSM_MODEL_TYPES = ("mamba", "mamba2")


def load_hf_causal_lm(model_or_path, device, dtype, what: str):
    """(model, tokenizer or None) from a loaded model or a local/Hub path, in eval mode."""
    tokenizer = None
    if isinstance(model_or_path, PreTrainedModel):
        model = model_or_path
    else:
        from draftforge.loading import load_causal_lm

        model = load_causal_lm(model_or_path, what=what, dtype=dtype)  # safetensors only; missing dir named
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(model_or_path))
        except (OSError, ValueError, TypeError):
            tokenizer = None  # a bare checkpoint without tokenizer files is still usable with token ids
    if dtype is not None:
        model = model.to(dtype)
    return model.to(device).eval(), tokenizer


def max_context(config) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class CachedLM:
    """A causal LM plus a DynamicCache that can be extended, fed packed trees, and trimmed."""

    def __init__(self, model):
        self.model = model
        self.device = model.device
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.length = 0  # tokens whose K/V are in the cache

    @torch.inference_mode()
    def forward(self, tokens: list[int], positions: list[int] | None = None, mask_11QK=None,
                last_only: bool = False) -> torch.Tensor:
        """Append `tokens` to the cache and return their logits [Q, V] (float32 or wider); with
        `last_only`, only the last token's [1, V] (a prompt's T x V logits would be computed for nothing)."""
        q = len(tokens)
        cache_position_Q = torch.arange(self.length, self.length + q, device=self.device)
        position_ids_1Q = cache_position_Q[None] if positions is None else torch.tensor([positions], device=self.device)
        out = self.model(
            input_ids=torch.tensor([tokens], device=self.device),
            position_ids=position_ids_1Q,
            cache_position=cache_position_Q,
            attention_mask=mask_11QK,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        self.cache = out.past_key_values
        self.length += q
        return out.logits[0].float() if out.logits.dtype in (torch.float16, torch.bfloat16) else out.logits[0]

    def keep(self, n_prefix: int, extra: list[int]) -> None:
        """Keep cache positions [0, n_prefix) plus n_prefix + e for e in `extra` (in that order)."""
        if extra == list(range(len(extra))):  # contiguous (chains, AR): a plain crop
            drop = self.length - n_prefix - len(extra)
            if drop > 0:
                self.cache.crop(-drop)
        else:
            index_K = torch.tensor(list(range(n_prefix)) + [n_prefix + e for e in extra], device=self.device)
            for layer in self.cache.layers:
                layer.keys = layer.keys.index_select(-2, index_K)
                layer.values = layer.values.index_select(-2, index_K)
        self.length = n_prefix + len(extra)


class Target:
    """Holds seq[:-1] in its KV cache; each round verifies [seq[-1]] + draft tree in one forward."""

    def __init__(self, model, tokenizer=None):
        if getattr(model.config, "is_encoder_decoder", False):
            raise CompatibilityError(f"target {model.config.model_type!r} is encoder-decoder; use a decoder-only LM")
        if model.config.model_type in SSM_MODEL_TYPES:
            raise CompatibilityError(
                f"target {model.config.model_type!r} has no attention KV cache; the harness verifies with "
                "Transformer targets (hybrid targets go through draftforge.decode.mamba2_tree)"
            )
        self.model, self.tokenizer = model, tokenizer
        self.lm = CachedLM(model)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_context = max_context(model.config)

    @property
    def device(self):
        return self.model.device

    def prefill(self, seq: list[int]) -> None:
        self.lm.reset()
        if len(seq) > 1:
            self.lm.forward(seq[:-1], last_only=True)

    def verify(self, last_token: int, tree: DraftTree) -> torch.Tensor:
        """Logits [1+N, V]: row 0 predicts depth-1 tokens, row 1+j predicts node j's children."""
        past = self._verify_start = self.lm.length
        positions = [past] + [past + d for d in tree.depths]
        mask = None  # a chain packs as a plain causal sequence
        if len(tree) and not tree.is_chain:
            anc_QQ = ancestor_matrix([-1] + [p + 1 for p in tree.parents])
            mask = packed_tree_mask(anc_QQ, past, self.model.dtype, self.device)
        return self.lm.forward([last_token] + tree.tokens, positions, mask)

    def commit(self, path: list[int]) -> None:
        """Keep the root token and the accepted nodes; the bonus token is fed next round."""
        self.lm.keep(self._verify_start, [0] + [1 + j for j in path])


def load_target(model_or_path, device="cpu", dtype=None, tokenizer=None) -> Target:
    """A Target from a HF decoder-only Transformer (model object or path); `.model`, `.tokenizer`."""
    model, found_tokenizer = load_hf_causal_lm(model_or_path, device, dtype, "target")
    return Target(model, tokenizer if tokenizer is not None else found_tokenizer)
