"""draftforge.decode: the lossless speculative decoding harness (batch size 1).

    target = load_target(path_or_model); drafter = load_drafter(path_or_model, target)   # cuda_graphs="auto"
    drafter = load_drafter("prompt-lookup", target)   # or "prompt-lookup:ngram=3,tokens=10": n-gram lookup, no model
    dec = build_decoder("tree", target, drafter, tree=(3, 2, 2, 1))     # the registry: decode/methods/__init__.py
    dec = build_decoder("tree", target, drafter, tree=parse_tree("stree13"))   # or any TreeShape
    res = dec.generate(ids, max_new_tokens=128, temperature=0.0)   # -> DecodeResult

A Mamba drafter's decode steps are CUDA graphs when load_drafter(..., cuda_graphs=) resolves to on
("auto": exactly when it is on CUDA; "on" off CUDA is an error); build_decoder takes the drafter as built.
"""

from draftforge.decode.base import DecodeResult, DecodeStats
from draftforge.decode.control import DEFAULT_UCB_TREES, Controller, FixedChain, FixedTree, NoDraft, UCBTree
from draftforge.decode.engine import SpeculativeDecoder
from draftforge.decode.loading import Drafter, PromptLookupDrafter, load_drafter, load_target
from draftforge.decode.methods import Method, MethodOptions, method_names, option, register_method
from draftforge.decode.methods import build as build_decoder
from draftforge.decode.plan import DraftStep, DynamicTree, StaticTree, StopRule, StoppableChain, TreeBuilder
from draftforge.decode.sampling import SamplingParams
from draftforge.decode.targets import KVCacheTarget, Target, Verification
from draftforge.decode.tree import DraftTree
from draftforge.decode.tree_shape import TREE_PRESETS, TreeShape, parse_tree

# Each method's module registers its methods and options on import, in this order: the order of METHODS
# and of eval's flags. No module above imports one of them.
from draftforge.decode.methods import core, hf_baselines, length_control, eagle2, c2t, eesd, lookup  # noqa: F401,I001
from draftforge.decode.methods.hf_baselines import HFAssistedDecoder, HFPromptLookupDecoder

METHODS = method_names()  # the built-in methods; register_method adds more

__all__ = [
    "METHODS", "DEFAULT_UCB_TREES", "Controller", "DecodeResult", "DecodeStats", "DraftStep", "DraftTree", "Drafter",
    "DynamicTree", "FixedChain", "FixedTree", "HFAssistedDecoder", "HFPromptLookupDecoder", "KVCacheTarget", "Method",
    "MethodOptions", "NoDraft", "PromptLookupDrafter", "SamplingParams", "SpeculativeDecoder", "StaticTree", "StopRule",
    "StoppableChain", "TREE_PRESETS", "Target", "TreeBuilder", "TreeShape", "UCBTree", "Verification", "build_decoder",
    "load_drafter", "load_target", "method_names", "option", "parse_tree", "register_method",
]


# Modules that moved after 0.1.0 (one home per method, sub-packages by role): their old names import the new modules,
# with a DeprecationWarning, until the next release.
from draftforge.deprecation import moved_modules  # noqa: E402

moved_modules({
    "draftforge.decode.core_methods": "draftforge.decode.methods.core",
    "draftforge.decode.eagle2": "draftforge.decode.methods.eagle2",
    "draftforge.decode.c2t": "draftforge.decode.methods.c2t",
    "draftforge.decode.early_exit": "draftforge.decode.methods.eesd",
    "draftforge.decode.length_control": "draftforge.decode.methods.length_control",
    "draftforge.decode.hf_baselines": "draftforge.decode.methods.hf_baselines",
    "draftforge.decode.drafter_base": "draftforge.decode.drafters.base",
    "draftforge.decode.drafter_mamba": "draftforge.decode.drafters.mamba",
    "draftforge.decode.drafter_hf": "draftforge.decode.drafters.transformer",
    "draftforge.decode.drafter_lookup": "draftforge.decode.drafters.lookup",
    "draftforge.decode.cuda_graphs": "draftforge.decode.drafters.cuda_graphs",
    "draftforge.decode.ssm_state": "draftforge.decode.drafters.ssm_state",
    "draftforge.decode.hybrid_target": "draftforge.decode.targets.hybrid",
    "draftforge.decode.mamba2_tree": "draftforge.decode.targets.stree",
})
