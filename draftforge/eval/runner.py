"""`run_eval`: every method on the same prompts in one process, after warm-up, with a self-check against AR.

Order of work: load target/drafter/prompts once, build one decoder per method, then for every
temperature and repeat run all methods over all prompts (methods interleaved per repeat so slow drift
of the machine hits all of them alike; the order rotates so no method is always first). Before each
timed pass a decoder is reset (adaptive state such as the UCB controller) and warmed up again, untimed.
Reports are written before the self-check can fail, so a failing run still leaves its evidence on disk.
A multi-turn question is decoded turn by turn, each later turn after the method's own earlier answers
(`_decode_turns`; one record per turn); `--answers` also writes Spec-Bench answer files (eval/answers.py).
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, replace

import draftforge.decode as decode_api
from draftforge.decode import methods as method_registry
from draftforge.decode.engine import SpeculativeDecoder
from draftforge.decode.sampling import SamplingParams
from draftforge.errors import DataError, DraftforgeError
from draftforge.eval import answers as answers_mod
from draftforge.eval import components, cost, metrics, selfcheck
from draftforge.eval.config import (  # noqa: F401  (EvalConfig, validate: run_eval's inputs, importable from here)
    EvalConfig, check_paths, method_order, resolve_method_options, resolved_options, validate)
from draftforge.eval.output import save_or_rescue
from draftforge.eval.manifest import ASSISTED_POLICY_KEYS, assisted_policy, build_manifest
from draftforge.data.prompts import answer_text, encode_prompts, encode_turn, load_prompt_rows, report_categories
from draftforge.runtime import announce, choose_threads, resolve_dtype


class SelfCheckError(DraftforgeError):
    """Greedy speculative output differed from AR beyond rounding (any dtype) or at all (fp32): not lossless."""


PROGRESS_EVERY_S = 60.0  # a timed pass longer than this reports its progress at most this often


def _log(cfg: EvalConfig, msg: str) -> None:
    if not cfg.quiet:
        print(f"[eval] {msg}", file=sys.stderr, flush=True)


def _build_decoders(cfg: EvalConfig, target, drafter) -> tuple[dict, list[dict]]:
    """One decoder per method of a validated config."""
    options = resolved_options(cfg)
    required, optional = method_order(cfg)
    decoders, skipped = {}, []
    for m in required:
        decoders[m] = decode_api.build_decoder(m, target, None if m == "ar" else drafter, options=options[m])
    for m in optional:
        try:
            decoders[m] = decode_api.build_decoder(m, target, drafter, options=options[m])
        except (DraftforgeError, NotImplementedError, ValueError, TypeError) as e:
            skipped.append({"method": m, "reason": str(e), "asked": False})  # added by default, so not shouted
            _log(cfg, f"not running the default baseline {m}: {e}")
    return decoders, skipped


def _eos_id(cfg: EvalConfig, target):
    """[] stops on nothing (fixed-length runs); None lets the decoder use the target's generation_config EOS."""
    return [] if cfg.ignore_eos else None  # generation_config EOS covers chat models' several end tokens


def _model_dtype(model):
    try:
        return next(model.parameters()).dtype
    except (StopIteration, AttributeError, TypeError):
        return getattr(model, "dtype", None)


def sampling_params(cfg: EvalConfig, temperature: float) -> SamplingParams:
    return SamplingParams(float(temperature), float(cfg.top_p), int(cfg.top_k), cfg.tree_draws)


def _run_one(dec, input_ids, cfg, params: SamplingParams, seed_offset, eos):
    return dec.generate(list(input_ids), max_new_tokens=cfg.max_new_tokens, params=params,
                        seed=cfg.seed + seed_offset, eos_token_id=eos)


def _decode_turns(cfg, dec, prompt, params, index, eos, tokenizer, num_prompts) -> list[tuple[list[int], object]]:
    """(context ids, DecodeResult) of every turn of one prompt. Turn k > 1 of a multi-turn question is decoded
    from the conversation with this method's own earlier answers (as Spec-Bench and MT-bench do); its seed is
    seed + (k - 1) * num_prompts + index, so no two (prompt, turn) share one."""
    out, answers = [], []
    for turn in range(len(prompt.turns) if prompt.turns else 1):
        ids = encode_turn(prompt, answers, tokenizer, cfg.chat_template) if turn else list(prompt.input_ids)
        res = _run_one(dec, ids, cfg, params, turn * num_prompts + index, eos)
        out.append((ids, res))
        if prompt.turns and turn + 1 < len(prompt.turns):
            answers.append(answer_text(tokenizer, res.tokens))
    return out


def rotated(methods: list[str], repeat: int) -> list[str]:
    """The method order of one repeat: repeat r starts at method r mod M, so no method is always first."""
    k = repeat % len(methods) if methods else 0
    return list(methods[k:]) + list(methods[:k])


def _reset_and_warm(cfg, dec, prompts, params, eos) -> None:
    """Give every timed pass the same start: reset the decoder's adaptive state (e.g. the UCB
    controller, where the decoder has `reset`), then run the warm-up prompts again, untimed."""
    reset = getattr(dec, "reset", None)
    if callable(reset):
        reset()
    for i, p in enumerate(prompts[: cfg.warmup]):
        _run_one(dec, p.input_ids, cfg, params, i, eos)  # first turns only: the warm-up is untimed


def _timed_pass(cfg, method, dec, prompts, params, rep, eos, records, memory, tokenizer=None) -> None:
    """One method over all prompts, timed; its memory (metrics.PassMemory: held at the start, the pass's
    peak above it) goes into `memory`, the pass with the largest peak above its start kept over repeats."""
    temp = params.temperature
    rounds = getattr(getattr(dec, "drafter", None), "rounds", None)  # lookup-first: rounds each drafter drafted
    rounds_before = dict(rounds) if rounds is not None else None
    with metrics.PassMemory(cfg.device) as pass_memory:
        start, n_tok = time.perf_counter(), 0
        said = start
        for i, p in enumerate(prompts):
            for turn, (ids, res) in enumerate(_decode_turns(cfg, dec, p, params, i, eos, tokenizer, len(prompts))):
                records.append(metrics.RunRecord(method, temp, rep, p.prompt_id, len(ids), list(res.tokens),
                                                 res.stats, turn, ids if turn else None))
                n_tok += res.stats.new_tokens
            now = time.perf_counter()
            if now - said >= PROGRESS_EVERY_S and i + 1 < len(prompts):  # long passes (long context) say how far
                said = now
                _log(cfg, f"T={temp:g} repeat {rep + 1}/{cfg.repeats} {method:<12} {i + 1}/{len(prompts)} prompts, "
                          f"{n_tok} tokens, {now - start:.0f} s")
        secs = time.perf_counter() - start
    key = f"{method}@{temp:g}"
    mem = {**pass_memory.result, "repeat": rep}
    memory[key] = max(memory.get(key, mem), mem, key=lambda m: m["bytes"])
    _log(cfg, f"T={temp:g} repeat {rep + 1}/{cfg.repeats} {method:<12} "
              f"{len(prompts)} prompts, {n_tok} tokens, {n_tok / max(secs, 1e-9):.1f} tok/s, "
              f"memory +{mem['bytes'] / 2**20:.1f} MiB over {mem['start_bytes'] / 2**20:.0f} MiB")
    if rounds_before is not None:
        by = {k: rounds[k] - rounds_before.get(k, 0) for k in rounds}
        _log(cfg, f"T={temp:g} repeat {rep + 1}/{cfg.repeats} {method:<12} lookup first: lookup drafted "
                  f"{by.get('lookup', 0)} of {sum(by.values())} rounds")


def _timed_runs(cfg, decoders, prompts, eos, tokenizer=None, per_temperature=None) -> tuple[list, dict, list]:
    """Records, memory per method@T (metrics.PassMemory of its timed passes), and the method order used in
    each repeat. per_temperature: {T: {method: decoder}} replacing a method's decoder at T (a tuned chain).

    The order rotates across repeats; before each timed pass the decoder is reset and warmed up."""
    records, memory, orders = [], {}, []
    for temp in cfg.temperatures:
        params = sampling_params(cfg, temp)  # built once per temperature, passed down to every decoder
        at_t = {**decoders, **(per_temperature or {}).get(temp, {})}
        for rep in range(cfg.repeats):
            order = rotated(list(at_t), rep)
            orders.append({"temperature": temp, "repeat": rep, "order": order})
            _log(cfg, f"T={temp:g} repeat {rep + 1}/{cfg.repeats}: method order {', '.join(order)}")
            for method in order:
                _reset_and_warm(cfg, at_t[method], prompts, params, eos)
                _timed_pass(cfg, method, at_t[method], prompts, params, rep, eos, records, memory, tokenizer)
    return records, memory, orders


def _tune_chain_length(cfg, decoders, target, drafter, options, prompts, curve, eos,
                       by_length=None) -> tuple[dict, dict]:
    """Per temperature: chain at its chain_length G over the warm-up prompts (first turns, untimed, after one
    warm-up call), its rounds cut at every γ' <= G (cost.shorter_chains), and a chain decoder at the best γ'
    (the shortest among equals). Returns ({T: {"chain": decoder}}, {T: what was probed and chosen})."""
    import dataclasses

    probe = max(cfg.warmup, 1)
    length = options["chain"].chain_length
    swaps, tuning = {}, {}
    for temp in cfg.temperatures:
        params = sampling_params(cfg, temp)
        dec = decoders["chain"]
        _run_one(dec, prompts[0].input_ids, cfg, params, 0, eos)  # warm-up: first calls run slower
        records = [metrics.RunRecord("chain", temp, -1, p.prompt_id, len(p.input_ids), [], res.stats)
                   for i, p in enumerate(prompts[:probe])
                   for res in [_run_one(dec, p.input_ids, cfg, params, i, eos)]]
        draft_step_s = cost.draft_step_s(records)
        predicted = cost.shorter_chains(records, curve, by_length)
        best = max(predicted, key=lambda g: (round(predicted[g], 6), -g)) if predicted else length
        tuning[temp] = {"probed_length": length, "prompts": [p.prompt_id for p in prompts[:probe]],
                        "rounds": sum(r.stats.target_forwards for r in records), "draft_step_s": draft_step_s,
                        "predicted": predicted, "chosen": best}
        _log(cfg, f"T={temp:g} --tune-chain-length: chain {length} on {probe} prompt(s) predicts "
                  + ", ".join(f"{g}: {v:.2f}x" for g, v in predicted.items()) + f"; timing chain {best}")
        if best != length:
            chosen = replace(options["chain"], chain_length=best)
            swaps[temp] = {"chain": decode_api.build_decoder("chain", target, drafter, options=chosen)}
    return swaps, tuning


def _own_curves(cfg, decoders, prompts, curve, pace: float = 1.0) -> dict[str, dict[int, float]]:
    """method -> the verification curve of a target that shares work with its drafter (EESD's split target:
    drafting ran layers 1..N, the verification runs N+1..L), timed on the first prompt at the plain curve's row
    counts after the runs and scaled by `pace` (the plain t(1) before the runs over the one timed beside it); the
    plain curve would count layers 1..N twice. Only for a bench of one length bucket."""
    timed, out = {}, {}
    for name, dec in decoders.items():
        target = getattr(dec, "target", None)
        if getattr(target, "stage_drafted", None) is None:
            continue
        if id(target) not in timed:
            own = cost.verify_curve(target, list(prompts[0].input_ids), list(curve), cfg.cost_repeats)
            timed[id(target)] = {n: t * pace for n, t in own.items()}
            t1 = timed[id(target)][1]
            _log(cfg, f"{name}'s own verification: t(N)/t(1) of the whole target: "
                      + ", ".join(f"{n}: {t / curve[1]:.2f}" for n, t in timed[id(target)].items())
                      + f" (t(1) {t1 * 1e3:.1f} ms)")
        out[name] = timed[id(target)]
    return out


def _summaries(cfg, records, memory, prompts, target, curve, by_length=None, own_curves=None) -> list[dict]:
    ids_map = {p.prompt_id: list(p.input_ids) for p in prompts}
    categories = report_categories(prompts)  # None: no prompt has a category
    results = []
    for temp in cfg.temperatures:
        at_t = [r for r in records if r.temperature == temp]
        ar = [r for r in at_t if r.method == "ar"]
        for method in dict.fromkeys(r.method for r in at_t):
            mine = [r for r in at_t if r.method == method]
            row = {"method": method, "temperature": temp, **metrics.summarize(mine, ar)}
            row["by_category"] = metrics.by_category(mine, ar, categories) if categories else None
            row["memory"] = memory.get(f"{method}@{temp:g}")
            row["verify_cost"] = _verify_cost(row, target)
            row["cost_model"] = (cost.predict(row, mine, curve, by_length, (own_curves or {}).get(method))
                                 if curve else None)
            row["self_check"] = None
            if temp == 0 and method != "ar":
                row["self_check"] = selfcheck.self_check(mine, ar, ids_map,
                                                         target if cfg.self_check == "classify" else None,
                                                         eos_token_id=_eos_id(cfg, target),
                                                         max_new_tokens=cfg.max_new_tokens)
            results.append(row)
    return results


def _verify_cost(row: dict, target) -> dict:
    """Tokens computed and recurrent states held per verification (STree §4); states are per SSM layer,
    0 for a KV-cache target. Tokens = drafted nodes + the root, averaged over rounds."""
    forwards = row["target_forwards"] or 1
    return {"tokens_per_verify": (row["gamma_total"] + row["target_forwards"]) / forwards,
            "states_per_verify": getattr(target, "states_per_verify", 0),
            "ssm_layers": getattr(target, "ssm_layers", 0)}


def _enforce_self_check(cfg, results, dtype, paths) -> None:
    """Fail on any defect; in fp32 on any difference at all (there the harness is bitwise lossless)."""
    import torch

    def failed(sc):
        return sc["defects"] > 0 or (dtype in (torch.float32, torch.float64) and sc["identical"] < sc["total"])

    bad = [r for r in results if r["self_check"] and failed(r["self_check"])]
    if not bad or not cfg.strict_selfcheck:
        return
    lines = [f"{r['method']}: {r['self_check']['identical']}/{r['self_check']['total']} prompts identical, "
             f"{r['self_check']['near_ties']} near-tie(s), {r['self_check']['defects']} defect(s) "
             f"(prompts {r['self_check']['mismatched_prompts'][:5]}"
             + (f"; AR itself parted from the model's plain forward on "
                f"{[d['prompt_id'] for d in r['self_check']['ar_divergences'] if d['verdict'] == 'defect'][:5]}"
                if r["self_check"].get("ar_defects") else "") + ")" for r in bad]
    rule = ("in fp32, where it must be identical" if dtype == torch.float32 else
            "beyond the rounding noise measured at the first differing position")
    raise SelfCheckError(
        f"greedy output differs from the AR baseline {rule}, so the decoding harness is not lossless: "
        + "; ".join(lines) + f". Evidence is in {paths.get('json')} (self_check.divergences and "
        ".ar_divergences); please report it with that file."
    )


def _graphs_used(drafter) -> str:
    """What --cuda-graphs resolved to: 'on'/'off' for a Mamba drafter, 'n/a' for other drafters or none."""
    graphed = None if drafter is None else drafter.cuda_graphs
    return "n/a" if graphed is None else ("on" if graphed else "off")


def _hf_policy(decoders: dict, at_start: dict | None = None) -> dict | None:
    """hf_assisted's own draft-length policy, read from the assistant's generation_config (None when
    hf_assisted does not run). Given the policy at the start, returns it with any end values that moved."""
    if "hf_assisted" not in decoders:
        return None
    policy = assisted_policy(getattr(getattr(decoders["hf_assisted"], "drafter", None), "model", None))
    if at_start is None:
        return policy
    moved = {k: policy[k] for k in ASSISTED_POLICY_KEYS if policy[k] != at_start[k]}
    return {**at_start, **({"at_end": moved} if moved else {})}


def _manifest(cfg, dtype, results, drafter, orders, hf_policy, regime: dict) -> dict:
    spreads = {f"{r['method']}@{r['temperature']:g}": r["tokens_per_s_spread"] for r in results}
    extra = {"cuda_graphs": _graphs_used(drafter), "method_order": orders, **regime}
    if hf_policy is not None:
        extra["hf_assisted_policy"] = hf_policy
    manifest = build_manifest(device=cfg.device, dtype=str(dtype).replace("torch.", ""), seed=cfg.seed,
                              repeats=cfg.repeats, command=cfg.command, tokens_per_s_spread=spreads,
                              extra={**extra, **cfg.extra_manifest})
    manifest["hardware"]["torch_threads"] = manifest.pop("torch_threads")  # the runs' count, not the caller's
    # (restored by the time the manifest is built)
    return manifest


def planned_rows(cfg: EvalConfig) -> list[int]:
    """Row counts to time before the runs (a validated config): the grid, plus every static chain and tree the
    methods verify."""
    options = resolved_options(cfg)
    rows = set(cost.GRID)
    for m in method_order(cfg)[0]:
        rows.update(method_registry.get_method(m).rows(options[m]))
    return sorted(rows)


def _component_memory(cfg, decoders, target, drafter, prompts, firsts: dict[int, int], eos) -> dict:
    """method -> length bucket -> memory of the target and the drafter apart (eval/components.py), from one
    untimed decode of the bucket's first prompt at the first temperature; {} with --no-component-memory. Methods
    that never call draftforge's target (transformers' assisted generation) are left out."""
    if not cfg.component_memory or not prompts:
        return {}
    params = sampling_params(cfg, cfg.temperatures[0])
    out = {}
    for method, dec in decoders.items():
        if not isinstance(dec, SpeculativeDecoder):  # transformers' own generate(), not draftforge's target
            continue
        for bucket, i in firsts.items():
            ids = prompts[i].input_ids
            found = components.measure(lambda: _run_one(dec, ids, cfg, params, i, eos), dec.target, dec.drafter,
                                       cfg.device)  # what the method calls: an EESD exit, lookup's own drafter
            if not found["target"]["calls"]:
                break
            out.setdefault(method, {})[bucket] = {"prompt_tokens": len(ids), **found}
            parts = [f"{name} state {part['state_bytes'] / 2**20:.2f} MiB, working +"
                     + ("?" if part["working_bytes"] is None else f"{part['working_bytes'] / 2**20:.1f}") + " MiB"
                     for name, part in (("target", found["target"]), ("drafter", found["drafter"]))
                     if part is not None and part["state_bytes"] is not None]
            _log(cfg, f"memory by component, {method} on {len(ids)} tokens: " + "; ".join(parts))
    return out


def _cost_curves(cfg, target, prompts, firsts: dict[int, int]) -> dict[int, dict[int, float]]:
    """Length bucket -> t(N) timed on the bucket's first prompt (`firsts`: cost.bucket_prompts; one bucket for a
    bench of short prompts); {} with --cost-repeats 0."""
    if not cfg.cost_repeats or not prompts:
        return {}
    curves = {}
    for bucket, i in firsts.items():
        ids = list(prompts[i].input_ids)
        rows = planned_rows(cfg)
        if target.max_context is not None:
            rows = [n for n in rows if len(ids) + n <= target.max_context]
        if not rows:  # the prompt fills the context: its bucket is priced with a neighbour's curve (cost.curve_for)
            _log(cfg, f"cost model: a prompt of {len(ids)} tokens leaves no room for a verification; no curve for "
                      "its length bucket")
            continue
        _log(cfg, f"cost model: timing one verification of N = {', '.join(map(str, rows))} rows on a prompt of "
                  f"{len(ids)} tokens ({cfg.cost_repeats} repeats after a warm-up)")
        curve = curves[bucket] = cost.verify_curve(target, ids, rows, cfg.cost_repeats)
        t1 = curve[1]
        _log(cfg, "t(N)/t(1): " + ", ".join(f"{n}: {t / t1:.2f}" for n, t in curve.items())
             + f" (t(1) = {t1 * 1e3:.1f} ms)")
    return curves


def _load(cfg):
    """Threads, dtypes (each said once, with the reason), target, drafter; the regime for the manifest."""
    import torch

    threads = choose_threads(cfg.threads)
    target_dtype = resolve_dtype(cfg.dtype, cfg.device)
    drafter_dtype = resolve_dtype(cfg.drafter_dtype or cfg.dtype, cfg.device)
    announce(target_dtype, "target", say=lambda line: _log(cfg, line))
    _log(cfg, threads)
    _log(cfg, f"loading target {cfg.target}")
    chunk = {"prefill_chunk": cfg.prefill_chunk} if cfg.prefill_chunk is not None else {}
    target = decode_api.load_target(cfg.target, device=cfg.device, dtype=target_dtype.torch_dtype,
                                    pack_weights=cfg.pack_weights, decode_attention=cfg.decode_attention,
                                    lean_forward=cfg.lean_forward, **chunk)
    target_packing = getattr(target.model, "draftforge_packing", None)  # None: the caller's model, as given
    packing = {"target": target_packing.describe() if target_packing else "the caller's model object, as given"}
    _log(cfg, f"target {packing['target']}")
    attention = {"target": getattr(target.model, "draftforge_attention", "the caller's model object, as given")}
    _log(cfg, f"target {attention['target']}")
    forward = {"target": getattr(target.model, "draftforge_forward", "the caller's model object, as given")}
    _log(cfg, f"target {forward['target']}")
    drafter = None
    if cfg.drafter is not None:
        announce(drafter_dtype, "drafter", say=lambda line: _log(cfg, line))
        _log(cfg, f"loading drafter {cfg.drafter}")
        drafter = decode_api.load_drafter(cfg.drafter, target, device=cfg.device, dtype=drafter_dtype.torch_dtype,
                                          allow_vocab_mismatch=cfg.allow_vocab_mismatch, cuda_graphs=cfg.cuda_graphs,
                                          pack_weights=cfg.pack_weights, decode_attention=cfg.decode_attention,
                                          lean_forward=cfg.lean_forward,
                                          **({"lookup_first": cfg.lookup_first} if cfg.lookup_first else {}),
                                          **({"head_window": cfg.head_window} if cfg.head_window else {}))
        if cfg.head_window is not None:
            _log(cfg, f"head window: the EAGLE-3 head attends to the last {cfg.head_window} committed tokens")
        if cfg.lookup_first is not None:
            _log(cfg, f"lookup first ({cfg.lookup_first}): prompt lookup drafts the rounds where it finds a match, "
                      f"the {drafter.drafter.kind} drafter the others")
        drafter_packing = getattr(getattr(drafter, "model", None), "draftforge_packing", None)
        if drafter_packing is not None:
            packing["drafter"] = drafter_packing.describe()
            _log(cfg, f"drafter {packing['drafter']}")
        drafter_attention = getattr(getattr(drafter, "model", None), "draftforge_attention", None)
        if drafter_attention is not None:
            attention["drafter"] = drafter_attention
            _log(cfg, f"drafter {drafter_attention}")
        drafter_forward = getattr(getattr(drafter, "model", None), "draftforge_forward", None)
        if drafter_forward is not None:
            forward["drafter"] = drafter_forward
            _log(cfg, f"drafter {drafter_forward}")
    regime = {"dtype_choice": {"target": target_dtype.as_dict(),
                               **({"drafter": drafter_dtype.as_dict()} if drafter is not None else {})},
              "threads": threads, "weight_packing": packing,
              "attention": attention, "forward": forward}
    return target, drafter, regime | {"torch_threads": torch.get_num_threads()}


def run_eval(cfg: EvalConfig) -> dict:
    """Run the evaluation described by cfg; write JSON/Markdown/PNG into cfg.out_dir and return the report."""
    import torch

    from draftforge.eval import report as report_mod

    given, cfg = cfg, validate(cfg)  # the report records the config as given; the runner reads the resolved one
    options = cfg.method_options
    check_paths(cfg)
    if cfg.answers:  # a directory that can be written, checked before any model loads
        answers_mod.check_answers_dir(cfg.answers, say=lambda line: _log(cfg, line))
    rows = load_prompt_rows(cfg.bench, cfg.num_prompts)  # a bad --bench fails here, before seconds of loading
    before = torch.get_num_threads()
    try:
        target, drafter, regime = _load(cfg)
        prompts = encode_prompts(rows, target.tokenizer, chat=cfg.chat_template, context_length=target.max_context,
                                 max_new_tokens=cfg.max_new_tokens, source=str(cfg.bench), all_turns=True,
                                 vocab_size=target.vocab_size)
        turns = sum(len(p.turns or [None]) for p in prompts)
        _log(cfg, f"{len(prompts)} prompts from {cfg.bench}" + (f", {turns} turns" if turns > len(prompts) else ""))
        if cfg.answers:
            answers_mod.require_tokenizer(target.tokenizer, cfg.target)
        decoders, skipped = _build_decoders(cfg, target, drafter)
        hf_policy = _hf_policy(decoders)  # read before the runs: a "heuristic" schedule changes it as it goes
        firsts = cost.bucket_prompts([len(p.input_ids) for p in prompts])  # length bucket -> its first prompt
        curves = _cost_curves(cfg, target, prompts, firsts)
        curve = curves.get(cost.length_bucket(len(prompts[0].input_ids)), {}) if curves else {}  # the first prompt's
        by_length = curves if len(curves) > 1 else None
        swaps, tuning = ({}, None) if not cfg.tune_chain_length else _tune_chain_length(
            cfg, decoders, target, drafter, options, prompts, curve, _eos_id(cfg, target), by_length)
        records, memory, orders = _timed_runs(cfg, decoders, prompts, _eos_id(cfg, target), target.tokenizer, swaps)
        by_component = _component_memory(cfg, decoders, target, drafter, prompts, firsts, _eos_id(cfg, target))
        after = None
        if curve:
            # t(1) again (did the machine's pace move during the runs?), and every row count a dynamic method
            # verified beyond the grid, scaled to the first curve's t(1)
            extra_rows = cost.missing_rows(curve, records)
            late = cost.verify_curve(target, list(prompts[0].input_ids), [1] + extra_rows, cfg.cost_repeats)
            curve.update({n: late[n] * curve[1] / late[1] for n in extra_rows})
            after = {"t1_s": late[1], "t1_before_s": curve[1]}
            for bucket, i in firsts.items():
                if by_length and by_length[bucket] is not curve and extra_rows:  # the same rows at each length
                    more = cost.verify_curve(target, list(prompts[i].input_ids), [1] + extra_rows, cfg.cost_repeats)
                    by_length[bucket].update({n: more[n] * by_length[bucket][1] / more[1] for n in extra_rows})
        own_curves = (_own_curves(cfg, decoders, prompts, curve, curve[1] / after["t1_s"])
                      if after is not None and not by_length else {})
        results = _summaries(cfg, records, memory, prompts, target, curve, by_length, own_curves)
        if after is not None:  # AR's own forward in its timed passes, against the t(1) it is priced at
            after["ar_forward_s"] = {f"{r['temperature']:g}": r["time"]["verify_s"] / r["target_forwards"]
                                     for r in results if r["method"] == "ar" and r["target_forwards"]}
        for row in results:  # the length each method's rounds drafted
            if row["method"] == "chain":
                row["chain_length"] = (tuning or {}).get(row["temperature"], {}).get(
                    "chosen", options["chain"].chain_length)
    finally:
        torch.set_num_threads(before)  # an in-process caller (a test) keeps its own setting
    dtype = _model_dtype(target.model)
    answer_files, answers_failed = None, None
    try:  # a failed answer file must not lose the measurement: the report is written first either way
        answer_files = None if not cfg.answers else answers_mod.write_answers(
            cfg.answers, records, prompts, target.tokenizer, name=answers_mod.target_name(cfg.target),
            dtype=str(dtype).replace("torch.", ""), say=lambda line: _log(cfg, line))
    except OSError as e:
        answers_failed = e
    report = {
        "schema": "draftforge.eval/1",
        "config": asdict(given),
        "conventions": report_mod.CONVENTIONS,
        "manifest": _manifest(cfg, dtype, results, drafter, orders, _hf_policy(decoders, hf_policy), regime),
        "cost_model": {"curve_s": curve, "what": f"{type(target).__name__}, prompt of "
                                                f"{len(prompts[0].input_ids) if prompts else 0} tokens, a chain of "
                                                f"N-1 drafts, median of {cfg.cost_repeats}", "chain_tuning": tuning,
                       "after_runs": after, "curves_by_length_s": by_length, "own_curves_s": own_curves or None,
                       "bucket_prompt_tokens": {b: len(prompts[i].input_ids) for b, i in firsts.items()}
                       if by_length else None},
        "prompts": [{"prompt_id": p.prompt_id, "category": p.category, "num_tokens": len(p.input_ids),
                     "chat_template": p.used_chat_template, "turns": len(p.turns or [None])} for p in prompts],
        "results": results,
        "component_memory": {"what": "one untimed decode of each length bucket's first prompt per method, at T="
                                     f"{cfg.temperatures[0]:g} (eval/components.py)", "by_method": by_component}
        if by_component else None,
        "skipped": skipped,
        "target_notes": sorted(getattr(target, "notes", ())),
        "answers": answer_files,
        "pace_warning": cost.pace_warning(records, after),
        "records": [r.to_dict() for r in records],
    }
    paths = save_or_rescue(report, cfg.out_dir, lambda rep: report_mod.write_reports(rep, cfg.out_dir, plots=cfg.plots))
    report["files"] = paths
    if answers_failed is not None:
        e = answers_failed
        raise DataError(f"could not write the answer files into {cfg.answers} ({e.strerror or e}); the report is "
                        f"written ({paths['json']}): free the space or shorten the path, and rerun for the answers")
    _enforce_self_check(cfg, results, dtype, paths)
    return report
