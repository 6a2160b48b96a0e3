"""A decoding forward for Llama models without transformers' per-layer Python, with fused projections.

A decoding step of SmolLM2-135M in bf16 on one CPU thread spends ~11.6 ms in its 211 linear products and ~5 ms in
everything else, part of it Python: per layer, transformers' forward goes through several module calls, kwarg
plumbing and decorators (deprecated-argument checks, output capture) around a handful of tiny tensor operations.
`LeanForward` runs the same tensor operations in the same order, with three changes that alter no number:

- the layers are walked by one plain loop (no per-layer module-call plumbing, no kwargs dictionaries);
- the attention function, the causal mask and the rotary cos / sin are looked up or made once per forward, as
  the model's own forward does;
- where the linears are oneDNN-packed (decode/packing.py), q / k / v become one product and gate / up another,
  on a packed copy of the stacked weights: per layer 5 products instead of 7 (on SmolLM2, 47 -> 25 us for q / k
  / v and 69 -> 52 us for gate / up). A fused product is kept only where it equals the separate products bitwise
  on probe inputs of 1, 5 and `FAST_ROWS` rows (checked per layer, at build).

It covers forwards of up to `FAST_ROWS` tokens (a decoding step, a verified chain or tree); a prompt's prefill,
where Python is a negligible share, goes through the model's own forward. `lean_forward(model)` builds it only for
the Llama architecture it was written against, and only after a probe decode (a short prompt, one token, a chain
and a tree, keeping two layers' input states) gave logits and states bitwise equal to the model's own forward; otherwise it
says why and the model keeps its forward. A forward also goes through the model's own code while anyone but
transformers has forward hooks on the model, its decoder or a layer (they expect to be called). Measured:
docs/results/serving.md ("A leaner decoding forward").

Legend: Q query tokens, D hidden size, H heads, Hkv KV heads, d head dim.
"""

from __future__ import annotations

import inspect
import weakref

import torch
from torch import nn

from draftforge.decode.packing import PackedLinear
from draftforge.kernels.attention import rotate

FAST_ROWS = 64  # as the decode attention's fast path: above it (a prompt) the model's own forward runs
ARCHITECTURES = {"LlamaForCausalLM": ("LlamaDecoderLayer", "LlamaAttention", "LlamaMLP", "LlamaRMSNorm")}
PROBE_ROWS = (1, 5, FAST_ROWS)


def _rms(norm, h):
    """LlamaRMSNorm.forward's operations, in its order."""
    dtype = h.dtype
    x = h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x.to(dtype)


def _fused(linears: list[nn.Module]):
    """A packed copy of the stacked weights of `linears` (PackedLinear with equal dtypes) and the output widths,
    or None where the stacked product differs from the separate ones on a probe (or they are not packed)."""
    if not all(isinstance(m, PackedLinear) and m.packed is not None for m in linears):
        return None
    weight = torch.cat([m.weight.detach() for m in linears])
    biases = [m.bias for m in linears]
    if any(b is not None for b in biases) and not all(b is not None for b in biases):
        return None
    bias = torch.cat([b.detach() for b in biases]) if biases[0] is not None else None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
    except RuntimeError:
        return None
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in PROBE_ROWS:
            x = torch.randn(1, rows, weight.shape[1], generator=gen).to(weight.dtype)
            together = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
            if not torch.equal(together, torch.cat([m(x) for m in linears], -1)):
                return None
    return packed, bias, [m.out_features for m in linears]


class _Layer:
    """One decoder layer's modules and, where they stayed bitwise equal, its fused products."""

    def __init__(self, layer):
        self.attn, self.mlp = layer.self_attn, layer.mlp
        self.norm1, self.norm2 = layer.input_layernorm, layer.post_attention_layernorm
        self.head_dim, self.index = self.attn.head_dim, self.attn.layer_idx
        self.qkv = _fused([self.attn.q_proj, self.attn.k_proj, self.attn.v_proj])
        self.gate_up = _fused([self.mlp.gate_proj, self.mlp.up_proj])

    def projections(self, x, fused, modules):
        if fused is None:
            return [m(x) for m in modules]
        packed, bias, widths = fused
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "").split(widths, -1)


class LeanForward:
    """The model's forward for up to FAST_ROWS tokens, bitwise equal to it (see the module doc)."""

    def __init__(self, model):
        self._model = weakref.ref(model)  # a deep copy of the model does not carry this (see __deepcopy__)
        inner = model.model
        self.dtype, self.device = model.lm_head.weight.dtype, model.lm_head.weight.device
        self.layers = [_Layer(layer) for layer in inner.layers[: model.config.num_hidden_layers]]
        self._layer_modules = list(inner.layers[: model.config.num_hidden_layers])
        groups = [g for layer in self.layers for g in (layer.qkv, layer.gate_up) if g is not None]
        self.fused = len(groups)
        # the stacked weights' packed copies (both groups read the hidden state: [sum of widths, D])
        self.extra_bytes = sum(sum(g[2]) * inner.config.hidden_size * self.dtype.itemsize for g in groups)
        from transformers.masking_utils import create_causal_mask

        self._mask_fn = create_causal_mask
        params = inspect.signature(create_causal_mask).parameters
        self._mask_cache = next(n for n in ("cache", "past_key_values") if n in params)
        self._mask_embeds = next(n for n in ("inputs_embeds", "input_embeds") if n in params)
        self._mask_position = "cache_position" in params

    def __deepcopy__(self, memo):
        return None  # bound to one model object and its packed weights: a copy (the self-check's) runs its own

    def applies(self, model, rows: int) -> bool:
        """A forward of `rows` tokens of `model` may run here: the model it was built for, still in eval mode, in the
        dtype and on the device its fused products were packed for, and not watched by hooks."""
        weight = model.lm_head.weight
        return (rows <= FAST_ROWS and self._model() is model and weight.dtype == self.dtype
                and weight.device == self.device and not model.training and not self._watched(model))

    def _watched(self, model) -> bool:
        """Forward hooks on the model, its decoder or a layer (or torch's global ones) that are not transformers'
        own output capture (idle unless its forward is asked for hidden states): whoever registered them expects
        the model's own forward to run, which calls them; this loop would not."""
        from torch.nn.modules import module as torch_module

        hooks = [*torch_module._global_forward_hooks.values(), *torch_module._global_forward_pre_hooks.values()]
        for m in (model, model.model, *self._layer_modules):
            if m._forward_hooks or m._forward_pre_hooks:
                hooks += [*m._forward_hooks.values(), *m._forward_pre_hooks.values()]
        return any(not getattr(h, "__module__", "").startswith("transformers.") for h in hooks)

    @torch.inference_mode()
    def __call__(self, model, input_ids_1Q, position_ids_1Q, cache_position_Q, cache, mask=None,
                 logits_to_keep: int = 0, keep: list[int] | None = None, hidden: bool = False):
        """(logits [1, Q or logits_to_keep, V], the final normed state [1, Q, D] if `hidden`, {i: the state
        entering layer i} for i in `keep`); the cache gets the tokens' K / V as in the model's forward."""
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.llama.modeling_llama import eager_attention_forward

        inner = model.model
        h = inner.embed_tokens(input_ids_1Q)
        mask_args = {"config": inner.config, self._mask_embeds: h, "attention_mask": mask, self._mask_cache: cache,
                     "position_ids": position_ids_1Q}
        if self._mask_position:
            mask_args["cache_position"] = cache_position_Q
        causal = self._mask_fn(**mask_args)
        cos, sin = inner.rotary_emb(h, position_ids=position_ids_1Q)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(inner.config._attn_implementation, eager_attention_forward)
        b, q = input_ids_1Q.shape
        kept = {}
        for i, layer in enumerate(self.layers):
            if keep and i in keep:
                kept[i] = h
            attn, d = layer.attn, layer.head_dim
            x = _rms(layer.norm1, h)
            qs, ks, vs = layer.projections(x, layer.qkv, (attn.q_proj, attn.k_proj, attn.v_proj))
            qs = rotate(qs.view(b, q, -1, d).transpose(1, 2), cos, sin)
            ks = rotate(ks.view(b, q, -1, d).transpose(1, 2), cos, sin)
            ks, vs = cache.update(ks, vs.view(b, q, -1, d).transpose(1, 2), layer.index)
            out, _ = attention(attn, qs, ks, vs, causal, dropout=0.0, scaling=attn.scaling)
            h = h + attn.o_proj(out.reshape(b, q, -1).contiguous())
            x = _rms(layer.norm2, h)
            gate, up = layer.projections(x, layer.gate_up, (layer.mlp.gate_proj, layer.mlp.up_proj))
            h = h + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)
        h = _rms(inner.norm, h)
        logits = model.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h)
        return logits, (h if hidden else None), kept

    def describe(self) -> str:
        return (f"decoding forward: lean (up to {FAST_ROWS} tokens; {self.fused} of {2 * len(self.layers)} "
                f"projection groups fused, +{self.extra_bytes / 2**20:.0f} MiB)")


def lean_unavailable(model) -> str | None:
    """Why `model` keeps its own decoding forward (None when LeanForward's architecture check passes)."""
    names = ARCHITECTURES.get(type(model).__name__)
    if names is None:
        return f"{type(model).__name__} (the lean forward covers {', '.join(ARCHITECTURES)})"
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not layers:
        return "no decoder layers found"
    layer = layers[0]
    found = (type(layer).__name__, type(layer.self_attn).__name__, type(layer.mlp).__name__,
             type(layer.input_layernorm).__name__)
    if found != names:
        return f"layers built from {', '.join(found)} (written for {', '.join(names)})"
    if model.training:
        return "the model is in training mode (dropout)"
    return None


def _probe(model, lean: LeanForward) -> str | None:
    """Decode a short random prompt with both forwards, fresh caches each: None when every logit and state is
    bitwise equal, else what differed."""
    from transformers import DynamicCache

    from draftforge.decode.targets import LayerInputs
    from draftforge.decode.tree import ancestor_matrix, packed_tree_mask
    from draftforge.hfcompat import cache_kwargs

    device = model.lm_head.weight.device
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    keep = [0, len(lean.layers) // 2]
    caches = [DynamicCache(config=model.config), DynamicCache(config=model.config)]
    prompt = torch.randint(vocab, (1, 9), generator=gen).to(device)
    with torch.inference_mode():
        for cache in caches:  # the prompt through the model's own forward (as the target's prefill)
            model(input_ids=prompt, use_cache=True, **cache_kwargs(model, cache))
        past = prompt.shape[1]
        steps = [(1, None), (4, None), (5, [-1, 0, 0, 1, 3])]  # a token, a chain, a tree (parents)
        for rows, parents in steps:
            ids = torch.randint(vocab, (1, rows), generator=gen).to(device)
            if parents is None:
                positions, mask = list(range(past, past + rows)), None
            else:
                depth = [0] * rows
                for j, p in enumerate(parents[1:], 1):
                    depth[j] = depth[p] + 1
                positions = [past + d for d in depth]
                mask = packed_tree_mask(ancestor_matrix(parents), past, model.dtype, device)
            pos = torch.tensor([positions], device=device)
            cache_position = torch.arange(past, past + rows, device=device)
            with LayerInputs(model.model.layers, keep) as states:
                theirs = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=True,
                               output_hidden_states=True, **cache_kwargs(model, caches[0]))
            logits, final, kept = lean(model, ids, pos, cache_position, caches[1], mask, 0, keep, True)
            if not torch.equal(logits, theirs.logits):
                return f"logits differ on a {rows}-token step"
            if not torch.equal(final, theirs.hidden_states[-1]):
                return f"the final state differs on a {rows}-token step"
            if any(not torch.equal(kept[i], states.found[i]) for i in keep):
                return f"a layer's input state differs on a {rows}-token step"
            for cache in caches:  # back to the prompt, as a target does after a round
                cache.crop(-rows)
    return None


def lean_forward(model) -> tuple[LeanForward | None, str]:
    """(LeanForward, what was done) for `model`, or (None, why not): the architecture check, then the probe."""
    why = lean_unavailable(model)
    if why is not None:
        return None, f"decoding forward: the model's own ({why})"
    lean = LeanForward(model)
    try:
        differs = _probe(model, lean)
    except Exception as exc:  # noqa: BLE001 — any failure of the probe means: keep the model's own forward
        differs = f"the probe failed: {type(exc).__name__}: {exc}"
    if differs is not None:
        return None, f"decoding forward: the model's own (the lean forward was not bitwise equal: {differs})"
    return lean, lean.describe()
