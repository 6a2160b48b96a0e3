"""The speculative decoding loop: one loop, pluggable drafter / target / verifier / controller.

Batch size is 1: `generate` takes one prompt (list of ids); a batch (nested list or 2D tensor)
raises a DraftforgeError — run prompts one after another. Rounds: the controller picks a
configuration, the drafter proposes a tree, the target scores it in one forward, the verifier
returns the accepted root path plus one token, target and drafter roll back to that prefix.
"""

from __future__ import annotations

import time

import torch

from draftforge.decode.base import DecodeResult, DecodeStats
from draftforge.decode.control import Controller, Round
from draftforge.decode.drafter_base import Drafter
from draftforge.decode.sampling import SamplingParams
from draftforge.decode.targets import Target, is_recurrent_model
from draftforge.decode.tree import DraftTree
from draftforge.decode.verify import verify
from draftforge.errors import DraftforgeError


def _clock(device) -> float:
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


class SpeculativeDecoder:
    """Also plain autoregressive decoding when drafter is None (controller NoDraft)."""

    def __init__(self, name: str, target: Target, drafter: Drafter | None, controller: Controller):
        self.name, self.target, self.drafter, self.controller = name, target, drafter, controller

    def reset(self) -> None:
        """Forget adaptive state between measured runs (e.g. UCB's arm statistics)."""
        self.controller.reset()

    def generate(self, input_ids, *, max_new_tokens: int, temperature=0.0, top_p=1.0, top_k=0, seed=0, eos_token_id=None,
                 tree_draws="distinct"):
        params = SamplingParams(float(temperature), float(top_p), int(top_k), tree_draws)
        seq = check_prompt(input_ids, self.target, max_new_tokens)
        if self.target.max_context is not None:  # positions past the context are undefined for the target
            max_new_tokens = min(max_new_tokens, self.target.max_context - len(seq))
        eos = eos_set(eos_token_id, self.target)
        device = self.target.device
        generator = torch.Generator(device=device).manual_seed(seed)
        stats, out = DecodeStats(), []
        t_start = _clock(device)
        self.target.prefill(seq)
        if self.drafter is not None:
            self.drafter.reset()
        self.controller.start_prompt()  # per-prompt posteriors (Beta-TS, Cali-TS) must not leak across prompts
        stats.prefill_time_s = _clock(device) - t_start
        while len(out) < max_new_tokens:
            emitted = self._round(seq, max_new_tokens - len(out), params, generator, eos, stats)
            seq += emitted
            out += emitted
            if emitted[-1] in eos:
                break
        stats.new_tokens = len(out)
        stats.total_time_s = _clock(device) - t_start
        return DecodeResult(tokens=out, stats=stats)

    def _round(self, seq, remaining, params, generator, eos, stats) -> list[int]:
        """One draft + verify round; returns the emitted tokens, cut after the first EOS."""
        device = self.target.device
        plan = self.controller.next_plan()
        plan = plan.capped(remaining - 1) if plan is not None else None  # the round also emits one token
        t0 = _clock(device)
        tree = self.drafter.draft(seq, plan, params, generator) if plan is not None else DraftTree([], [], [])
        if plan is not None and tree.depth > plan.max_depth:
            raise DraftforgeError(f"drafter {type(self.drafter).__name__} drafted depth {tree.depth} for a plan of "
                                  f"at most {plan.max_depth}")
        t1 = _clock(device)
        logits_NV = self.target.verify(seq[-1], tree)
        verdict = verify(tree, logits_NV, params, self.target.vocab_size, generator)
        self.target.commit(verdict.path)
        if plan is not None:
            self.drafter.accept(verdict.path)
        t2 = _clock(device)
        emitted = [tree.tokens[j] for j in verdict.path] + [verdict.next_token]
        hit = next((i for i, tok in enumerate(emitted) if tok in eos), None)
        if hit is not None:
            emitted = emitted[: hit + 1]
        accepted = min(len(verdict.path), len(emitted))  # drafts after an EOS are not counted as accepted
        self._record(stats, tree, plan, accepted, t1 - t0, t2 - t1)
        self.controller.feedback(Round(plan, tree, verdict.path, len(verdict.path) + 1, t1 - t0, t2 - t1))
        return emitted

    @staticmethod
    def _record(stats: DecodeStats, tree, plan, accepted: int, draft_s, verify_s) -> None:
        stats.target_forwards += 1
        stats.draft_time_s += draft_s
        stats.verify_time_s += verify_s
        stats.accepted_per_round.append(accepted)
        stats.drafted_per_round.append(len(tree))
        depth = tree.depth
        for lst in (stats.accept_by_position, stats.proposed_by_position):
            lst.extend([0] * (depth - len(lst)))
        for d in range(depth):
            stats.proposed_by_position[d] += 1
        for d in range(accepted):
            stats.accept_by_position[d] += 1
        stats.chosen_configs.append(plan.name if plan is not None else "ar")


class HFAssistedDecoder:
    """Baseline: transformers' assisted generation (`generate(assistant_model=...)`).

    Transformer drafters only: transformers cannot roll back an SSM drafter's state. Round
    statistics are read with forward hooks (one target call = one round; the first call also
    prefills the prompt, so prefill_time_s stays 0 and its time counts as verify time).
    """

    name = "hf_assisted"

    def __init__(self, target: Target, drafter: Drafter):
        if drafter is None or getattr(drafter, "kind", None) != "transformer":
            kind = getattr(drafter, "kind", None)
            raise DraftforgeError(
                f"hf_assisted needs a Transformer drafter (transformers cannot roll back {kind!r} state); "
                "use method 'chain' or 'tree' for Mamba drafters"
            )
        self.target, self.drafter = target, drafter
        config = drafter.model.generation_config
        self._initial_draft_tokens = getattr(config, "num_assistant_tokens", None)

    def reset(self) -> None:
        """transformers adapts the assistant's draft length in its generation_config across calls
        ("heuristic" schedule): put the starting value back, like UCB's reset."""
        if self._initial_draft_tokens is not None:
            self.drafter.model.generation_config.num_assistant_tokens = self._initial_draft_tokens

    def generate(self, input_ids, *, max_new_tokens: int, temperature=0.0, top_p=1.0, top_k=0, seed=0, eos_token_id=None,
                 tree_draws="distinct"):
        params = SamplingParams(float(temperature), float(top_p), int(top_k), tree_draws)
        return hf_generate(self.target, input_ids, max_new_tokens, params, seed, eos_token_id,
                           dict(assistant_model=self.drafter.model), self.drafter)


class HFPromptLookupDecoder:
    """Baseline: transformers' prompt lookup decoding (`generate(prompt_lookup_num_tokens=K)`): drafts copied
    from the prompt + output by n-gram match (transformers' default max_matching_ngram_size, 2), no drafter.

    Statistics as for hf_assisted; the lookup runs inside generate with no module to hook, so its time is
    in total_time_s only (draft_time_s stays 0)."""

    name = "hf_prompt_lookup"

    def __init__(self, target: Target, lookup_tokens: int = 10):
        if is_recurrent_model(target.model.config) or getattr(target.model, "_is_stateful", False):
            raise DraftforgeError(
                f"hf_prompt_lookup needs a Transformer target with a KV cache; transformers' assisted generation "
                f"cannot roll back {target.model.config.model_type!r}'s recurrent state: use --drafter prompt-lookup "
                "with --methods chain,tree instead")
        self.target, self.lookup_tokens = target, int(lookup_tokens)

    def reset(self) -> None:
        """Nothing adapts across calls (prompt lookup keeps no draft-length schedule)."""

    def generate(self, input_ids, *, max_new_tokens: int, temperature=0.0, top_p=1.0, top_k=0, seed=0, eos_token_id=None,
                 tree_draws="distinct"):
        params = SamplingParams(float(temperature), float(top_p), int(top_k), tree_draws)
        return hf_generate(self.target, input_ids, max_new_tokens, params, seed, eos_token_id,
                           dict(prompt_lookup_num_tokens=self.lookup_tokens))


def hf_generate(target: Target, input_ids, max_new_tokens: int, params: SamplingParams, seed: int, eos_token_id,
                generate_kwargs: dict, drafter: Drafter | None = None) -> DecodeResult:
    """One timed `target.model.generate(**generate_kwargs)` call (an assisted-generation mode) with its rounds
    read back from forward hooks on the target (and on the drafter's model, whose forwards are draft time)."""
    seq = check_prompt(input_ids, target, max_new_tokens)
    eos = sorted(eos_set(eos_token_id, target))
    stats, calls, device = DecodeStats(), {"target": [], "drafter": []}, target.device
    hooks = [_timing_hooks(target.model, calls["target"])]
    if drafter is not None:
        hooks += [_timing_hooks(drafter.model, calls["drafter"]), _draft_vocab_hook(drafter)]
    torch.manual_seed(seed)  # transformers samples from the global generator
    sampling = dict(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
    t_start = _clock(device)
    try:
        with torch.inference_mode():
            ids = torch.tensor([seq], device=device)
            out = target.model.generate(  # explicit mask: else prompt tokens equal to pad get masked
                ids, attention_mask=torch.ones_like(ids), **generate_kwargs,
                max_new_tokens=max_new_tokens, eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0,
                **(dict(do_sample=False) if params.greedy else sampling),
            )
    finally:
        for pair in hooks:
            for h in pair:
                h.remove()
    stats.total_time_s = _clock(device) - t_start
    tokens = out[0, len(seq) :].tolist()
    _fill_assisted_stats(stats, calls, len(seq), len(tokens))
    return DecodeResult(tokens=tokens, stats=stats)


def _draft_vocab_hook(drafter) -> tuple:
    """A reduced-vocabulary drafter's head predicts draft ids: map its logits into the target's vocabulary
    (-inf elsewhere) so transformers drafts target ids (greedy) and gets a full-width q (sampling)."""
    if drafter.d2t is None:
        return ()
    from draftforge.models.draft_vocab import to_target_logits

    def post(module, args, kwargs, output):
        output.logits = to_target_logits(output.logits, drafter.d2t, drafter.vocab_size)
        return output

    return (drafter.model.register_forward_hook(post, with_kwargs=True),)


def _timing_hooks(model, log: list):
    """Record (cached length, query length, seconds) of every forward of `model`."""
    state = {}

    def pre(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("past_key_values")
        state["start"] = (cache.get_seq_length() if cache is not None else 0, ids.shape[1], _clock(model.device))

    def post(module, args, kwargs, output):
        past, q, t0 = state["start"]
        log.append((past, q, _clock(model.device) - t0))

    return (model.register_forward_pre_hook(pre, with_kwargs=True), model.register_forward_hook(post, with_kwargs=True))


def _fill_assisted_stats(stats: DecodeStats, calls, prompt_len: int, n_new: int) -> None:
    target_calls = calls["target"]
    stats.new_tokens = n_new
    stats.target_forwards = len(target_calls)
    stats.verify_time_s = sum(c[2] for c in target_calls)
    stats.draft_time_s = sum(c[2] for c in calls["drafter"])
    committed = prompt_len  # committed tokens when round r starts; the next round starts one past the cache
    for r, (past, q, _) in enumerate(target_calls):
        drafted = max(past + q - committed, 0)
        nxt = target_calls[r + 1][0] + 1 if r + 1 < len(target_calls) else prompt_len + n_new
        emitted = max(nxt - committed, 1)
        stats.drafted_per_round.append(drafted)
        stats.accepted_per_round.append(min(emitted - 1, drafted))
        for lst in (stats.accept_by_position, stats.proposed_by_position):
            lst.extend([0] * (drafted - len(lst)))
        for d in range(drafted):
            stats.proposed_by_position[d] += 1
        for d in range(min(emitted - 1, drafted)):
            stats.accept_by_position[d] += 1
        stats.chosen_configs.append(f"hf{drafted}")
        committed = nxt


def build_decoder(method: str, target: Target, drafter: Drafter | None = None, **options):
    """A decoder for a registered method (decode/methods.py); `ar` ignores the drafter, the others need one."""
    from draftforge.decode.methods import build

    return build(method, target, drafter, **options)
