"""Tests of draftforge/eval: run_eval, prompts, metrics, the cost model, memory over long runs."""
