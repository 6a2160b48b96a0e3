"""draftforge: train speculative-decoding drafters and measure what they are worth.

The public API is the table PUBLIC below, documented with an example each in docs/api.md:

    from draftforge import load_target, load_drafter, build_decoder

Each name is imported from its home module on first use, so `import draftforge` stays light (no torch).
Names not in the table (submodules included) are internal and may move; moved ones keep a deprecated alias
for one release (draftforge/deprecation.py).
"""

__version__ = "0.1.0"

# public name -> "home module:attribute". docs/api.md and tests/toplevel/test_api.py follow this table; the layer
# test (tests/toplevel/test_layers.py) counts it as the top layer: no module of the package imports through it.
PUBLIC = {
    # decoding: a target, a drafter, a decoder for a method (the decode package registers every built-in method)
    "load_target": "draftforge.decode:load_target",
    "load_drafter": "draftforge.decode:load_drafter",
    "build_decoder": "draftforge.decode:build_decoder",
    "Drafter": "draftforge.decode:Drafter",
    "speculative_generate": "draftforge.decode.hf_generate:speculative_generate",
    # what decoding takes and gives
    "SamplingParams": "draftforge.decode:SamplingParams",
    "TreeShape": "draftforge.decode:TreeShape",
    "parse_tree": "draftforge.decode:parse_tree",
    "DecodeResult": "draftforge.decode:DecodeResult",
    "DecodeStats": "draftforge.decode:DecodeStats",
    "DraftTree": "draftforge.decode:DraftTree",
    "Verification": "draftforge.decode:Verification",
    # the method registry
    "register_method": "draftforge.decode:register_method",
    "Method": "draftforge.decode:Method",
    "MethodOptions": "draftforge.decode:MethodOptions",
    "option": "draftforge.decode:option",
    "method_names": "draftforge.decode:method_names",
    # the task registry and what a task's builder returns
    "register_task": "draftforge.tasks:register_task",
    "get_task": "draftforge.tasks:get_task",
    "task_names": "draftforge.tasks:task_names",
    "TaskSpec": "draftforge.train.spec:TaskSpec",
    # evaluation
    "run_eval": "draftforge.eval.runner:run_eval",
    "EvalConfig": "draftforge.eval.config:EvalConfig",
    # errors: every user error is a DraftforgeError
    "DraftforgeError": "draftforge.errors:DraftforgeError",
    "RecipeError": "draftforge.errors:RecipeError",
    "DataError": "draftforge.errors:DataError",
    "CheckpointError": "draftforge.errors:CheckpointError",
    "CompatibilityError": "draftforge.errors:CompatibilityError",
}

__all__ = list(PUBLIC)


def __getattr__(name: str):
    spec = PUBLIC.get(name)
    if spec is None:
        raise AttributeError(f"module 'draftforge' has no attribute {name!r}")
    from importlib import import_module

    module, _, attr = spec.partition(":")
    value = getattr(import_module(module), attr)
    globals()[name] = value  # looked up once
    return value


def __dir__():
    return sorted({*globals(), *PUBLIC})
