"""transformers' `generate()` with any draftforge drafter: the lossless harness as a `custom_generate`.

    out = target.generate(**inputs, custom_generate=draftforge.speculative_generate,
                          drafter="runs/demo/drafter-sft/export", method="tree", max_new_tokens=128)
    out = target.generate(**inputs, custom_generate="runs/demo/drafter-sft/export", trust_remote_code=True,
                          tokenizer=tok, stop_strings=["\\n\\n"], streamer=TextStreamer(tok))   # an export's own

`drafter` is a path, a loaded model, a draftforge Drafter (an EESD exit, ...) or "prompt-lookup[:options]"; `method`
is any draftforge method (chain, tree, ucb, eagle2, c2t, eesd, the length controllers) with its options in
`method_options`. Honoured: max_new_tokens / max_length, eos_token_id, do_sample with temperature / top_k / top_p,
stop strings, a streamer, return_dict_in_generate. Refused in one line: batch size > 1, padding, beams, several
return sequences, scores / logits outputs, and every other logits processor (repetition penalty, min length, ...),
which would change the distribution the harness verifies against.

transformers (5.24) hands a *callable* custom_generate neither `streamer` nor `tokenizer` (it keeps only what its
own `_sample` does not take), so `stop_strings` fail there before draftforge runs: with the callable, give
`stream=` (the streamer) and `stop=` with `stop_tokenizer=`; the export's directory form receives every argument
of generate() and takes the usual names.
"""

from __future__ import annotations

import copy
import weakref

import torch

from draftforge.decode.drafters.base import Drafter
from draftforge.decode.loading import load_drafter, load_target
from draftforge.decode.methods import build as build_decoder
from draftforge.errors import CompatibilityError, DraftforgeError

_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {"target": Target, key: decoder}

# GenerationConfig fields that add a logits processor or another output: value when off
_UNSUPPORTED_FIELDS = {
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_new_tokens": None,
    "min_length": 0, "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None,
    "forced_bos_token_id": None, "forced_eos_token_id": None, "sequence_bias": None, "typical_p": 1.0,
    "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "min_p": None, "guidance_scale": None, "renormalize_logits": False,
    "exponential_decay_length_penalty": None, "watermarking_config": None, "output_scores": False,
    "output_logits": False, "output_attentions": False, "output_hidden_states": False,
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
    if name and Path(name).is_dir():
        try:
            return AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError, TypeError):
            return None
    return None


def _decoder(model, drafter, method: str, options: dict, tokenizer):
    """The harness for (model, drafter, method, options), built once and reused across generate() calls."""
    if drafter is None:
        raise _refuse("give drafter= (a drafter directory, a loaded model, a draftforge Drafter or 'prompt-lookup')")
    if method.startswith("hf_"):
        raise _refuse(f"method {method!r} is transformers' own generation: call generate() with assistant_model= or "
                      "prompt_lookup_num_tokens= instead of custom_generate")
    cache = _CACHE.setdefault(model, {})
    if "target" not in cache:
        cache["target"] = load_target(model, device=model.device, tokenizer=_target_tokenizer(model, tokenizer))
    target = cache["target"]
    key = (drafter if isinstance(drafter, str) else id(drafter), method, repr(sorted(options.items())))
    if key not in cache:
        if isinstance(drafter, Drafter):
            built = drafter
        else:
            built = load_drafter(drafter, target, device=model.device, dtype=model.dtype)
        cache[key] = build_decoder(method, target, built, **options)
    return cache[key]


def _sampling(gc, logits_processor) -> tuple[float, int, float]:
    """(temperature, top_k, top_p) of a GenerationConfig; anything the harness cannot verify exactly is refused."""
    if (gc.num_beams or 1) > 1:
        raise _refuse("beam search (num_beams > 1) is not speculative decoding; use num_beams=1")
    if (gc.num_return_sequences or 1) > 1:
        raise _refuse("one sequence per prompt (num_return_sequences=1)")
    for field, off in _UNSUPPORTED_FIELDS.items():
        value = getattr(gc, field, off)
        if value is not None and value != off:
            raise _refuse(f"{field}={value!r} is not supported (the harness verifies against the target's own "
                          "distribution; only temperature, top_k and top_p shape it)")
    for proc in logits_processor or ():
        if type(proc).__name__ not in _WARPERS:
            raise _refuse(f"logits processor {type(proc).__name__} is not supported (only temperature, top_k, top_p)")
    if not gc.do_sample:
        return 0.0, 0, 1.0
    return float(gc.temperature or 1.0), int(gc.top_k or 0), float(gc.top_p or 1.0)


def speculative_generate(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                         drafter=None, method: str = "chain", method_options: dict | None = None, seed: int | None = None,
                         stream=None, stop=None, stop_tokenizer=None, **model_kwargs):
    """transformers' `custom_generate` callable: decode input_ids [1, T] with the target `model` and `drafter`."""
    gc = generation_config if generation_config is not None else copy.deepcopy(model.generation_config)
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
    stops = None
    if stop:
        from transformers.generation.stopping_criteria import StopStringCriteria

        if stop_tokenizer is None:
            raise _refuse("stop strings need a tokenizer (stop_tokenizer= with the callable, tokenizer= otherwise)")
        stops = StopStringCriteria(tokenizer=stop_tokenizer, stop_strings=stop)
    if stream is not None:
        stream.put(input_ids.cpu())
    seq, kept = list(prompt), []

    def on_tokens(emitted: list[int]) -> bool:
        cut = None
        for i, tok in enumerate(emitted):
            seq.append(tok)
            # the criteria read only the last maximum_token_len ids: hand over no more (this runs per token)
            if stops is not None and bool(stops(torch.tensor([seq[-stops.maximum_token_len:]]), None)[0]):
                cut = i + 1
                break
        chunk = emitted if cut is None else emitted[:cut]
        kept.extend(chunk)
        if stream is not None and chunk:
            stream.put(torch.tensor(chunk))
        return cut is not None

    if seed is None:  # as generate() samples: from torch's global generator (torch.manual_seed makes it repeat)
        seed = int(torch.randint(0, 2**31 - 1, ()))
    eos = gc.eos_token_id if gc.eos_token_id is not None else []
    dec.generate(prompt, max_new_tokens=max_new, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                 eos_token_id=eos, on_tokens=on_tokens)
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


def generate_from_export(model, drafter_dir: str, inputs=None, generation_config=None, logits_processor=None,
                         stopping_criteria=None, streamer=None, **kwargs):
    """The entry of an export's custom_generate/generate.py: generate()'s own arguments, this export as the drafter
    unless drafter= names another."""
    if logits_processor or stopping_criteria:
        raise _refuse("extra logits processors or stopping criteria are not supported; use stop_strings= for stops")
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
    gc = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    unused = gc.update(**kwargs)
    unused = {k: v for k, v in unused.items() if v is not None and k not in ("use_cache", "pad_token_id")}
    if unused:
        raise _refuse(f"unknown or unsupported generate() argument(s): {', '.join(sorted(unused))}")
    if stop is None and gc.stop_strings:
        stop = gc.stop_strings
    gc.stop_strings = None
    return speculative_generate(model, input_ids, generation_config=gc, stream=streamer, stop=stop,
                                stop_tokenizer=tokenizer, attention_mask=attention_mask, **passed)
