"""draftforge.eval: prompt sets, metrics, manifest and report writers behind `draftforge eval`."""

from draftforge.eval.runner import EvalConfig, SelfCheckError, run_eval

__all__ = ["EvalConfig", "SelfCheckError", "run_eval"]
