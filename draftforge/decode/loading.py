"""Loading: `load_target` (a Target for a model or checkpoint) and `load_drafter` (a drafter for a checkpoint,
checked against and bound to its target), each picking the implementation the model needs.

The interfaces live in targets.py and drafter_base.py (Drafter re-exported here).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn
from transformers import AutoTokenizer, PreTrainedModel

from draftforge.decode.drafters.cuda_graphs import use_cuda_graphs
from draftforge.decode.drafters.base import Drafter, propose_children  # noqa: F401  (public names)
from draftforge.decode.drafters.transformer import TransformerDrafter
from draftforge.decode.drafters.lookup import DEFAULT_MAX_NGRAM, PromptLookupDrafter
from draftforge.decode.drafters.lookup_first import DEFAULT_MIN_NGRAM as DEFAULT_LOOKUP_FIRST_MIN_NGRAM
from draftforge.decode.drafters.lookup_first import LookupFirstDrafter
from draftforge.decode.drafters.mamba import MambaDrafter
from draftforge.decode.attention import use_decode_attention, use_head_attention
from draftforge.decode.lean_forward import lean_forward
from draftforge.decode.packing import PackReport, pack_linears
from draftforge.decode.targets import SSM_MODEL_TYPES, KVCacheTarget, Target, is_recurrent_model
from draftforge.errors import CompatibilityError, RecipeError
from draftforge.loading import read_tokenizer

LOOKUP_NAMES = ("prompt-lookup", "prompt_lookup")  # drafter specs that name the model-free n-gram drafter
LOOKUP_KEYS = {"ngram": "max_ngram", "min_ngram": "min_ngram", "tokens": "max_tokens"}  # spec key -> keyword
LOOKUP_FORM = ("prompt-lookup, or prompt-lookup:KEY=N,... with keys ngram (longest n-gram matched, "
               f"default {DEFAULT_MAX_NGRAM}), min_ngram (shortest, default 1), tokens (most drafts per round, "
               "default: the plan's depth), e.g. prompt-lookup:ngram=3,tokens=10")


PACK_CHOICES = ("auto", "on", "off")


def check_speed_choices(pack_weights: str, decode_attention: str, lean: str = "auto") -> None:
    for name, value in (("pack_weights", pack_weights), ("decode_attention", decode_attention),
                        ("lean_forward", lean)):
        if value not in PACK_CHOICES:
            raise RecipeError(f"{name} must be one of {', '.join(PACK_CHOICES)}, got {value!r}")


def load_hf_causal_lm(model_or_path, device, dtype, what: str, pack_weights: str = "auto",
                      decode_attention: str = "auto", lean: str = "auto"):
    """(model, tokenizer or None) from a loaded model or a local/Hub path, in eval mode.

    pack_weights: "on" packs its linear weights for oneDNN where that changes no number (decode/packing.py: faster
    bf16 on CPU); "auto" does it for a model loaded here from a path, never for a model object the caller passed
    (it stays as given); "off" never. What happened is in `model.draftforge_packing` (a PackReport), except on
    a caller's model left unpacked.

    decode_attention: "on" switches a CPU bf16/fp16 Llama-family model's attention to draftforge's float32
    matmul attention for few query rows (decode/attention.py: much faster against a long cache; bf16 outputs may
    part from transformers' sdpa at near-ties, fp32 untouched); "auto" as for pack_weights; "off" never. What
    happened is in `model.draftforge_attention` (words).

    lean: "on" gives a Llama model draftforge's decoding forward for up to 64 tokens (decode/lean_forward.py: the
    same tensor operations without transformers' per-layer Python, q/k/v and gate/up fused where packed; built only
    where a probe decode is bitwise equal to the model's own forward, so no output changes); "auto" as for
    pack_weights; "off" never. It is in `model.draftforge_lean` (None: the model's own forward), what happened
    in `model.draftforge_forward` (words)."""
    check_speed_choices(pack_weights, decode_attention, lean)
    tokenizer = None
    given = isinstance(model_or_path, PreTrainedModel)
    if given:
        model = model_or_path
    else:
        from draftforge.loading import load_causal_lm

        model = load_causal_lm(model_or_path, what=what, dtype=dtype)  # safetensors only; missing dir named
        if what == "drafter":  # a bare checkpoint without tokenizer files is still usable with token ids
            tokenizer = read_tokenizer(model_or_path, what)
        else:
            try:
                tokenizer = AutoTokenizer.from_pretrained(str(model_or_path))
            except (OSError, ValueError, TypeError):
                tokenizer = None
    if dtype is not None and model.dtype != dtype:  # loaded in it already: a cast would round RoPE's inv_freq too
        model = model.to(dtype)
    model = model.to(device).eval()
    if pack_weights == "on" or (pack_weights == "auto" and not given):
        model.draftforge_packing = pack_linears(model)
    elif not given:
        model.draftforge_packing = PackReport(skipped="pack_weights off")
    if decode_attention == "on" or (decode_attention == "auto" and not given):
        model.draftforge_attention = use_decode_attention(model)
    elif not given:
        model.draftforge_attention = "attention left as it is: decode_attention off"
    if lean == "on" or (lean == "auto" and not given):
        model.draftforge_lean, model.draftforge_forward = lean_forward(model)
    elif not given:
        model.draftforge_lean, model.draftforge_forward = None, "decoding forward: the model's own (lean_forward off)"
    return model, tokenizer


def load_target(model_or_path, device="cpu", dtype=None, tokenizer=None, scan_impl: str = "auto",
                pack_weights: str = "auto", decode_attention: str = "auto", prefill_chunk: int | None = None,
                lean_forward: str = "auto") -> Target:
    """A Target from a HF decoder-only Transformer, or an SSM / hybrid model (model object or path).

    Transformers get the KV-cache target; Mamba2 and Mamba2+attention hybrids get `HybridTarget`
    (STree tree scan + replay; `scan_impl` = "auto" | "ref" | "triton"); other recurrent models
    are refused with one message listing what is supported. pack_weights, decode_attention, lean_forward: see
    load_hf_causal_lm. prefill_chunk: encode a prompt in forwards of that many tokens (None = one forward), each
    continuing the cache, K/V and SSM states alike."""
    model, found_tokenizer = load_hf_causal_lm(model_or_path, device, dtype, "target", pack_weights, decode_attention,
                                               lean_forward)
    tokenizer = tokenizer if tokenizer is not None else found_tokenizer
    if is_recurrent_model(model.config) and not getattr(model.config, "is_encoder_decoder", False):
        from draftforge.decode.targets.hybrid import HybridTarget  # here: it loads the tree-scan kernels

        return HybridTarget(model, tokenizer, impl=scan_impl, prefill_chunk=prefill_chunk)
    return KVCacheTarget(model, tokenizer, prefill_chunk=prefill_chunk)


def check_vocab(target: Target, model, tokenizer, allow_vocab_mismatch: bool) -> None:
    """Refuse a drafter whose tokenizer differs from the target's (named in the error).

    Compares tokenizer vocabularies when both exist, else the config vocab sizes. With
    allow_vocab_mismatch=True the ids are used as they are (no mapping): drafter logits are cut or
    padded to the target's width. Output stays lossless (the target verifies every token) but
    acceptance is only meaningful if the two tokenizers agree on the ids they share.
    """
    t_name = getattr(target.tokenizer, "name_or_path", None) or target.model.config.name_or_path or "target"
    d_name = getattr(tokenizer, "name_or_path", None) or model.config.name_or_path or "drafter"
    if target.tokenizer is not None and tokenizer is not None:
        same = target.tokenizer.get_vocab() == tokenizer.get_vocab()
        sizes = (f"{len(tokenizer)} tokens each" if len(target.tokenizer) == len(tokenizer)
                 else f"{len(target.tokenizer)} vs {len(tokenizer)} tokens")
        detail = f"tokenizers differ: target {t_name!r} and drafter {d_name!r} ({sizes})"
    else:
        t_vocab, d_vocab = target.model.config.vocab_size, model.config.vocab_size
        same = t_vocab == d_vocab
        detail = f"vocab sizes differ: target {t_name!r} has {t_vocab}, drafter {d_name!r} has {d_vocab}"
    if not same and not allow_vocab_mismatch:
        raise CompatibilityError(
            f"{detail}, so the drafter's token ids do not mean the target's tokens; train the drafter with the "
            "target's tokenizer (recipe model.target: the target's directory). --allow-vocab-mismatch only uses "
            "the ids as they are: output stays exact, but drafts are accepted only where the two tokenizers "
            "agree on an id"
        )


LOOKUP_FIRST_KEYS = {"drafter_tokens": "drafter_depth"}  # lookup_first specs also take: the drafter's depth cap


def check_local_models(target, drafter) -> None:
    """A --target / --drafter that names a missing local directory, refused before any model loads (the loader's
    own words, said before the seconds it takes to get there). A prompt-lookup spec, a Hub id, None and an
    object already loaded pass."""
    from draftforge.errors import CheckpointError
    from draftforge.loading import missing_local_path

    for flag, value in (("--target", target), ("--drafter", drafter)):
        if not isinstance(value, str) or (flag == "--drafter" and lookup_options(value) is not None):
            continue
        missing = missing_local_path(value)
        if missing is not None:
            raise CheckpointError(f"cannot load the {flag[2:]}: directory {missing} does not exist ({flag})")


def lookup_options(spec, extra_keys: dict | None = None) -> dict | None:
    """PromptLookupDrafter keywords from a drafter spec like 'prompt-lookup:ngram=3,tokens=10'; None when the
    spec is not a prompt-lookup one (a checkpoint). RecipeError for a prompt-lookup spec that cannot be read.
    `extra_keys` (spec key -> keyword) are accepted too (LOOKUP_FIRST_KEYS for a lookup_first spec)."""
    keys = {**LOOKUP_KEYS, **(extra_keys or {})}
    if not isinstance(spec, str):
        return None
    name, _, text = spec.partition(":")
    if name.strip() not in LOOKUP_NAMES:
        return None
    options = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = (x.strip() for x in part.partition("="))
        if not eq or key not in keys or keys[key] in options:
            what = "repeats" if key in keys and eq else "has an unknown or malformed option"
            form = LOOKUP_FORM + (f" (here also {', '.join(extra_keys)})" if extra_keys else "")
            raise RecipeError(f"drafter spec {spec!r} {what} {part!r}; give {form}")
        if not value.isdigit() or int(value) < 1:
            raise RecipeError(f"drafter spec {spec!r}: {key} must be an integer >= 1, got {value!r}")
        options[keys[key]] = int(value)
    max_ngram = options.setdefault("max_ngram", DEFAULT_MAX_NGRAM)
    if options.get("min_ngram", 1) > max_ngram:
        raise RecipeError(f"drafter spec {spec!r}: min_ngram {options['min_ngram']} is above ngram {max_ngram} "
                          "(give ngram too)")
    return options


def load_eagle3(model_or_path, target: Target, device, dtype, pack_weights: str = "auto", head_window=None):
    """A drafter bound to `target` for a head that reads it (an EAGLE-3 head or a feature-conditioned Mamba2
    drafter; module or export directory), else None. It runs in the target's dtype unless `dtype` says otherwise:
    it reads the target's states as they are. pack_weights as in load_hf_causal_lm (an export's head is packed
    under "auto", a module you pass is not). head_window: the EAGLE-3 head attends to the last that many
    committed tokens only (drafters/eagle3.py); refused for the Mamba2 body, whose state is constant anyway."""
    from draftforge.models.eagle3 import Eagle3Head
    from draftforge.models.eagle3_export import is_eagle3_export, load_head
    from draftforge.models.feature_mamba import FeatureMamba2Head, head_window_refusal

    if isinstance(model_or_path, (Eagle3Head, FeatureMamba2Head)):
        head, tokenizer = model_or_path, None
    elif is_eagle3_export(model_or_path):
        head, meta = load_head(model_or_path, target.model.config)
        tokenizer = _export_tokenizer(model_or_path)
        if tokenizer is not None and target.tokenizer is not None:
            check_vocab(target, target.model, tokenizer, allow_vocab_mismatch=False)
    else:
        return None
    from draftforge.decode.drafters.eagle3 import Eagle3Drafter, FeatureMambaDrafter

    head = head.to(device=device, dtype=dtype or target.model.dtype).eval()
    if pack_weights == "on" or (pack_weights == "auto" and not isinstance(model_or_path, nn.Module)):
        head.draftforge_packing = pack_linears(head)
    if isinstance(head, Eagle3Head):
        use_head_attention(head)
    if isinstance(head, FeatureMamba2Head):
        if head_window is not None:
            raise RecipeError(head_window_refusal("head_window", "this drafter"))
        drafter = FeatureMambaDrafter(head, target.vocab_size, tokenizer)
    else:
        drafter = Eagle3Drafter(head, target.vocab_size, tokenizer, window=head_window)
    drafter.bind(target)
    return drafter


def _export_tokenizer(path):
    return read_tokenizer(path, "drafter")


def load_drafter(model_or_path, target: Target, device="cpu", dtype=None, allow_vocab_mismatch=False, tokenizer=None,
                 cuda_graphs="auto", pack_weights: str = "auto", decode_attention: str = "auto",
                 lean_forward: str = "auto", lookup_first: str | None = None, head_window: int | None = None):
    """A PromptLookupDrafter for the spec 'prompt-lookup[:options]' (no model; see lookup_options; a folder of
    that name is ./prompt-lookup), a MambaDrafter for Mamba/Mamba2 checkpoints (HF or draftforge export), an
    EarlyExitDrafter for an EESD export (task eesd), else a TransformerDrafter.

    cuda_graphs ("auto" | "on" | "off") applies to Mamba drafters: their per-batch-size decode steps
    are CUDA graphs when on (auto: exactly when the drafter is on CUDA); Transformer drafters ignore it.
    pack_weights, decode_attention and lean_forward apply to HF drafters (see load_hf_causal_lm).

    lookup_first (a prompt-lookup spec such as "prompt-lookup" or "prompt-lookup:min_ngram=3,drafter_tokens=2"):
    the drafter wrapped so that prompt lookup drafts every round where the text's last min_ngram tokens occurred
    before (min_ngram 2 unless the spec says) and the drafter drafts the others, at most drafter_tokens deep when
    given (drafters/lookup_first.py).

    head_window: an EAGLE-3 head attends to the last that many committed tokens only (its cache holds that many
    rows; a long prompt is encoded as its last rows); refused for any other drafter.

    target may also be a loaded transformers model: it is wrapped as load_target(model) does, where it is (the
    drafter for a `generate(custom_generate=speculative_generate, drafter=...)` call on that model).
    """
    if isinstance(target, PreTrainedModel):
        target = load_target(target, device=target.device)
    options = None
    if lookup_first is not None:
        options = lookup_options(lookup_first, LOOKUP_FIRST_KEYS)
        if options is None:
            raise RecipeError(f"lookup_first {lookup_first!r} is not a prompt-lookup spec; give {LOOKUP_FORM}")
        if "min_ngram" not in options:
            options["min_ngram"] = min(DEFAULT_LOOKUP_FIRST_MIN_NGRAM, options["max_ngram"])
    drafter = _load_drafter(model_or_path, target, device, dtype, allow_vocab_mismatch, tokenizer, cuda_graphs,
                            pack_weights, decode_attention, lean_forward, head_window)
    if head_window is not None and getattr(drafter, "kind", None) != "eagle3":
        raise RecipeError(f"head_window keeps the last N keys of an EAGLE-3 head; {model_or_path} is a "
                          f"{getattr(drafter, 'kind', type(drafter).__name__)} drafter (drop --head-window)")
    if options is None:
        return drafter
    depth = options.pop("drafter_depth", None)
    return LookupFirstDrafter(PromptLookupDrafter(target.vocab_size, **options), drafter, drafter_depth=depth)


def _load_drafter(model_or_path, target: Target, device="cpu", dtype=None, allow_vocab_mismatch=False, tokenizer=None,
                  cuda_graphs="auto", pack_weights: str = "auto", decode_attention: str = "auto",
                  lean_forward: str = "auto", head_window: int | None = None):
    """The drafter itself (load_drafter without lookup_first)."""
    from draftforge.models.eesd_export import is_eesd_export

    check_speed_choices(pack_weights, decode_attention, lean_forward)
    lookup = lookup_options(model_or_path)
    if lookup is not None:  # reads only token ids: no model, dtype, device or tokenizer of its own
        drafter = PromptLookupDrafter(target.vocab_size, **lookup)
        drafter.bind(target)
        return drafter
    if isinstance(model_or_path, (str, Path)) and (Path(model_or_path).expanduser() / "draftforge.json").is_file():
        from draftforge.export import read_export_metadata

        read_export_metadata(Path(model_or_path).expanduser())  # a damaged one is named (not config.json's absence)
    if is_eesd_export(model_or_path):  # an EESD exit head: attached to (and checked against) this target
        from draftforge.decode.methods.eesd import load_early_exit

        return load_early_exit(model_or_path, target, device=device, dtype=dtype)
    eagle3 = load_eagle3(model_or_path, target, device, dtype, pack_weights, head_window)
    if eagle3 is not None:
        return eagle3
    model, found_tokenizer = load_hf_causal_lm(model_or_path, device, dtype, "drafter", pack_weights,
                                               decode_attention, lean_forward)
    tokenizer = tokenizer if tokenizer is not None else found_tokenizer
    check_vocab(target, model, tokenizer, allow_vocab_mismatch)
    if model.config.model_type in SSM_MODEL_TYPES:
        drafter = MambaDrafter(model, target.vocab_size, tokenizer, cuda_graphs=cuda_graphs)
    elif is_recurrent_model(model.config):  # a hybrid's recurrent state cannot be cropped like a KV cache
        raise CompatibilityError(
            f"drafter {model.config.model_type!r} is a hybrid/recurrent model; drafters are Mamba / Mamba2 models "
            "or Transformers with a KV cache (distil a Mamba2 drafter from it with task distill)")
    else:
        use_cuda_graphs(cuda_graphs, model.device)  # same validation for every drafter kind
        drafter = TransformerDrafter(model, target.vocab_size, tokenizer)
    drafter.bind(target)
    return drafter
