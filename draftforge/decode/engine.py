"""The speculative decoding loop: one loop, pluggable drafter / target / verifier / controller.

Batch size is 1: `generate` takes one prompt (list of ids); a batch (nested list or 2D tensor)
raises a DraftforgeError — run prompts one after another. Rounds: the controller picks a
configuration, the drafter proposes a tree, the target scores it in one forward, the verifier
returns the accepted root path plus one token, target and drafter roll back to that prefix.

`Decoder` is what every method's decoder is (this loop, and transformers' baselines in hf_baselines.py):
one `generate` signature, its sampling keywords read into one SamplingParams.
"""

from __future__ import annotations

import time
import warnings
from abc import ABC, abstractmethod

import torch

from draftforge.decode.base import DecodeResult, DecodeStats
from draftforge.decode.control import Controller, Round
from draftforge.decode.drafters.base import Drafter
from draftforge.decode.memory import reported_bytes
from draftforge.decode.sampling import SamplingParams
from draftforge.decode.targets import Target
from draftforge.decode.tree import DraftTree
from draftforge.decode.verify import verify
from draftforge.errors import DraftforgeError


def clock(device) -> float:
    """Seconds now (perf_counter), after the device's queued work."""
    if torch.device(device).type == "cuda":  # time what the GPU did, not what was queued
        torch.cuda.synchronize(device)
    return time.perf_counter()


def check_prompt(input_ids, target: Target, max_new_tokens: int) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise DraftforgeError(f"batch size must be 1: pass one prompt, got a tensor of shape {tuple(input_ids.shape)}")
        input_ids = input_ids.tolist()
    input_ids = list(input_ids)
    if input_ids and isinstance(input_ids[0], (list, tuple)):
        raise DraftforgeError("batch size must be 1: pass one prompt (a list of token ids), not a list of prompts")
    if not input_ids:
        raise DraftforgeError("empty prompt: give at least one token id (e.g. BOS)")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise DraftforgeError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    ctx = target.max_context
    if ctx is not None and len(input_ids) >= ctx:
        raise DraftforgeError(
            f"prompt has {len(input_ids)} tokens but the target's context is {ctx}; shorten the prompt"
        )
    return [int(t) for t in input_ids]


def eos_set(eos_token_id, target: Target) -> set[int]:
    """None means the target's generation_config EOS (what target.generate() would stop on)."""
    if eos_token_id is None:
        config = getattr(target.model, "generation_config", None)
        eos_token_id = getattr(config, "eos_token_id", None)
    if eos_token_id is None:
        return set()
    return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id}


class Decoder(ABC):
    """What a method's `make` returns. Every decoder is called the same way, `generate(ids, max_new_tokens=...,
    temperature=..., ...)` or `generate(ids, max_new_tokens=..., params=SamplingParams(...))`; the sampling
    keywords become one SamplingParams before `decode` runs."""

    name: str

    def reset(self) -> None:
        """Forget adaptive state between measured runs (eval calls it before each timed repeat)."""

    def generate(self, input_ids, *, max_new_tokens: int, temperature=0.0, top_p=1.0, top_k=0, seed=0, eos_token_id=None,
                 tree_draws="distinct", params: SamplingParams | None = None, on_tokens=None) -> DecodeResult:
        """on_tokens(emitted) -> bool, where the decoder supports it (SpeculativeDecoder): called after each round
        with the tokens it emitted; True stops the decode there (stop strings, a streamer's consumer)."""
        if params is None:
            params = SamplingParams(float(temperature), float(top_p), int(top_k), tree_draws)
        elif (temperature, top_p, top_k, tree_draws) != (0.0, 1.0, 0, "distinct"):
            raise DraftforgeError("give the sampling settings either as params=SamplingParams(...) or as keywords")
        if on_tokens is not None:
            return self.decode(input_ids, max_new_tokens, params, seed, eos_token_id, on_tokens=on_tokens)
        return self.decode(input_ids, max_new_tokens, params, seed, eos_token_id)

    @abstractmethod
    def decode(self, input_ids, max_new_tokens: int, params: SamplingParams, seed: int, eos_token_id) -> DecodeResult:
        """One prompt decoded; eos_token_id None means the target's generation_config EOS."""


class SpeculativeDecoder(Decoder):
    """Also plain autoregressive decoding when drafter is None (controller NoDraft)."""

    def __init__(self, name: str, target: Target, drafter: Drafter | None, controller: Controller):
        self.name, self.target, self.drafter, self.controller = name, target, drafter, controller

    def reset(self) -> None:
        """Forget adaptive state between measured runs (e.g. UCB's arm statistics)."""
        self.controller.reset()

    def decode(self, input_ids, max_new_tokens, params, seed, eos_token_id, on_tokens=None) -> DecodeResult:
        seq = check_prompt(input_ids, self.target, max_new_tokens)
        ctx = self.target.max_context
        if ctx is not None and len(seq) + max_new_tokens > ctx:  # positions past it are undefined for the target
            warnings.warn(f"stops at the target's context of {ctx} tokens: {ctx - len(seq)} new tokens instead of "
                          f"{max_new_tokens}", stacklevel=3)
            max_new_tokens = ctx - len(seq)
        check_context = getattr(self.drafter, "check_context", None)  # a drafter not built on Drafter may lack it
        if check_context is not None:
            check_context(len(seq) + max_new_tokens)
        eos = eos_set(eos_token_id, self.target)
        device = self.target.device
        generator = torch.Generator(device=device).manual_seed(seed)
        stats, out = DecodeStats(), []
        t_start = clock(device)
        self.target.prefill(seq)
        if self.drafter is not None:
            self.drafter.reset()
        self.controller.start_prompt()  # per-prompt posteriors (Beta-TS, Cali-TS) must not leak across prompts
        stats.prefill_time_s = clock(device) - t_start
        while len(out) < max_new_tokens:
            emitted = self._round(seq, max_new_tokens - len(out), params, generator, eos, stats)
            seq += emitted
            out += emitted
            stop = on_tokens is not None and on_tokens(emitted)  # told every round, the last one too
            if emitted[-1] in eos or stop:
                break
        stats.new_tokens = len(out)
        stats.total_time_s = clock(device) - t_start
        stats.target_cache_bytes = reported_bytes(self.target)
        stats.drafter_state_bytes = reported_bytes(self.drafter)
        return DecodeResult(tokens=out, stats=stats)

    def _round(self, seq, remaining, params, generator, eos, stats) -> list[int]:
        """One draft + verify round; returns the emitted tokens, cut after the first EOS."""
        device = self.target.device
        plan = self.controller.next_plan()
        plan = plan.capped(remaining - 1) if plan is not None else None  # the round also emits one token
        t0 = clock(device)
        tree = self.drafter.draft(seq, plan, params, generator) if plan is not None else DraftTree([], [], [])
        if plan is not None and tree.depth > plan.max_depth:
            raise DraftforgeError(f"drafter {type(self.drafter).__name__} drafted depth {tree.depth} for a plan of "
                                  f"at most {plan.max_depth}")
        t1 = clock(device)
        logits_NV = self.target.verify(seq[-1], tree)
        verdict = verify(tree, logits_NV, params, self.target.vocab_size, generator)
        self.target.commit(verdict.path)
        if plan is not None:
            self.drafter.accept(verdict.path)
        t2 = clock(device)
        emitted = [tree.tokens[j] for j in verdict.path] + [verdict.next_token]
        hit = next((i for i, tok in enumerate(emitted) if tok in eos), None)
        if hit is not None:
            emitted = emitted[: hit + 1]
        accepted = min(len(verdict.path), len(emitted))  # drafts after an EOS are not counted as accepted
        stats.draft_time_s += t1 - t0
        if stats.target_forwards == 0:
            stats.first_draft_time_s, stats.first_draft_depth = t1 - t0, tree.depth
        stats.verify_time_s += t2 - t1
        stats.add_round(accepted, len(tree), tree.depth, plan.name if plan is not None else "ar")
        self.controller.feedback(Round(plan, tree, verdict.path, len(verdict.path) + 1, t1 - t0, t2 - t1))
        return emitted
