"""Baselines from transformers: assisted generation (`hf_assisted`) and prompt lookup decoding
(`hf_prompt_lookup`), run through `target.model.generate` with their rounds read back from forward hooks.
Registers both methods and the `lookup_tokens` option.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftforge.decode.base import DecodeResult, DecodeStats
from draftforge.decode.checks import positive_int
from draftforge.decode.drafters.base import Drafter
from draftforge.decode.engine import Decoder, check_prompt, clock, eos_set
from draftforge.decode.methods import Method, MethodOptions, option, register_method
from draftforge.decode.sampling import SamplingParams
from draftforge.decode.targets import Target, is_recurrent_model
from draftforge.errors import DraftforgeError
from draftforge.hfcompat import assisted_generation_rolls_back_ssm, cache_param, passed_cache


class HFAssistedDecoder(Decoder):
    """Baseline: transformers' assisted generation (`generate(assistant_model=...)`).

    Transformer drafters, and from transformers 5.25 Mamba / Mamba2 drafters too (before, transformers could not
    roll back an SSM drafter's state); Transformer (KV-cache) targets only. Round statistics are read with forward hooks (one target call = one round;
    the first call also prefills the prompt, so prefill_time_s stays 0 and its time counts as verify time).
    """

    name = "hf_assisted"

    def __init__(self, target: Target, drafter: Drafter):
        kinds = ("transformer", "mamba") if assisted_generation_rolls_back_ssm() else ("transformer",)
        if drafter is None or drafter.kind not in kinds:
            kind = None if drafter is None else drafter.kind
            if kind == "mamba":
                raise DraftforgeError(
                    f"hf_assisted with a Mamba drafter needs transformers >= 5.25 (installed: "
                    f"{_transformers_version()}): earlier releases cannot roll back an SSM drafter's state; use "
                    "method 'chain' or 'tree'")
            raise DraftforgeError(
                f"hf_assisted needs a Hugging Face model as the drafter ({' or '.join(kinds)}), not {kind!r}: "
                "transformers' assisted generation runs the assistant's own forward")
        if _stateful(target):
            raise DraftforgeError(
                f"hf_assisted needs a Transformer target with a KV cache, not {target.model.config.model_type!r}: "
                f"{_SSM_TARGETS_IN_TRANSFORMERS}; use method 'chain' or 'tree'")
        self.target, self.drafter = target, drafter
        config = drafter.model.generation_config
        self._initial_draft_tokens = getattr(config, "num_assistant_tokens", None)

    def reset(self) -> None:
        """transformers adapts the assistant's draft length in its generation_config across calls
        ("heuristic" schedule): put the starting value back, like UCB's reset."""
        if self._initial_draft_tokens is not None:
            self.drafter.model.generation_config.num_assistant_tokens = self._initial_draft_tokens

    def decode(self, input_ids, max_new_tokens, params, seed, eos_token_id) -> DecodeResult:
        return hf_generate(self.target, input_ids, max_new_tokens, params, seed, eos_token_id,
                           dict(assistant_model=self.drafter.model), self.drafter)


class HFPromptLookupDecoder(Decoder):
    """Baseline: transformers' prompt lookup decoding (`generate(prompt_lookup_num_tokens=K)`): drafts copied
    from the prompt + output by n-gram match (transformers' default max_matching_ngram_size, 2), no drafter.

    Statistics as for hf_assisted; the lookup runs inside generate with no module to hook, so its time is
    in total_time_s only (draft_time_s stays 0)."""

    name = "hf_prompt_lookup"

    def __init__(self, target: Target, lookup_tokens: int = 10):
        if _stateful(target):
            raise DraftforgeError(
                f"hf_prompt_lookup needs a Transformer target with a KV cache, not {target.model.config.model_type!r}: "
                f"{_SSM_TARGETS_IN_TRANSFORMERS}; use --drafter prompt-lookup with --methods chain,tree instead")
        self.target, self.lookup_tokens = target, int(lookup_tokens)

    def reset(self) -> None:
        """Nothing adapts across calls (prompt lookup keeps no draft-length schedule)."""

    def decode(self, input_ids, max_new_tokens, params, seed, eos_token_id) -> DecodeResult:
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
    t_start = clock(device)
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
    stats.total_time_s = clock(device) - t_start
    tokens = out[0, len(seq) :].tolist()
    _fill_assisted_stats(stats, calls, seq + tokens, len(seq))
    return DecodeResult(tokens=tokens, stats=stats)


# Why both baselines refuse SSM and hybrid targets, whatever the transformers version (docs/use-your-drafter.md)
_SSM_TARGETS_IN_TRANSFORMERS = ("transformers refuses assisted generation with such targets before 5.25, and 5.25 "
                                "emits other tokens than greedy decoding on a Mamba2 target whenever a round accepts "
                                "part of its drafts")


def _stateful(target: Target) -> bool:
    """A target whose layers keep recurrent (SSM) state, which assisted generation must roll back."""
    return is_recurrent_model(target.model.config) or bool(getattr(target.model, "_is_stateful", False))


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


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
    """Record (cached length, query length, seconds, the query's ids) of every forward of `model`: a round's drafts
    end the target's query (the heuristic schedule lets transformers draft any number of them)."""
    state, name = {}, cache_param(model)

    def pre(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = passed_cache(kwargs, name)
        # int(): from transformers 5.25 an SSM cache's length is a counter tensor it updates in place
        state["start"] = (int(cache.get_seq_length()) if cache is not None else 0, ids, clock(model.device))

    def post(module, args, kwargs, output):
        past, ids, t0 = state["start"]
        log.append((past, ids.shape[1], clock(model.device) - t0, ids[0]))  # a view, read after the decode

    return (model.register_forward_pre_hook(pre, with_kwargs=True), model.register_forward_hook(post, with_kwargs=True))


def _fill_assisted_stats(stats: DecodeStats, calls, sequence: list[int], prompt_len: int) -> None:
    """Rounds from the target's forwards: one call = one round (a chain of `drafted` drafts, the query's last ids).
    A round accepted the drafts its emitted tokens begin with: a rejected draft is never emitted in its place (the
    greedy correction differs from it; a sampled one comes from max(0, p - q), which is 0 there), and a round that
    stops on an accepted EOS draft emits no bonus token."""
    target_calls = calls["target"]
    stats.new_tokens = len(sequence) - prompt_len
    stats.verify_time_s = sum(c[2] for c in target_calls)
    stats.draft_time_s = sum(c[2] for c in calls["drafter"])
    committed = prompt_len  # committed tokens when round r starts; the next round starts one past the cache
    for r, (past, q, _, query) in enumerate(target_calls):
        drafted = min(max(past + q - committed, 0), q)
        nxt = target_calls[r + 1][0] + 1 if r + 1 < len(target_calls) else len(sequence)
        emitted = sequence[committed:nxt]
        accepted = 0
        for draft, token in zip(query[q - drafted:].tolist(), emitted):  # the drafts end the query
            if draft != token:
                break
            accepted += 1
        stats.add_round(accepted, drafted, drafted, f"hf{drafted}")
        committed = nxt


# ---------------------------------------------------------------- methods and options

@dataclass(frozen=True)
class HFPromptLookupOptions(MethodOptions):
    lookup_tokens: int = option(10, "drafts per round of transformers' prompt lookup (prompt_lookup_num_tokens; "
                                "default 10)", check=positive_int)


register_method(Method("hf_assisted", "transformers' assisted generation (Transformer drafters; Mamba drafters "
                       "from transformers 5.25)", True,
                       lambda target, drafter, o: HFAssistedDecoder(target, drafter), baseline=True))
# Not baseline=True: eval adds every baseline whenever a drafter is given; this one runs only when named
# (--methods or --baseline), and needs no drafter.
register_method(Method("hf_prompt_lookup", "transformers' prompt lookup decoding (--lookup-tokens drafts copied "
                       "from the prompt by n-gram match; KV-cache targets only)", False,
                       lambda target, drafter, o: HFPromptLookupDecoder(target, o.lookup_tokens),
                       HFPromptLookupOptions))
