"""The transformers API names draftforge depends on, decided once from the installed package's signatures.

transformers 5.24 renamed the cache argument of every model, decoder layer and mixer forward to `cache`
(Llama's `past_key_values`, Mamba / Mamba2's `cache_params`; the old names are deprecated aliases until 5.40,
with a warning) and the output field to `.cache`. Code that calls a forward names the argument with
`cache_kwargs`; code that *replaces or hooks* a forward, and so receives whatever name transformers passes,
reads it with `passed_cache` after `cache_param` has checked, once per forward, that the signature has one.

transformers 5.25 made `from_pretrained` kernelize every model by default: on CUDA, ROCm and XPU it swaps layers
(RMSNorm, activations, RoPE, the Mamba scans) for kernels fetched from the Hugging Face Hub at load time, and it
refuses to load at all without the `kernels` package. draftforge loads with `NO_HUB_KERNELS`: nothing is
downloaded, and a model computes the PyTorch functions that draftforge's own steps (the Mamba2 step, the
tree-scan kernel, the EESD trunk) are tested against. Releases before 5.25 take the same argument (default off).
"""

from __future__ import annotations

import functools
import inspect

from draftforge.errors import CompatibilityError

NO_HUB_KERNELS = {"use_kernels": False}  # from_pretrained keyword arguments; see the module docstring

# newest first: the name a forward takes is the first of these in its signature
CACHE_NAMES = ("cache", "past_key_values", "cache_params")


@functools.lru_cache(maxsize=None)
def _cache_param_of(forward) -> str | None:
    params = inspect.signature(forward).parameters  # follows __wrapped__ through deprecate_kwarg
    return next((name for name in CACHE_NAMES if name in params), None)


def cache_param(module_or_forward) -> str:
    """The name of the cache argument of a module's forward (or of a function), read from its signature.

    Raises CompatibilityError when the signature has none of the known names: a forward draftforge replaces
    would otherwise receive the cache under a name it does not read and silently run from an empty state."""
    forward = module_or_forward
    if hasattr(module_or_forward, "forward"):  # a module: its class's forward (an instance override is ours)
        forward = type(module_or_forward).forward
    name = _cache_param_of(forward)
    if name is None:
        raise CompatibilityError(f"{getattr(forward, '__qualname__', forward)} takes none of the cache arguments "
                                 f"draftforge knows ({', '.join(CACHE_NAMES)}): this transformers version is not "
                                 "supported (see the README's tested range)")
    return name


def cache_kwargs(module, cache) -> dict:
    """{name: cache} for calling `module` (a model, decoder layer or mixer) with this transformers."""
    return {cache_param(module): cache}


def passed_cache(kwargs: dict, name: str):
    """The cache a hooked or replaced forward received under `name` (from `cache_param`); an argument passed
    under another known name means the installed transformers calls the forward differently than its own
    signature says, which is refused rather than read as "no cache"."""
    others = [n for n in CACHE_NAMES if n != name and n in kwargs]
    if others:
        raise CompatibilityError(f"the forward was called with {others[0]!r} where its signature names {name!r}")
    return kwargs.get(name)


def output_cache(out):
    """The cache a forward returned (`.cache` from transformers 5.24, `.past_key_values` / `.cache_params`
    before)."""
    for name in CACHE_NAMES:
        cache = getattr(out, name, None)
        if cache is not None:
            return cache
    return None


@functools.lru_cache(maxsize=None)
def assisted_generation_rolls_back_ssm() -> bool:
    """Whether transformers' assisted generation can run an SSM (Mamba / Mamba2) model as the assistant.

    Rejected drafts must be taken back out of the assistant's cache. A KV cache is cut; an SSM state cannot be, so
    from 5.25 transformers records the recurrent state after each drafted token while drafting
    (`activate_past_recording(recurrent_states_to_keep=...)`) and crops back to one of them. Before, it could not."""
    from transformers import cache_utils

    layer = getattr(cache_utils, "LinearAttentionLayer", None)
    if layer is None:
        return False
    return "recurrent_states_to_keep" in inspect.signature(layer.activate_past_recording).parameters
