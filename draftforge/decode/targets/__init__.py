"""Targets: the `Target` interface, and its KV-cache Transformer implementation (the cache is trimmed
to the accepted prefix after each round; a tree is verified in one forward with a packed tree, a 4D
mask and depth positions).

Legend: Q query tokens, N tree rows (1 + nodes), V vocabulary, D hidden size, L tokens in the KV cache.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from transformers import DynamicCache

from draftforge import argcheck
from draftforge.decode.memory import cache_bytes
from draftforge.decode.targets.growing_cache import growing
from draftforge.decode.tree import DraftTree, ancestor_matrix, packed_tree_mask
from draftforge.errors import CompatibilityError
from draftforge.hfcompat import cache_kwargs, output_cache

SSM_MODEL_TYPES = ("mamba", "mamba2")
HYBRID_MODEL_TYPES = ("bamba", "nemotron_h", "granitemoehybrid", "falcon_h1", "zamba", "zamba2", "jamba",
                      "lfm2", "qwen3_next", "plamo2")


def max_context(config) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def decoder_layers(model):
    """The model's list of decoder layers (`model.model.layers`, the Llama-family layout), or None."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return layers if isinstance(layers, torch.nn.ModuleList) and len(layers) else None


class LayerInputs:
    """Keep the hidden states entering chosen decoder layers (HF's hidden_states[i]) during one forward, by a
    forward pre-hook on each: the other layers' states are never gathered (output_hidden_states would return all
    L + 1 of them, +240 MiB at 7.6k tokens on SmolLM2, to keep three)."""

    def __init__(self, layers, ids: list[int]):
        self.found: dict[int, torch.Tensor] = {}
        self.handles = [layers[i].register_forward_pre_hook(self._hook(i), with_kwargs=True) for i in ids]

    def _hook(self, i):
        def keep(module, args, kwargs):
            self.found[i] = args[0] if args else kwargs["hidden_states"]

        return keep

    def __enter__(self) -> "LayerInputs":
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()


class CachedLM:
    """A causal LM plus a DynamicCache that can be extended, fed packed trees, and trimmed.

    `grow` (default True): full-attention layers keep their K/V in a buffer with spare rows (growing_cache.py), so
    a forward appends its rows in place instead of copying the whole cache with torch.cat; same logits."""

    def __init__(self, model, grow: bool = True):
        self.model = model
        self.device = model.device
        self.grow = grow
        self.layers = decoder_layers(model)  # where feature layers are kept by hooks (None: output_hidden_states)
        self.lean = getattr(model, "draftforge_lean", None)  # decode/lean_forward.py, set at load where it applies
        self.reset()

    def reset(self) -> None:
        cache = DynamicCache(config=self.model.config)
        self.cache = growing(cache) if self.grow else cache
        self.length = 0  # tokens whose K/V are in the cache
        self.features_QA = None

    @torch.inference_mode()
    def forward(self, tokens: list[int], positions: list[int] | None = None, mask_11QK=None,
                last_only: bool = False, hidden: bool = False, layers: list[int] | None = None):
        """Append `tokens` to the cache and return their logits [Q, V] (float32 or wider); with
        `last_only`, only the last token's [1, V] (a prompt's T x V logits would be computed for nothing);
        with `hidden`, (logits, last hidden state [Q, D]) (the state after the final norm); with `layers`, the
        states entering those layers (HF hidden_states[i]) of every token, concatenated, in `features_QA`."""
        q = len(tokens)
        cache_position_Q = torch.arange(self.length, self.length + q, device=self.device)
        position_ids_1Q = cache_position_Q[None] if positions is None else torch.tensor([positions], device=self.device)
        if self.lean is not None and self.lean.applies(self.model, q):  # a decoding step: the same logits, faster
            logits, final, kept = self.lean(self.model, torch.tensor([tokens], device=self.device), position_ids_1Q,
                                            cache_position_Q, self.cache, mask_11QK, 1 if last_only else 0, layers,
                                            hidden)
            self.features_QA = torch.cat([kept[i][0] for i in layers], -1) if layers else None
            self.length += q
            logits_QV = logits[0].float() if logits.dtype in (torch.float16, torch.bfloat16) else logits[0]
            return (logits_QV, final[0]) if hidden else logits_QV
        hooked = bool(layers) and not hidden and self.layers is not None
        with LayerInputs(self.layers, layers) if hooked else contextlib.nullcontext() as kept:
            out = self.model(
                input_ids=torch.tensor([tokens], device=self.device),
                position_ids=position_ids_1Q,
                cache_position=cache_position_Q,
                attention_mask=mask_11QK,
                use_cache=True,
                logits_to_keep=1 if last_only else 0,
                output_hidden_states=hidden or (bool(layers) and not hooked),
                **cache_kwargs(self.model, self.cache),
            )
        states = kept.found if hooked else out.hidden_states
        self.features_QA = torch.cat([states[i][0] for i in layers], -1) if layers else None
        self.cache = output_cache(out)
        self.length += q
        logits_QV = out.logits[0].float() if out.logits.dtype in (torch.float16, torch.bfloat16) else out.logits[0]
        return (logits_QV, out.hidden_states[-1][0]) if hidden else logits_QV

    def keep(self, n_prefix: int, extra: list[int]) -> None:
        """Keep cache positions [0, n_prefix) plus n_prefix + e for e in `extra` (in that order)."""
        if extra == list(range(len(extra))):  # contiguous (chains, AR): a plain crop
            drop = self.length - n_prefix - len(extra)
            if drop > 0:
                self.cache.crop(-drop)
        else:
            extra_K = torch.tensor(extra, device=self.device)
            index_K = None
            for layer in self.cache.layers:
                if hasattr(layer, "keep_rows"):  # a GrowingLayer: moves the kept rows after the prefix, nothing else
                    layer.keep_rows(n_prefix, extra_K)
                    continue
                if index_K is None:
                    index_K = torch.cat([torch.arange(n_prefix, device=self.device), n_prefix + extra_K])
                layer.keys = layer.keys.index_select(-2, index_K)
                layer.values = layer.values.index_select(-2, index_K)
        self.length = n_prefix + len(extra)


@dataclass
class Verification:
    """What the last `verify` produced; `path` is filled in by `commit`. Drafters bound to the target read it."""

    tree: DraftTree
    logits_NV: torch.Tensor  # row 0 predicts depth-1 tokens, row 1+j node j's children
    hidden_ND: torch.Tensor | None = None  # last hidden state per row, when a method asked (want_hidden)
    path: list[int] | None = None
    features_NA: torch.Tensor | None = None  # the feature layers' states per row, when a drafter asked for them


class Target(ABC):
    """The model being sped up: holds the committed prefix and verifies a whole draft tree per round.

    `verify` scores [last committed token] + the tree in one forward and returns logits [1+N, V];
    with `want_hidden` set (by a drafter or controller that needs them) it also keeps the last
    hidden state of every row in `last.hidden_ND`, at no cost otherwise. `commit(path)` keeps the
    accepted root path; the bonus token is fed by the next round's verify.

    Feature layers (drafters that read the target, EAGLE-3): after `want_features(layers)` the target keeps the
    states entering those layers (concatenated, [A]) of every token it commits, prompt included, in order; the
    drafter takes the ones it has not seen with `take_features()`. A target that cannot give them says so there.
    """

    model = None
    tokenizer = None
    vocab_size: int
    max_context: int | None
    want_hidden = False
    last: Verification | None = None
    feature_layers: list[int] | None = None
    gives_features: ClassVar[bool] = False  # implements want_features / take_features
    _features: list[torch.Tensor]

    def want_features(self, layers: list[int]) -> None:
        """Keep the states entering `layers` of every committed token (from the next prefill on)."""
        if not self.gives_features:
            raise CompatibilityError(f"{type(self).__name__} cannot hand its layers' hidden states to a drafter; a "
                                     "drafter that reads the target (EAGLE-3) needs a KV-cache Transformer target")
        num_layers = self.model.config.num_hidden_layers
        bad = [i for i in layers if not 0 <= i < num_layers]
        if bad:
            raise CompatibilityError(f"feature layers {bad} are outside the target's 0..{num_layers - 1}")
        if self.feature_layers is not None and list(layers) != self.feature_layers:
            raise CompatibilityError(f"the target already hands layers {self.feature_layers} to a drafter; one "
                                     f"target serves one feature-reading drafter (asked for {list(layers)})")
        self.feature_layers = list(layers)
        self._features = []

    def take_features(self) -> torch.Tensor | None:
        """The feature rows [m, A] of the tokens committed since the last call (None when there are none)."""
        rows, self._features = getattr(self, "_features", []), []
        if not rows:
            return None
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    @property
    def device(self):
        return self.model.device

    def cache_bytes(self) -> int | None:
        """Bytes of context state held now (KV cache rows, SSM states); None where a target does not say."""
        return None

    @abstractmethod
    def prefill(self, seq: list[int]) -> None:
        """Start a prompt: encode seq[:-1] (seq[-1] is fed by the first verify)."""

    @abstractmethod
    def verify(self, last_token: int, tree: DraftTree) -> torch.Tensor:
        """Logits [1+N, V] of last_token followed by the packed tree; sets `last`."""

    @abstractmethod
    def commit(self, path: list[int]) -> None:
        """Keep the accepted nodes (root path, depth 1 first) of the last verified tree."""


class KVCacheTarget(Target):
    """A HF decoder-only Transformer: KV cache trimmed to the accepted path, a tree verified in one
    forward with a tree attention mask and depth positions."""

    gives_features = True

    def __init__(self, model, tokenizer=None, prefill_chunk: int | None = None):
        check_target_model(model)
        self.prefill_chunk = check_prefill_chunk(prefill_chunk)
        self.model, self.tokenizer = model, tokenizer
        self.lm = CachedLM(model)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_context = max_context(model.config)

    def cache_bytes(self) -> int:
        return cache_bytes(self.lm.cache)

    def prefill(self, seq: list[int]) -> None:
        """Encode seq[:-1] in one forward, or in forwards of `prefill_chunk` tokens each (each chunk attends to
        the cache the earlier ones filled: the same K/V and logits within the dtype's rounding, and a chunk's
        attention scores are chunk x context instead of context x context)."""
        self.lm.reset()
        self.last = None
        if self.feature_layers is not None:
            self._features = []
        prompt = seq[:-1]
        step = self.prefill_chunk or len(prompt)
        for start in range(0, len(prompt), max(step, 1)):
            self.lm.forward(prompt[start:start + step], last_only=True, layers=self.feature_layers)
            if self.feature_layers is not None:
                self._features.append(self.lm.features_QA)

    def verify(self, last_token: int, tree: DraftTree) -> torch.Tensor:
        past = self._verify_start = self.lm.length
        positions = [past] + [past + d for d in tree.depths]
        mask = None  # a chain packs as a plain causal sequence
        if len(tree) and not tree.is_chain:
            anc_QQ = ancestor_matrix([-1] + [p + 1 for p in tree.parents])
            mask = packed_tree_mask(anc_QQ, past, self.model.dtype, self.device)
        out = self.lm.forward([last_token] + tree.tokens, positions, mask, hidden=self.want_hidden,
                              layers=self.feature_layers)
        logits_NV, hidden_ND = out if self.want_hidden else (out, None)
        self.last = Verification(tree, logits_NV, hidden_ND, features_NA=self.lm.features_QA)
        return logits_NV

    def commit(self, path: list[int]) -> None:
        rows = [0] + [1 + j for j in path]
        self.lm.keep(self._verify_start, rows)
        self.last.path = list(path)
        if self.feature_layers is not None:
            self._features.append(self.last.features_NA[rows])


def check_prefill_chunk(chunk: int | None) -> int | None:
    return argcheck.check_prefill_chunk(chunk, "prefill_chunk", CompatibilityError)


# Model types whose layers keep recurrent state: the KV-cache target cannot roll them back.
RECURRENT_LAYER_TYPES = ("mamba", "mamba2", "linear_attention", "hybrid", "conv", "recurrent")


def is_recurrent_model(config) -> bool:
    """True for models with layers that keep recurrent (SSM / linear-attention) state."""
    layer_types = set(getattr(config, "layer_types", None) or [])
    return (config.model_type in SSM_MODEL_TYPES or config.model_type in HYBRID_MODEL_TYPES
            or bool(layer_types & set(RECURRENT_LAYER_TYPES)))


def attention_layer_kinds(config) -> list[str]:
    """The kind of KV cache each layer of `config` gets from transformers' DynamicCache ("full_attention",
    "sliding_attention", "chunked_attention", ...), read the way DynamicCache reads it."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        return list(get_layer_types_and_kwargs(config)[0])
    except (ImportError, AttributeError, TypeError):  # a transformers without it: the config fields it reads
        kinds = getattr(config, "layer_types", None)
        if kinds:
            return list(kinds)
        windowed = getattr(config, "sliding_window", None) is not None
        return ["sliding_attention" if windowed else "full_attention"] * int(config.num_hidden_layers)


def check_full_attention(config, what: str) -> None:
    """Refuse a model whose cache drops old keys (sliding-window or chunked attention layers): its rollback after a
    rejected draft and its tree masks assume every layer holds every past position, so chain decoding raised in
    transformers' crop and trees in a mask of the wrong width."""
    other = [k for k in attention_layer_kinds(config) if k != "full_attention"]
    if other:
        window = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)
        raise CompatibilityError(
            f"{what} {config.model_type!r} has {len(other)} {other[0]} layer(s)"
            + (f" (window {window})" if window else "") + "; draftforge's KV-cache rollback and tree masks need "
            "full-attention layers: when every prompt and answer fits in the window, load the model with the window "
            "off (config.sliding_window = None, the same outputs), else use a full-attention model")


def check_target_model(model) -> None:
    """Refuse, at load, models the KV-cache target cannot verify losslessly (one message naming what to use)."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise CompatibilityError(f"target {config.model_type!r} is encoder-decoder; use a decoder-only LM")
    if is_recurrent_model(config):
        raise CompatibilityError(
            f"target {config.model_type!r} keeps recurrent (SSM) state, which a KV cache cannot roll back; "
            "load it with load_target (it picks the tree-scan HybridTarget, draftforge.decode.targets.hybrid)"
        )
    check_full_attention(config, "target")
