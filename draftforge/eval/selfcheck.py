"""The T=0 self-check: each prompt's speculative output against AR's in the same run, and, where they differ,
whether the difference is rounding (a near-tie) or a defect.

In reduced precision a verification forward (many rows) sums in another order than an AR step (one row), so two
correct decodes may part where two logits are within rounding of each other. The tolerance for that is measured
**without the code under test**: at the first differing position the prefix goes through the model's own plain
forward (transformers alone: no harness cache, tree scan, multi-row verify, decode attention or packed linears),
once in float32 (the reference r) and twice in the run's dtype (the whole prefix at once, and with its last token
as a cached step); noise = the largest |Δlogit| of those two from r. AR chose a, the method b: a near-tie needs
|r(a) − r(b)| ≤ tolerance = 2·noise, at least one rounding step of the dtype at |r(a)| and at most `CEILING_STEPS`
rounding steps at the logits' scale (a gap larger than the dtype's rounding of logits that size can explain is a
defect whatever was measured; float32 counts in float16's steps, see CEILING_STEPS), **and** the harness's own
logits there (AR's one-row computation, and the prefix verified in the row counts the method used) within that
ceiling of r. Anything else is a **defect** (the harness changed the output). fp32 stays bitwise: any difference
fails the run. AR itself is checked the same way: its tokens against the plain forward's argmax over the prompt and
AR's output (one teacher-forced forward per prompt), so a harness that computes AR wrongly too cannot pass by
agreeing with itself. After a near-tie a method's output continues from a context AR never saw; each of its later
tokens is checked the same way against the plain forward over its own context, and every repeat whose output
differs is examined, not only a prompt's first.
Each turn of a multi-turn question is a prompt of its own, compared only where its context (the conversation
with the method's own earlier answers) is AR's: after an earlier turn's near-tie it is not (`context_differs`).

Legend: V vocabulary, T tokens.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import weakref

import torch

from draftforge.decode.attention import standard_attention
from draftforge.decode.packing import unpacked
from draftforge.decode.tree import DraftTree
from draftforge.hfcompat import cache_kwargs, output_cache

# The hard ceiling, in rounding steps of the dtype at the logits' scale (max |r|). Measured on SmolLM2-135M in
# bf16 (docs/results/bf16.md, "The self-check's tolerance"): the model's own forward and the harness's stayed
# within 1.9 such steps of fp32 (0.70 logits at max |r| 19-38); a forward that dropped the SSM state was 26 steps
# off. In float32 two correct algorithms of one SSM layer (chunked scan vs recurrent step) already differ by
# hundreds of float32 steps (1.8e-4 on a tiny Bamba), so dtypes finer than float16 count in float16's steps.
CEILING_STEPS = 8


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, len(shorter) if one is a strict prefix, None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def chain_tree(tokens: list[int]) -> DraftTree:
    n = len(tokens)
    return DraftTree(list(tokens), list(range(-1, n - 1)), list(range(1, n + 1)), is_chain=True)


@torch.inference_mode()
def logits_after(target, prefix: list[int], rows: int) -> torch.Tensor:
    """Logits [V] of the token after `prefix`, from a verification forward of `rows` rows (1 = an AR step)."""
    rows = max(1, min(rows, len(prefix)))
    seq = prefix[: len(prefix) - rows + 1]
    target.prefill(seq)
    logits_NV = target.verify(seq[-1], chain_tree(prefix[len(seq):]))
    target.commit([])
    return logits_NV[-1].float().cpu()


@torch.inference_mode()
def ar_logits(target, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """Logits [V] after prompt + generated, computed as AR computes them: one row per generated token."""
    target.prefill(prompt)
    last = prompt[-1]
    for tok in generated:
        target.verify(last, chain_tree([]))
        target.commit([])
        last = tok
    logits_NV = target.verify(last, chain_tree([]))
    target.commit([])
    return logits_NV[0].float().cpu()


def _dtype(target) -> torch.dtype:
    model = getattr(target, "model", None)
    dtype = next(model.parameters()).dtype if model is not None else torch.float32
    return dtype if dtype.is_floating_point else torch.float32


def rounding_step(target, logit: float) -> float:
    """2·eps·max(1, |logit|) in the model's dtype: two to four spacings of its numbers at |logit| (logits come out
    rounded to that spacing, which is eps·2^floor(log2|logit|))."""
    return 2 * torch.finfo(_dtype(target)).eps * max(1.0, abs(logit))


_FP32_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fp32(model):
    """The model itself when it is float32, else one float32 copy of it (made once; its weights are the same
    numbers, exactly representable, so it computes the same function with less rounding)."""
    if next(model.parameters()).dtype == torch.float32:
        return model
    if model not in _FP32_COPIES:
        _FP32_COPIES[model] = copy.deepcopy(model).float().eval()
    return _FP32_COPIES[model]


@torch.inference_mode()
def plain_logits(model, ids: list[int], keep: int = 0) -> torch.Tensor:
    """Logits [T, V] (float32) of `ids` from the model's own forward, one call, no cache; with `keep`, only the last
    `keep` positions' (a long prompt's T x V logits would be computed and held for nothing)."""
    kwargs = {"logits_to_keep": keep} if keep else {}
    return model(input_ids=torch.tensor([ids], device=model.device), **kwargs).logits[0].float()


@torch.inference_mode()
def plain_step_logits(model, ids: list[int]) -> torch.Tensor:
    """Logits [V] after `ids` from the model's own forward, the last token a cached one-row step (transformers'
    own cache; another summation order than `plain_logits`, with no harness code either)."""
    if len(ids) < 2:
        return plain_logits(model, ids, keep=1)[-1]
    out = model(input_ids=torch.tensor([ids[:-1]], device=model.device), use_cache=True)
    step = model(input_ids=torch.tensor([ids[-1:]], device=model.device), use_cache=True,
                 **cache_kwargs(model, output_cache(out)))
    return step.logits[0, -1].float()


@contextlib.contextmanager
def plain(model):
    """Within the block `model`'s own forward runs transformers' code only: its sdpa attention, not draftforge's
    decode attention, and plain linears, not the oneDNN-packed copies the harness multiplies by."""
    with standard_attention(model), unpacked(model):
        yield


def reference(target, prefix: list[int]) -> dict:
    """The independent evidence at `prefix`: fp32 logits r [V] and the run dtype's noise against them (with
    transformers' own attention, not draftforge's decode attention)."""
    model = target.model
    r_V = plain_logits(_fp32(model), prefix, keep=1)[-1].cpu()
    with plain(model):
        runs = [plain_logits(model, prefix, keep=1)[-1].cpu(), plain_step_logits(model, prefix).cpu()]
    noise = max(float((x - r_V).abs().max()) for x in runs)
    step_eps = max(torch.finfo(_dtype(target)).eps, torch.finfo(torch.float16).eps)
    ceiling = CEILING_STEPS * 2 * step_eps * max(1.0, float(r_V.abs().max()))
    return {"r_V": r_V, "noise": noise, "ceiling": ceiling}


def rows_to_probe(records) -> list[int]:
    """Row counts a method verified: 2, its median and its largest (root included)."""
    rows = [d + 1 for r in records for d in r.stats.drafted_per_round if d > 0]
    if not rows:
        return [2]
    return sorted({2, int(statistics.median(rows)), max(rows)})


def classify(target, prompt: list[int], generated: list[int], ar_token: int, other: int | None,
             rows: list[int]) -> dict:
    """The evidence at one divergence: the two tokens' gap in the fp32 reference, the tolerance from the plain
    forward's noise, how far the harness's own logits there are from the reference, and the verdict."""
    prefix = prompt + generated
    ref = reference(target, prefix)
    r_V = ref["r_V"]
    ar_V = ar_logits(target, prompt, generated)
    probes = sorted({1, *rows, len(prefix)})
    harness = [ar_V] + [logits_after(target, prefix, n) for n in probes]
    harness_dev = max(float((x - r_V).abs().max()) for x in harness)
    top2 = torch.topk(r_V, 2).values
    out = {"ar_token": ar_token, "other_token": other, "noise": ref["noise"], "ceiling": ref["ceiling"],
           "harness_deviation": harness_dev, "rows_probed": probes, "top2_margin": float(top2[0] - top2[1])}
    if other is None:  # one output stopped early: no rounding explains a missing token
        return {**out, "gap": None, "tolerance": None, "verdict": "defect"}
    gap = float(r_V[ar_token] - r_V[other])
    tolerance = min(max(2 * ref["noise"], rounding_step(target, float(r_V[ar_token]))), ref["ceiling"])
    tie = abs(gap) <= tolerance and harness_dev <= ref["ceiling"]
    return {**out, "gap": gap, "tolerance": tolerance, "verdict": "near_tie" if tie else "defect"}


_AR_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(context, tokens): result}


def check_ar(target, context: list[int], tokens: list[int]) -> dict | None:
    """AR's own tokens against the model's plain forward (teacher-forced over context + tokens): None where each
    is that forward's argmax, else the classified first position where it is not (AR = a, plain forward = b).
    Remembered per model, so every method's self-check of one run checks AR once."""
    done = _AR_CHECKED.setdefault(target.model, {})
    key = (tuple(context), tuple(tokens))
    if key not in done:
        found = None
        if tokens:
            with plain(target.model):  # transformers alone, not draftforge's decode attention or packing
                logits_TV = plain_logits(target.model, context + tokens[:-1], keep=len(tokens))
            picks = logits_TV.argmax(-1).tolist()
            i = next((k for k, (t, p) in enumerate(zip(tokens, picks)) if t != p), None)
            if i is not None:
                found = {"position": i, **classify(target, context, tokens[:i], tokens[i], picks[i], [1])}
                if found["verdict"] == "near_tie":  # the teacher-forced picks hold on past it: check the rest too
                    found["later"] = [{"position": j, **classify(target, context, tokens[:j], tokens[j], picks[j], [1])}
                                      for j in range(i + 1, len(tokens)) if tokens[j] != picks[j]]
                    if any(d["verdict"] == "defect" for d in found["later"]):
                        found["verdict"] = "defect"  # a near-tie, then a token the plain forward does not explain
        done[key] = found
    return done[key]


def stopped_early(tokens: list[int], eos: set[int], budget: int | None) -> bool:
    """An output that ends neither at an EOS nor at its token budget (None: the budget is not known)."""
    return budget is not None and len(tokens) < budget and not (tokens and tokens[-1] in eos)


def token_budget(target, context: list[int], max_new_tokens: int | None) -> int | None:
    """The tokens a decode of `context` may emit: max_new_tokens, cut where the target's context ends (as the
    engine cuts it)."""
    if max_new_tokens is None:
        return None
    limit = getattr(target, "max_context", None)
    return max_new_tokens if limit is None else min(max_new_tokens, limit - len(context))


def later_mismatches(target, context: list[int], tokens: list[int], start: int, rows: list[int]) -> list[dict]:
    """A method's own tokens from `start` on against the model's plain forward teacher-forced over its own context
    (context + its tokens): each position where a token is not that forward's argmax, classified (plain forward's
    pick = a, the method's = b). After a near-tie the method decodes a context AR never saw, so this is the only
    evidence for the rest of its output."""
    if start >= len(tokens):
        return []
    with plain(target.model):
        logits_TV = plain_logits(target.model, context + tokens[:-1], keep=len(tokens) - start)
    picks = logits_TV.argmax(-1).tolist()
    return [{"position": j, **classify(target, context, tokens[:j], picks[k], tokens[j], rows)}
            for k, j in enumerate(range(start, len(tokens))) if tokens[j] != picks[k]]


def _eos_ids(eos_token_id, target) -> set[int]:
    from draftforge.decode.engine import eos_set

    return eos_set(eos_token_id, target)


def _key(record) -> tuple[str, int]:
    return record.prompt_id, record.turn


def _label(key: tuple[str, int]) -> str:
    """A prompt's id, or "id#turnK" for a later turn of a multi-turn question."""
    return key[0] if key[1] == 0 else f"{key[0]}#turn{key[1] + 1}"


def self_check(records, ar_records, prompt_ids: dict[str, list[int]], target=None, check_ar_tokens: bool = True,
               eos_token_id=None, max_new_tokens: int | None = None) -> dict:
    """Prompts (each turn of a multi-turn one counted alone) identical to AR in every repeat, and each differing
    output classified (needs `target`).

    Every distinct output that differs from AR's is examined (each repeat is a decode of its own): its first
    difference from AR's, and after a near-tie there, each of its later tokens against the model's plain forward
    over its own context (`later_mismatches`; a defect among them counts as one). A later turn is
    compared only when its context (the conversation with the method's own earlier answers) is AR's; where an
    earlier turn parted from AR it is not, and the turn counts under `context_differs`, neither identical nor a
    defect (the earlier turn's own verdict says why). With `check_ar_tokens` (and a target), AR's own tokens are
    checked against the model's plain forward too (`check_ar`), every repeat's; its defects count among `defects`.
    An output after a near-tie must also end as a decode ends: at an EOS (`eos_token_id` as the run passed it;
    None: the target's generation_config EOS) or at its token budget (`max_new_tokens`, cut at the target's
    context; not given: AR's length where AR did not stop at an EOS); one that stops short is a defect, and so is
    an AR output that does (where the budget is given).
    Methods are compared with AR's first repeat."""
    ar_by_key = {}
    for r in ar_records:
        ar_by_key.setdefault(_key(r), r)
    identical: dict[tuple[str, int], bool] = {}
    other_context: set[tuple[str, int]] = set()
    divergences, examined = [], set()
    rows = rows_to_probe(records)
    eos = set() if target is None else _eos_ids(eos_token_id, target)

    def budget(context, ar_tokens):
        known = token_budget(target, context, max_new_tokens)
        return known if known is not None or (ar_tokens and ar_tokens[-1] in eos) else len(ar_tokens)

    for r in records:
        key, ar = _key(r), ar_by_key.get(_key(r))
        if ar is None:
            continue
        if r.context != ar.context:  # a later turn whose conversation already parted from AR's
            other_context.add(key)
            continue
        ref, same = ar.tokens, r.tokens == ar.tokens
        if not same and (key, tuple(r.tokens)) not in examined:  # a repeat with the same output: examined once
            examined.add((key, tuple(r.tokens)))
            i = first_divergence(ref, r.tokens)
            found = {"prompt_id": r.prompt_id, "turn": key[1], "repeat": r.repeat, "position": i}
            if target is not None and i < len(ref):
                other = r.tokens[i] if i < len(r.tokens) else None
                context = prompt_ids[r.prompt_id] if r.context is None else r.context
                found.update(classify(target, context, ref[:i], ref[i], other, rows))
                if found["verdict"] == "near_tie":
                    found["later"] = later_mismatches(target, context, r.tokens, i + 1, rows)
                    if any(d["verdict"] == "defect" for d in found["later"]):
                        found["verdict"] = "defect"  # a near-tie, then a token its own context cannot explain
                    if stopped_early(r.tokens, eos, budget(context, ref)):
                        found["verdict"], found["stopped_early"] = "defect", True  # no tie explains a missing end
            else:
                found["verdict"] = "unchecked" if target is None else "defect"
            divergences.append(found)
        identical[key] = identical.get(key, True) and same
    ar_divergences = []
    if check_ar_tokens and target is not None:
        checked = set()
        for ar in ar_records:  # AR's own output against the plain forward: every repeat's, each distinct one once
            key = _key(ar)
            if key not in identical or (key, tuple(ar.tokens)) in checked:
                continue
            checked.add((key, tuple(ar.tokens)))
            context = prompt_ids[key[0]] if ar.context is None else ar.context
            found = check_ar(target, context, ar.tokens)
            if found is None and stopped_early(ar.tokens, eos, token_budget(target, context, max_new_tokens)):
                found = {"position": len(ar.tokens), "verdict": "defect", "stopped_early": True}
            if found is not None:
                ar_divergences.append({"prompt_id": key[0], "turn": key[1], "repeat": ar.repeat, **found})
    verdicts = [d["verdict"] for d in divergences]
    ar_verdicts = [d["verdict"] for d in ar_divergences]
    return {"identical": sum(identical.values()), "total": len(identical),
            "near_ties": verdicts.count("near_tie"), "defects": verdicts.count("defect") + ar_verdicts.count("defect"),
            "ar_near_ties": ar_verdicts.count("near_tie"), "ar_defects": ar_verdicts.count("defect"),
            "ar_divergences": ar_divergences,
            "context_differs": len(other_context - set(identical)),
            "mismatched_prompts": list(dict.fromkeys(_label((d["prompt_id"], d["turn"])) for d in divergences)),
            "divergences": divergences, "near_tie_checked": target is not None}
