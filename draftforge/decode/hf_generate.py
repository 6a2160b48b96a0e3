"""transformers' `generate()` with any draftforge drafter: the lossless harness as a `custom_generate`.

    out = target.generate(**inputs, custom_generate=draftforge.speculative_generate,
                          drafter="runs/demo/drafter-sft/export", method="tree", max_new_tokens=128)
    out = target.generate(**inputs, custom_generate="runs/demo/drafter-sft/export", trust_remote_code=True,
                          tokenizer=tok, stop_strings=["\\n\\n"], streamer=TextStreamer(tok))   # an export's own

`drafter` is a path, a loaded model, a draftforge Drafter (an EESD exit, ...) or "prompt-lookup[:options]"; `method`
is any draftforge method (chain, tree, ucb, eagle2, c2t, eesd, the length controllers) with its options in
`method_options`. Honoured: max_new_tokens / max_length, eos_token_id, do_sample with temperature / top_k / top_p,
stop strings, max_time, stopping_criteria (checked after every token, as generate() does; their `scores` argument is
None), a streamer, return_dict_in_generate. Refused in one line: batch size > 1, padding, beams, several return
sequences, scores / logits outputs, logits warpers passed by hand, and every other logits processor (repetition
penalty, min length, ...), which would change the distribution the harness verifies against. Settings come as
generate() takes them: the call's arguments over generation_config over the model's own over transformers'
defaults (top_k 50 when sampling, 20 new tokens when no length is given).

transformers (5.24) hands a *callable* custom_generate neither `streamer` nor `tokenizer` (it keeps only what its
own `_sample` does not take), so `stop_strings` fail there before draftforge runs: with the callable, give
`stream=` (the streamer) and `stop=` with `stop_tokenizer=`; the export's directory form receives every argument
of generate() and takes the usual names.
"""

from __future__ import annotations

import time
import warnings
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

# GenerationConfig fields that add a logits processor or another output: value when off
_UNSUPPORTED_FIELDS = {
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_new_tokens": None,
    "min_length": 0, "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None,
    "forced_bos_token_id": None, "forced_eos_token_id": None, "sequence_bias": None, "typical_p": 1.0,
    "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "min_p": None, "guidance_scale": None, "renormalize_logits": False,
    "exponential_decay_length_penalty": None, "watermarking_config": None, "output_scores": False,
    "output_logits": False, "output_attentions": False, "output_hidden_states": False, "top_h": None,
}
_WARPERS = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper")


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
    for field, off in _UNSUPPORTED_FIELDS.items():
        value = getattr(gc, field, off)
        if value is not None and value != off:
            raise _refuse(f"{field}={value!r} is not supported (the harness verifies against the target's own "
                          "distribution; only temperature, top_k and top_p shape it)")
    settings = {"TemperatureLogitsWarper": ("temperature", gc.temperature), "TopKLogitsWarper": ("top_k", gc.top_k),
                "TopPLogitsWarper": ("top_p", gc.top_p)}
    for proc in logits_processor or ():
        name = type(proc).__name__
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
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise _refuse("padding is not supported (batch size 1, attention_mask all ones)")
    prompt = input_ids[0].tolist()
    max_new = gc.max_new_tokens if gc.max_new_tokens is not None else (gc.max_length or 20) - len(prompt)
    if max_new < 1:
        raise _refuse(f"nothing to generate: max_length {gc.max_length} is not above the prompt's {len(prompt)} tokens")
    dec = _decoder(model, drafter, method, dict(method_options or {}), stop_tokenizer)
    ctx = dec.target.max_context
    if ctx is not None and len(prompt) >= ctx:
        raise _refuse(f"the prompt has {len(prompt)} tokens and the target's context is {ctx}")
    if ctx is not None and len(prompt) + max_new > ctx:
        warnings.warn(f"speculative_generate: stops at the target's context of {ctx} tokens, {ctx - len(prompt)} new "
                      f"tokens instead of {max_new} (positions past it are undefined for the target)", stacklevel=2)
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
    eos = gc.eos_token_id if gc.eos_token_id is not None else []
    if stream is not None:
        stream.put(input_ids.cpu())
    try:
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
_IGNORED_IF_UNSET = ("prefix_allowed_tokens_fn", "assistant_model", "negative_prompt_ids",
                     "negative_prompt_attention_mask", "synced_gpus", "use_model_defaults", "assistant_tokenizer")


def is_the_export(model, export_dir: str) -> bool:
    """`model` was loaded from `export_dir` (or from a copy of it: the same draftforge.json)."""
    here = Path(str(getattr(model, "name_or_path", "") or ""))
    if not str(here) or not here.is_dir():
        return False
    if here.resolve() == Path(export_dir).resolve():
        return True
    mine, theirs = here / "draftforge.json", Path(export_dir) / "draftforge.json"
    return mine.is_file() and theirs.is_file() and mine.read_bytes() == theirs.read_bytes()


def generate_from_export(model, drafter_dir: str, *args, **kwargs):
    """The entry of an export's custom_generate/generate.py: generate()'s own arguments, this export as the drafter
    unless drafter= names another. Loading the export itself with trust_remote_code=True makes transformers put
    this function in place of the export's own generate(): that model is the drafter, not a target, so it gets
    plain generate() (with its positional input_ids, which the function used to refuse)."""
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
    unused = {k: v for k, v in unused.items() if v is not None and k not in ("use_cache", "pad_token_id")}
    if unused:
        raise _refuse(f"unknown or unsupported generate() argument(s): {', '.join(sorted(unused))}")
    if stop is None and gc.stop_strings:
        stop = gc.stop_strings
    gc.stop_strings = None
    return speculative_generate(model, input_ids, logits_processor=logits_processor,
                                stopping_criteria=stopping_criteria, generation_config=gc, stream=streamer, stop=stop,
                                stop_tokenizer=tokenizer, attention_mask=attention_mask, **passed)
