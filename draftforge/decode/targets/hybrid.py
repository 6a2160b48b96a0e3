"""SSM and hybrid (Mamba2 + attention) targets: a whole draft tree verified in one forward (STree §4).

During `verify` every Mamba2 mixer of the model is temporarily routed through the tree conv +
tree scan (``mamba2_tree.mixer_tree_forward``: Triton kernel on CUDA, reference elsewhere), reading
the conv/SSM states of the accepted prefix without writing them; attention layers see the packed
tree through a 4D tree mask and depth positions, and append K/V for all rows. `commit` keeps the
accepted path's K/V (compacted behind the prefix) and **replays** every Mamba2 layer's conv and SSM
state along the accepted path from the cached raw activations (``tree_scan_replay``): the prefix is
never re-encoded. Chains take the same path (a chain is a tree).

Legend: N tree rows (root = last committed token, then the draft nodes), V vocabulary, D hidden size,
Ch conv channels, K conv width, H heads, P head dim, S state size.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from draftforge.decode.memory import cache_bytes
from draftforge.decode.targets.stree import cache_states, mixer_tree_forward, replay_states
from draftforge.decode.targets import Target, Verification, check_prefill_chunk, max_context
from draftforge.decode.tree import DraftTree, ancestor_matrix, packed_tree_mask
from draftforge.errors import CompatibilityError
from draftforge.hfcompat import cache_kwargs, cache_param, passed_cache
from draftforge.kernels.tree_scan import MAX_KERNEL_NODES, pack_tree

# model_type -> what it is; the harness verifies trees on these (Mamba2 mixers + optional attention).
SUPPORTED_TYPES = {
    "mamba2": "Mamba2ForCausalLM (attention-free)",
    "bamba": "BambaForCausalLM (Mamba2 + attention)",
    "nemotron_h": "NemotronHForCausalLM (Mamba2 + attention + MLP blocks)",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM (Mamba2 + attention)",
    "zamba2": "Zamba2ForCausalLM (Mamba2 + shared attention blocks)",
}
# model_type -> why the harness refuses it (named in the error).
REFUSED_TYPES = {
    "mamba": "Mamba-1 layers have a per-channel A matrix; the tree scan needs Mamba2's scalar A per head "
             "(use a Mamba2 model, or a Mamba-1 model as a drafter)",
    "jamba": "Jamba's Mamba layers are Mamba-1 (per-channel A): the tree scan needs Mamba2's scalar A per head, "
             "and the harness has no Mamba-1 replay for chains either",
    "falcon_h1": "FalconH1 rescales its Mamba projections with µP multipliers (mup_vector) inside the mixer, "
                 "which the tree forward does not apply",
    "zamba": "Zamba (v1) uses Mamba-1 layers; the tree scan needs Mamba2",
}


def supported_list() -> str:
    return "; ".join(SUPPORTED_TYPES.values())


_NO_LIMIT = (0.0, float("inf"))  # transformers' default time_step_limit: softplus is >= 0, so nothing is clamped
_LIMIT_NOTED: set[int] = set()


def check_hybrid_model(model) -> None:
    """Refuse, at load, SSM/hybrid models the tree harness cannot verify losslessly (one message)."""
    model_type = model.config.model_type
    if model_type in REFUSED_TYPES:
        raise CompatibilityError(f"target {model_type!r} is not supported: {REFUSED_TYPES[model_type]}. "
                                 f"Supported SSM/hybrid targets: {supported_list()}.")
    if model_type not in SUPPORTED_TYPES:
        raise CompatibilityError(f"target {model_type!r} keeps recurrent state in layers the harness does not know; "
                                 f"supported SSM/hybrid targets: {supported_list()}; and any decoder-only Transformer.")
    mixers = find_mixers(model)
    if not mixers:
        raise CompatibilityError(f"target {model_type!r} has no Mamba2 mixer with the parts the tree scan reads "
                                 "(in_proj, conv1d, dt_bias, A_log, D, norm, out_proj)")
    for mixer in mixers.values():  # the tree forward replaces theirs: it must know where the cache arrives
        cache_param(mixer)
    limits = {tuple(float(v) for v in getattr(m, "time_step_limit", _NO_LIMIT)) for m in mixers.values()} - {_NO_LIMIT}
    if limits and id(model) not in _LIMIT_NOTED:
        _LIMIT_NOTED.add(id(model))
        import sys

        print(f"[draftforge] note: target {model_type!r} clamps its SSM time step to {sorted(limits)[0]}; every "
              "verification clamps it, as transformers' chunked scan does when it encodes a prompt, but "
              "transformers' one-token steps in generate() do not, so where the clamp binds greedy output can "
              "differ from generate() (docs/methods/stree.md)", file=sys.stderr)
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise CompatibilityError(f"a hybrid target runs in float32, bfloat16 or float16 (the tree scan's dtypes), "
                                 f"not {dtype}; load it in one of them")


def find_mixers(model) -> dict[int, torch.nn.Module]:
    """layer index -> Mamba2-style mixer (the modules whose sequence mixing the tree scan replaces)."""
    found = {}
    for module in model.modules():
        if all(hasattr(module, a) for a in ("A_log", "dt_bias", "conv1d", "in_proj", "out_proj", "layer_idx")):
            found[int(module.layer_idx)] = module
    return found


@dataclass
class VerifyCost:
    """What one verification computed and held (STree §4): rows through every layer, SSM states kept."""

    tokens: int  # rows fed (root + nodes); the unrolled alternative feeds #leaves * depth
    states: int  # recurrent states held per SSM layer; the unrolled alternative holds #leaves
    kernel: bool  # the Triton tree scan ran (else the PyTorch reference)


class HybridTarget(Target):
    """A transformers SSM / hybrid causal LM verified with the tree scan and rolled forward by replay."""

    def __init__(self, model, tokenizer=None, impl: str = "auto", prefill_chunk: int | None = None):
        check_hybrid_model(model)
        self.model, self.tokenizer, self.impl = model, tokenizer, impl
        self.prefill_chunk = check_prefill_chunk(prefill_chunk)
        self.mixers = find_mixers(model)
        self.conv_width = next(iter(self.mixers.values())).conv1d.weight.shape[-1]
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_context = max_context(model.config)
        self.ssm_only = model.config.model_type == "mamba2"
        self.ssm_layers, self.states_per_verify = len(self.mixers), 1  # one state per SSM layer, any tree
        self.costs: list[VerifyCost] = []
        self.notes: set[str] = set()
        self.reset()

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.length, self._scans, self.last = 0, {}, None

    def cache_bytes(self) -> int:
        return cache_bytes(self.cache)

    gives_features = True

    @torch.inference_mode()
    def _forward(self, tokens, positions, mask_11QK=None, hidden=False):
        """Run the model on `tokens` continuing the cache; logits [Q, V] (and last hidden [Q, D]); with feature
        layers asked for (want_features), their states of every token in `features_QA`."""
        layers = self.feature_layers
        kwargs = dict(input_ids=torch.tensor([tokens], device=self.device), use_cache=True,
                      output_hidden_states=hidden or bool(layers), **cache_kwargs(self.model, self.cache))
        if not self.ssm_only:
            kwargs.update(position_ids=torch.tensor([positions], device=self.device),
                          attention_mask=None if mask_11QK is None else
                          {"full_attention": mask_11QK, "linear_attention": None})
        out = self.model(**kwargs)
        self.features_QA = torch.cat([out.hidden_states[i][0] for i in layers], -1) if layers else None
        logits_QV = out.logits[0].float() if out.logits.dtype in (torch.float16, torch.bfloat16) else out.logits[0]
        return (logits_QV, out.hidden_states[-1][0]) if hidden else logits_QV

    def prefill(self, seq: list[int]) -> None:
        """Encode seq[:-1] with the model's own forward (its chunked scan), in one call or, with `prefill_chunk`,
        in calls of that many tokens, each continuing the cache the earlier ones filled (K/V, conv and SSM states:
        transformers' Mamba2 mixers start a multi-token scan from the cached state): fills K/V and every
        conv/SSM state."""
        self.reset()
        self.costs = []
        self._features = []
        prompt = seq[:-1]
        step = self.prefill_chunk or max(len(prompt), 1)
        for start in range(0, len(prompt), step):
            self._forward(prompt[start : start + step], list(range(start, min(start + step, len(prompt)))))
            self.length = min(start + step, len(prompt))
            if self.feature_layers is not None:
                self._features.append(self.features_QA)

    def verify(self, last_token: int, tree: DraftTree) -> torch.Tensor:
        parents_N = [-1] + [p + 1 for p in tree.parents]
        n_rows, past = len(parents_N), self.length
        packed = pack_tree(torch.tensor([parents_N]), 1, n_rows, self.conv_width, self.device)
        positions = [past] + [past + d for d in tree.depths]
        mask_11QK = None
        if not self.ssm_only:
            dtype = next(self.model.parameters()).dtype
            mask_11QK = packed_tree_mask(ancestor_matrix(parents_N), past, dtype, self.device)
        impl = self.impl
        if n_rows > MAX_KERNEL_NODES and impl != "ref":  # the kernel holds at most that many rows
            impl = "ref"
            self.notes.add(f"trees over {MAX_KERNEL_NODES} rows ran the reference tree scan (kernel limit)")
        with tree_mixers(self.mixers, packed, impl) as scans:
            out = self._forward([last_token] + tree.tokens, positions, mask_11QK, hidden=self.want_hidden)
        self._scans = scans
        logits_NV, hidden_ND = out if self.want_hidden else (out, None)
        self.last = Verification(tree, logits_NV, hidden_ND, features_NA=self.features_QA)
        kernel = impl == "triton" or (impl == "auto" and self.device.type == "cuda")
        self.costs.append(VerifyCost(tokens=n_rows, states=1, kernel=kernel))
        return logits_NV

    @torch.inference_mode()
    def commit(self, path: list[int]) -> None:
        """Keep root + path: compact attention K/V, replay every Mamba2 layer's states along the path."""
        last_row = 1 + path[-1] if path else 0  # the root (last committed token) is always kept
        for layer_idx, scan in self._scans.items():
            conv_BChK, ssm_BHPS = replay_states(scan, last_row, ssm_dtype=scan.ssm_state_BHPS.dtype)
            old_ssm = self.cache.layers[layer_idx].recurrent_states.get(0)
            conv_dtype = self.cache.layers[layer_idx].conv_states.get(0)
            conv_dtype = conv_dtype.dtype if conv_dtype is not None else scan.xBC_BNCh.dtype
            ssm_dtype = old_ssm.dtype if old_ssm is not None else torch.float32
            self.cache.update_conv_state(conv_BChK.to(conv_dtype), layer_idx, conv_kernel_size=self.conv_width)
            self.cache.update_recurrent_state(ssm_BHPS.to(ssm_dtype), layer_idx)
        keep_rows = [0] + [1 + j for j in path]
        index_K = torch.tensor(list(range(self.length)) + [self.length + r for r in keep_rows], device=self.device)
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = layer.keys.index_select(-2, index_K)
                layer.values = layer.values.index_select(-2, index_K)
        self.length += len(keep_rows)
        self._scans = {}
        self.last.path = list(path)
        if self.feature_layers is not None:
            self._features.append(self.last.features_NA[keep_rows])


@contextmanager
def tree_mixers(mixers: dict[int, torch.nn.Module], packed, impl: str):
    """Route each mixer's forward through the tree scan for one model call; yields {layer: scan cache}.

    The states are read from the cache the model passes in and never written (verification is
    side-effect free for the SSM layers; `commit` replays them). The cache arrives under the name the installed
    transformers' mixer signature gives it (`cache` from 5.24, `cache_params` before), read once per mixer here;
    a call under another name is refused rather than scanned from an empty state."""
    scans: dict = {}

    def make(layer_idx, mixer):
        name = cache_param(mixer)  # CompatibilityError if the signature names no cache

        def tree_forward(hidden_states, *args, **kwargs):
            cache = passed_cache(kwargs, name)
            if args or cache is None:  # a verification always hands the model its cache: a layer lost it on the way
                how = "positionally" if args else "without its cache"
                raise CompatibilityError(f"{type(mixer).__name__} of layer {layer_idx} was called {how}; the tree "
                                         f"forward reads the prefix's states from the keyword {name!r} and would "
                                         "otherwise scan from an empty state (a transformers version whose layers "
                                         "call their mixer another way)")
            conv, ssm = cache_states(cache, layer_idx) if _has_state(cache, layer_idx) else (None, None)
            out_BND, scans[layer_idx] = mixer_tree_forward(mixer, hidden_states, packed, conv, ssm, impl)
            return out_BND
        return tree_forward

    for layer_idx, mixer in mixers.items():
        mixer.forward = make(layer_idx, mixer)  # instance attribute shadows the class forward
    try:
        yield scans
    finally:
        for mixer in mixers.values():
            del mixer.forward


def _has_state(cache, layer_idx: int) -> bool:
    if cache is None:
        return False
    layer = cache.layers[layer_idx]
    return bool(getattr(layer, "is_recurrent_states_initialized", {}).get(0))
