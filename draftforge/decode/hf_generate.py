"""transformers' `generate()` with any draftforge drafter: the lossless harness as a `custom_generate`.

    out = target.generate(**inputs, custom_generate=draftforge.speculative_generate,
                          drafter="runs/demo/drafter-sft/export", method="tree", max_new_tokens=128)
    out = target.generate(**inputs, custom_generate="runs/demo/drafter-sft/export", trust_remote_code=True,
                          tokenizer=tok, stop_strings=["\\n\\n"], streamer=TextStreamer(tok))   # an export's own

`drafter` is a path, a loaded model, a draftforge Drafter (an EESD exit, ...) or "prompt-lookup[:options]"; `method`
is any draftforge method (chain, tree, ucb, eagle2, c2t, eesd, the length controllers) with its options in
`method_options`. Honoured: max_new_tokens / max_length, eos_token_id, do_sample with temperature / top_k / top_p,
stop strings, max_time, stopping_criteria (checked after every token, as generate() does; their `scores` argument is
None; a caller's MaxLengthCriteria / EosTokenCriteria replaces the config's, as in generate()), a streamer,
return_dict_in_generate (the output carries no cache; a cache passed in is not read: the whole prompt is prefilled,
the output is the same). Refused in one line: batch size > 1, padding, beams, several return sequences, scores /
logits outputs, logits warpers passed by hand, every other logits processor (repetition penalty, min length, ...),
which would change the distribution the harness verifies against, and the other decoding modes (contrastive search,
DoLa, constrained search). A setting generate() itself ignores (min_p when greedy, guidance_scale 1) is accepted.
Settings come as generate() takes them: the call's arguments over generation_config over the model's own over
transformers' defaults (top_k 50 when sampling, 20 new tokens when no length is given).

transformers (5.24) hands a *callable* custom_generate neither `streamer` nor `tokenizer` (it keeps only what its
own `_sample` does not take), so `stop_strings` fail there before draftforge runs: with the callable, give
`stream=` (the streamer, never `streamer=`: generate() sends that one the prompt and nothing more) and `stop=` with
`stop_tokenizer=`; the export's directory form receives every argument of generate() and takes the usual names.
Calls on one model from several threads take turns (they share its harness and caches).
"""

from __future__ import annotations

import json
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from pathlib import Path

import torch

from draftforge.decode.drafters.base import Drafter
from draftforge.decode.loading import load_drafter, load_target
from draftforge.decode.methods import build as build_decoder
from draftforge.errors import CompatibilityError, DraftforgeError

# Each model keeps its harness in this attribute (a plain dict, so not a submodule): {"target": Target, "decoders":
# OrderedDict key -> decoder, the last _KEEP used}. It lives and dies with the model; a module-level map from models
# would keep every model alive, since its values (the Target) hold the model.
_ATTR = "_draftforge_speculative_cache"
_KEEP = 4
# A model's harness holds one KV cache per decoder, so generate() calls on one model from several threads (a server
# with one thread per request, as TextIteratorStreamer invites) take turns; each model's lock dies with the model
# (kept here, not on the model: a lock cannot be deep-copied or pickled with it)
_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


def _lock(model) -> threading.Lock:
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(model, threading.Lock())

# GenerationConfig fields that make generate() add a logits processor, pick another decoding mode or return an
# output the harness does not have; each with the test generate() (transformers 5.24, generation/utils.py and
# configuration_utils.py) applies to it, so a value generate() itself ignores (min_p when greedy, guidance_scale 1,
# suppress_tokens []) is accepted rather than refused
def _sampled(gc) -> bool:
    return bool(gc.do_sample)


def _positive(v) -> bool:
    return v is not None and v > 0


def _eos(gc) -> bool:
    return gc.eos_token_id is not None


_ACTIVE = {
    "repetition_penalty": lambda v, gc: v is not None and v != 1.0,
    "encoder_repetition_penalty": lambda v, gc: v is not None and v != 1.0,
    "no_repeat_ngram_size": lambda v, gc: _positive(v),
    "encoder_no_repeat_ngram_size": lambda v, gc: _positive(v),
    "min_new_tokens": lambda v, gc: _positive(v) and _eos(gc),  # before min_length, which generate() sets from it
    "min_length": lambda v, gc: _positive(v) and _eos(gc),
    "bad_words_ids": lambda v, gc: v is not None,
    "suppress_tokens": lambda v, gc: bool(v),
    "begin_suppress_tokens": lambda v, gc: bool(v),
    "sequence_bias": lambda v, gc: bool(v),
    "forced_bos_token_id": lambda v, gc: v is not None,
    "forced_eos_token_id": lambda v, gc: v is not None,
    "remove_invalid_values": lambda v, gc: v is True,
    "exponential_decay_length_penalty": lambda v, gc: v is not None,
    "guidance_scale": lambda v, gc: v is not None and v != 1,
    "watermarking_config": lambda v, gc: v is not None,
    "token_healing": lambda v, gc: bool(v),
    # warpers generate() adds only when sampling
    "top_h": lambda v, gc: _sampled(gc) and v is not None,
    "min_p": lambda v, gc: _sampled(gc) and _positive(v),
    "typical_p": lambda v, gc: _sampled(gc) and v is not None and v < 1.0,
    "epsilon_cutoff": lambda v, gc: _sampled(gc) and v is not None and 0.0 < v < 1.0,
    "eta_cutoff": lambda v, gc: _sampled(gc) and v is not None and 0.0 < v < 1.0,
    # other decoding modes: contrastive search, DoLa, constrained beam search
    "penalty_alpha": lambda v, gc: not _sampled(gc) and _positive(v) and gc.top_k is not None and gc.top_k > 1,
    "dola_layers": lambda v, gc: v is not None,
    "constraints": lambda v, gc: v is not None,
    "force_words_ids": lambda v, gc: v is not None,
    # outputs generate() returns only with return_dict_in_generate
    "output_scores": lambda v, gc: bool(v) and bool(gc.return_dict_in_generate),
    "output_logits": lambda v, gc: bool(v) and bool(gc.return_dict_in_generate),
    "output_attentions": lambda v, gc: bool(v) and bool(gc.return_dict_in_generate),
    "output_hidden_states": lambda v, gc: bool(v) and bool(gc.return_dict_in_generate),
}
_WARPERS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper")
# processors generate() builds that leave the distribution as it is: no tokens suppressed, a min-p of 0, and the
# final log-softmax of renormalize_logits (sampling and argmax read the same distribution)
_NO_OPS = {"SuppressTokensLogitsProcessor": lambda p: p.suppress_tokens.numel() == 0,
           "MinPLogitsWarper": lambda p: p.min_p == 0, "LogitNormalization": lambda p: True}


def _refuse(what: str) -> DraftforgeError:
    return CompatibilityError(f"speculative_generate: {what}")


def _target_tokenizer(model, given):
    if given is not None:
        return given
    from pathlib import Path

    from transformers import AutoTokenizer

    name = getattr(model.config, "_name_or_path", "") or ""
    if not name:
        return None
    try:  # a local directory, or a Hub id whose files are in the local cache (never a download here)
        return AutoTokenizer.from_pretrained(name, local_files_only=not Path(name).is_dir())
    except (OSError, ValueError, TypeError, ImportError):
        return None


def _decoder(model, drafter, method: str, options: dict, tokenizer):
    """The harness for (model, drafter, method, options), built once and reused across generate() calls."""
    if drafter is None:
        raise _refuse("give drafter= (a drafter directory, a loaded model, a draftforge Drafter or 'prompt-lookup')")
    if method.startswith("hf_"):
        raise _refuse(f"method {method!r} is transformers' own generation: call generate() with assistant_model= or "
                      "prompt_lookup_num_tokens= instead of custom_generate")
    cache = model.__dict__.get(_ATTR)
    if (cache is None or (cache["target"].tokenizer is None and tokenizer is not None)
            or cache["key"] != (str(model.device), model.dtype)):
        # first call; a tokenizer given now where the target had none (drafters are checked against it); or the
        # model moved to another device or dtype since (the harness's caches and drafters were built for the old)
        cache = {"target": load_target(model, device=model.device, tokenizer=_target_tokenizer(model, tokenizer)),
                 "decoders": OrderedDict(), "key": (str(model.device), model.dtype)}
        model.__dict__[_ATTR] = cache
    target, decoders = cache["target"], cache["decoders"]
    key = (drafter if isinstance(drafter, str) else id(drafter), method, repr(sorted(options.items())))
    if key not in decoders:
        if isinstance(drafter, Drafter):
            built = drafter
        else:
            built = load_drafter(drafter, target, device=model.device, dtype=model.dtype)
        decoders[key] = (drafter, build_decoder(method, target, built, **options))  # the drafter kept: its id stays
        while len(decoders) > _KEEP:
            decoders.popitem(last=False)
    decoders.move_to_end(key)
    return decoders[key][1]


def _prepared_config(model, generation_config, kwargs: dict, prompt_len: int):
    """(GenerationConfig, unused kwargs) as generate() prepares them: the call's arguments over `generation_config`
    over the model's own over transformers' defaults, and max_length as generate() sets it when no length is given
    (the prompt + 20, at most the model's max_position_embeddings)."""
    default_length = (kwargs.get("max_length") is None
                      and (generation_config is None or generation_config.max_length is None)
                      and model.generation_config.max_length is None)
    prepare = getattr(model, "_prepare_generation_config", None)
    if prepare is None:
        import transformers

        raise _refuse(f"transformers {transformers.__version__} has no GenerationMixin._prepare_generation_config, "
                      "which draftforge uses to read generate()'s settings as generate() does")
    gc, unused = prepare(generation_config, **kwargs)
    if gc.max_new_tokens is None and default_length:
        gc.max_length = gc.max_length + prompt_len
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit is not None:
            gc.max_length = min(gc.max_length, limit)
    return gc, unused


def _sampling(gc, logits_processor) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) of a GenerationConfig; anything the harness cannot verify exactly is refused.
    The warpers generate() built from `gc` are in `logits_processor` already; one that says otherwise was passed by
    hand, and is refused rather than ignored."""
    if (gc.num_beams or 1) > 1:
        raise _refuse("beam search (num_beams > 1) is not speculative decoding; use num_beams=1")
    if (gc.num_return_sequences or 1) > 1:
        raise _refuse("one sequence per prompt (num_return_sequences=1)")
    for field, active in _ACTIVE.items():
        value = getattr(gc, field, None)
        if active(value, gc):
            raise _refuse(f"{field}={value!r} is not supported (the harness verifies against the target's own "
                          "distribution: only temperature, top_k and top_p shape it, and it returns the sequences)")
    settings = {"TemperatureLogitsWarper": ("temperature", gc.temperature), "TopKLogitsWarper": ("top_k", gc.top_k),
                "TopPLogitsWarper": ("top_p", gc.top_p)}
    for proc in logits_processor or ():
        name = type(proc).__name__
        if name in _NO_OPS and _NO_OPS[name](proc):
            continue
        if name not in _WARPERS:
            raise _refuse(f"logits processor {name} is not supported (only temperature, top_k, top_p)")
        field, value = settings[name]
        have = getattr(proc, field, None)
        if not gc.do_sample or value is None or have is None or float(have) != float(value):
            raise _refuse(f"{name}({field}={have}) passed by hand is not supported: give {field}= (and "
                          "do_sample=True) to generate() instead")
    if not gc.do_sample:
        return 0.0, 0, 1.0
    temperature = 1.0 if gc.temperature is None else float(gc.temperature)
    if not temperature > 0:
        raise _refuse(f"temperature={gc.temperature} with do_sample=True: sampling needs a temperature > 0 "
                      "(for greedy decoding pass do_sample=False)")
    top_k = 0 if gc.top_k is None else int(gc.top_k)
    top_p = 1.0 if gc.top_p is None else float(gc.top_p)
    if top_k < 0 or not 0.0 <= top_p <= 1.0:
        raise _refuse(f"top_k={gc.top_k} / top_p={gc.top_p}: top_k must be >= 0 and top_p in [0, 1]")
    return temperature, top_k, top_p  # top_p 0 keeps the most likely token, the one of a tie generate() keeps


_ENFORCED = ("MaxLengthCriteria", "EosTokenCriteria")  # the harness stops there itself, exactly as these would


def _limits(criteria, gc, prompt_len: int) -> tuple[int, list[int]]:
    """(new tokens at most, eos ids) as generate() stops: from the generation config, except where the stopping
    criteria hold a MaxLengthCriteria or EosTokenCriteria, which generate() puts in place of the ones it builds from
    that config (a user's own takes precedence). The harness stops there itself instead of checking them per token."""
    max_new = gc.max_new_tokens if gc.max_new_tokens is not None else (gc.max_length or 20) - prompt_len
    eos = _ids(gc.eos_token_id)
    for c in criteria or ():
        name = type(c).__name__
        if name == "MaxLengthCriteria":
            max_new = max(c.max_length - prompt_len, 1)  # generate() checks after a token: one at least
        elif name == "EosTokenCriteria":
            eos = _ids(c.eos_token_id)
    return max_new, eos


def _ids(value) -> list[int]:
    """eos ids as generate() accepts them: None, an int, a list or a tensor (0-d included)."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.flatten().tolist()]
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def speculative_generate(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                         drafter=None, method: str = "chain", method_options: dict | None = None,
                         seed: int | None = None, stream=None, stop=None, stop_tokenizer=None, **model_kwargs):
    """transformers' `custom_generate` callable: decode input_ids [1, T] with the target `model` and `drafter`."""
    if generation_config is None:  # called directly, not through generate(): read the settings as generate() would
        generation_config, _ = _prepared_config(model, None, {}, input_ids.shape[-1])
    gc = generation_config
    temperature, top_k, top_p = _sampling(gc, logits_processor)  # first: beams and several sequences widen the batch
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise _refuse(f"one sequence at a time (batch size 1); got input_ids of shape {tuple(input_ids.shape)}")
    foreign = sorted(k for k, v in model_kwargs.items() if v is not None and k not in _MODEL_KWARGS)
    if foreign:  # e.g. inputs_embeds: generate() prefills from them; the harness reads input_ids only
        raise _refuse(f"unsupported generate() argument(s): {', '.join(foreign)} (the harness decodes from "
                      "input_ids alone)")
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise _refuse("padding is not supported (batch size 1, attention_mask all ones)")
    prompt = input_ids[0].tolist()
    max_new, eos = _limits(stopping_criteria, gc, len(prompt))
    if max_new < 1:
        raise _refuse(f"nothing to generate: max_length {gc.max_length} is not above the prompt's {len(prompt)} tokens")
    lock = _lock(model)  # one call at a time per model: its decoders and their caches are reused across calls
    with lock:
        dec = _decoder(model, drafter, method, dict(method_options or {}), stop_tokenizer)
    ctx = dec.target.max_context
    if ctx is not None and len(prompt) >= ctx:
        raise _refuse(f"the prompt has {len(prompt)} tokens and the target's context is {ctx}")
    if ctx is not None and len(prompt) + max_new > ctx:
        warnings.warn(f"speculative_generate: stops at the target's context of {ctx} tokens, {ctx - len(prompt)} new "
                      f"tokens instead of {max_new} (positions past it are undefined for the target)", stacklevel=2)
        max_new = ctx - len(prompt)  # said once, here (the harness would say it again)
    checks = [c for c in stopping_criteria or () if type(c).__name__ not in _ENFORCED]
    if gc.max_time is not None and not any(type(c).__name__ == "MaxTimeCriteria" for c in checks):
        from transformers.generation.stopping_criteria import MaxTimeCriteria

        checks.append(MaxTimeCriteria(gc.max_time, initial_timestamp=time.time()))
    if stop:
        from transformers.generation.stopping_criteria import StopStringCriteria

        if stop_tokenizer is None:
            raise _refuse("stop strings need a tokenizer (stop_tokenizer= with the callable, tokenizer= otherwise)")
        checks.append(StopStringCriteria(tokenizer=stop_tokenizer, stop_strings=stop))
    # this runs per token: stop strings read only their last maximum_token_len ids and a time limit none, so hand
    # them no more than that; a user's own criterion may read the whole sequence
    window = None
    if all(type(c).__name__ in ("StopStringCriteria", "MaxTimeCriteria") for c in checks):
        window = max([c.maximum_token_len for c in checks if hasattr(c, "maximum_token_len")], default=1)
    seq, kept = list(prompt), []

    def on_tokens(emitted: list[int]) -> bool:
        cut = None
        for i, tok in enumerate(emitted):
            seq.append(tok)
            if checks:  # after every token, as generate() checks its criteria (scores: None, the harness has none)
                ids = torch.tensor([seq if window is None else seq[-window:]])
                if any(bool(c(ids, None)[0]) for c in checks):
                    cut = i + 1
                    break
        chunk = emitted if cut is None else emitted[:cut]
        kept.extend(chunk)
        if stream is not None and chunk:
            stream.put(torch.tensor(chunk))
        return cut is not None

    if seed is None and temperature > 0:  # as generate() samples: from torch's global generator (manual_seed: repeats)
        seed = int(torch.randint(0, 2**31 - 1, ()))
    if stream is not None:
        stream.put(input_ids.cpu())
    try:
        with lock:
            dec.generate(prompt, max_new_tokens=max_new, temperature=temperature, top_p=top_p, top_k=top_k,
                         seed=seed or 0, eos_token_id=eos, on_tokens=on_tokens)
    finally:  # a consumer of TextIteratorStreamer waits for end(): it comes on an error too
        if stream is not None:
            stream.end()
    sequences = torch.tensor([prompt + kept], dtype=input_ids.dtype, device=input_ids.device)
    if gc.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


_PASSED_ON = ("drafter", "method", "method_options", "seed")
_NOT_READ = ("use_cache", "pad_token_id", "cache", "past_key_values",
             "output_attentions", "output_hidden_states")  # ignored by generate() too unless it returns a dict:
# then _sampling refuses them from the generation config, with the reason
# what generate() hands a custom_generate callable in every call (transformers 5.24); the harness builds its own cache
# and positions from input_ids, so any other model argument would be dropped while it changes the output
_MODEL_KWARGS = ("attention_mask", "position_ids", "cache_position", "logits_to_keep", "cache", "past_key_values",
                 "use_cache", "output_attentions", "output_hidden_states")  # the last two as in _NOT_READ
_IGNORED_IF_UNSET = ("prefix_allowed_tokens_fn", "assistant_model", "negative_prompt_ids",
                     "negative_prompt_attention_mask", "synced_gpus", "use_model_defaults", "assistant_tokenizer")


def _pads(input_ids, gc) -> bool:
    """Whether generate() would infer padding from these ids (no attention_mask given): the pad token is in them
    and is not an eos token (generation/utils.py, _prepare_attention_mask_for_generation)."""
    pad = _ids(gc.pad_token_id)
    return bool(pad) and bool(torch.isin(input_ids, torch.tensor(pad)).any()) and not set(pad) & set(_ids(
        gc.eos_token_id))


def _check_export_id(drafter_dir: str, export_id: str) -> None:
    from draftforge.errors import CompatibilityError

    meta = Path(drafter_dir) / "draftforge.json"
    try:
        there = json.loads(meta.read_text()).get("export_id")
    except (OSError, ValueError):
        there = None
    if there != export_id:
        now = "no draftforge export" if there is None and not meta.is_file() else "another export"
        raise CompatibilityError(
            f"this custom_generate/generate.py was written for the export at {drafter_dir} (export_id {export_id}), "
            f"which holds {now} by now; pass drafter= the directory of the export to decode with (this copy's)")


def is_the_export(model, export_dir: str) -> bool:
    """`model` was loaded from `export_dir` (or from a copy of it: the same draftforge.json)."""
    here = Path(str(getattr(model, "name_or_path", "") or ""))
    if not str(here) or not here.is_dir():
        return False
    if here.resolve() == Path(export_dir).resolve():
        return True
    mine, theirs = here / "draftforge.json", Path(export_dir) / "draftforge.json"
    return mine.is_file() and theirs.is_file() and mine.read_bytes() == theirs.read_bytes()


def generate_from_export(model, drafter_dir: str, *args, export_id: str | None = None, **kwargs):
    """The entry of an export's custom_generate/generate.py: generate()'s own arguments, this export as the drafter
    unless drafter= names another. Loading the export itself with trust_remote_code=True makes transformers put
    this function in place of the export's own generate(): that model is the drafter, not a target, so it gets
    plain generate() (with its positional input_ids, which the function used to refuse).

    transformers runs a cached copy of generate.py, so the file cannot find its own directory: it names the one it
    was written into, with `export_id`. A copy of the export whose original directory holds another export by now
    (or none) would decode with that one: refused, naming drafter= as the way out."""
    if export_id is not None and "drafter" not in kwargs:
        _check_export_id(drafter_dir, export_id)
    if is_the_export(model, drafter_dir):
        from transformers.generation.utils import GenerationMixin

        return GenerationMixin.generate(model, *args, **kwargs)
    if args:
        if len(args) > 1 or "inputs" in kwargs:
            raise _refuse("give the prompt as the one positional argument (or inputs=), the rest by name")
        kwargs["inputs"] = args[0]
    return _generate_from_export(model, drafter_dir, **kwargs)


def _generate_from_export(model, drafter_dir: str, inputs=None, generation_config=None, logits_processor=None,
                          stopping_criteria=None, streamer=None, **kwargs):
    for name in _IGNORED_IF_UNSET:
        if kwargs.pop(name, None) not in (None, False):
            raise _refuse(f"{name} is not supported")
    input_ids = kwargs.pop("input_ids", None)
    input_ids = inputs if inputs is not None else input_ids
    if input_ids is None:
        raise _refuse("give input_ids (or inputs)")
    passed = {k: kwargs.pop(k) for k in _PASSED_ON if k in kwargs}
    passed.setdefault("drafter", drafter_dir)
    tokenizer, stop = kwargs.pop("tokenizer", None), kwargs.pop("stop_strings", None)
    attention_mask = kwargs.pop("attention_mask", None)
    gc, unused = _prepared_config(model, generation_config, kwargs, input_ids.shape[-1])
    # a cache passed in is not read, as with the callable (the harness prefills the whole prompt)
    unused = {k: v for k, v in unused.items() if v is not None and k not in _NOT_READ}
    if unused:
        raise _refuse(f"unknown or unsupported generate() argument(s): {', '.join(sorted(unused))}")
    if attention_mask is None and _pads(input_ids, gc):
        raise _refuse("padding is not supported (batch size 1): the prompt holds the pad token, which generate() "
                      "reads as padding when no attention_mask is given")
    if stop is None and gc.stop_strings:
        stop = gc.stop_strings
    gc.stop_strings = None
    return speculative_generate(model, input_ids, logits_processor=logits_processor,
                                stopping_criteria=stopping_criteria, generation_config=gc, stream=streamer, stop=stop,
                                stop_tokenizer=tokenizer, attention_mask=attention_mask, **passed)
