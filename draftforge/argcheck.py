"""The checks of eval's and generate's plain settings, importable without torch or transformers.

`check_eval_settings` is what `run_eval` checks first (eval/runner.py `validate`), and `precheck` runs the same rules
on the command line before the command's module (and with it torch, transformers and every method) is imported: a
negative temperature or a zero count is refused in milliseconds instead of after seconds of imports.
"""

from __future__ import annotations

import argparse
import math

from draftforge.errors import RecipeError


def check_eval_settings(temperatures, max_new_tokens: int, repeats: int, warmup: int, num_prompts: int | None,
                        top_p: float, top_k: int, threads: int | None, cost_repeats: int) -> None:
    """RecipeError naming the flag for the first impossible value."""
    if not temperatures:
        raise RecipeError("give at least one --temperature")
    for t in temperatures:
        if not 0 <= t < math.inf:  # NaN too
            raise RecipeError(f"--temperature must be >= 0 (0 means greedy) and finite, got {t}")
    twice = repeated(temperatures)
    if twice is not None:  # every prompt ran twice at it, counted as one temperature's repeats
        raise RecipeError(f"--temperature names {twice} twice; give each temperature once")
    labels = {}
    for t in temperatures:  # the report keys each temperature's figures by this label (ar@0.5)
        if labels.setdefault(f"{t:g}", t) != t:
            raise RecipeError(f"--temperature {labels[f'{t:g}']} and {t} are both reported as T={t:g}; give "
                              "temperatures that differ within 6 significant digits")
    if max_new_tokens < 1:
        raise RecipeError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if repeats < 1 or warmup < 0:
        raise RecipeError(f"--repeats must be >= 1 and warm-up >= 0, got {repeats} and {warmup}")
    if num_prompts is not None and num_prompts < 1:
        raise RecipeError(f"--num-prompts must be >= 1, got {num_prompts}")
    if not 0 < top_p <= 1 or top_k < 0:
        raise RecipeError(f"--top-p must be in (0, 1] and --top-k >= 0, got {top_p} and {top_k}")
    if threads is not None and threads < 1:
        raise RecipeError(f"--threads must be >= 1, got {threads}")
    if cost_repeats < 0:
        raise RecipeError(f"--cost-repeats must be >= 0, got {cost_repeats}")


def repeated(values) -> float | None:
    """The first value given a second time (1 and 1.0 alike), or None."""
    seen = set()
    for v in values:
        if v in seen:
            return v
        seen.add(v)
    return None


def check_token_count(value, name: str, none_means: str | None = None,
                      error: type[Exception] = RecipeError) -> int | None:
    """A count of tokens: a whole number >= 1, or None (which means `none_means`, when it is said)."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        unset = "leave the flag out" if name.startswith("--") else "None"  # a command line cannot spell None
        alternative = f" (or {unset}: {none_means})" if none_means else ""
        raise error(f"{name} must be a whole number of tokens >= 1{alternative}, got {value!r}")
    return value


def check_prefill_chunk(chunk, name: str = "prefill_chunk", error: type[Exception] = RecipeError) -> int | None:
    """A prompt-chunk size: a whole number of tokens >= 1, or None (the whole prompt in one forward)."""
    return check_token_count(chunk, name, "one forward", error)


def floats(values: list[str] | None, flag: str) -> tuple[float, ...]:
    """Repeated flags and comma lists alike: --temperature 0 --temperature 0.7,1."""
    out = []
    for v in values or []:
        for part in str(v).split(","):
            if part.strip():
                try:
                    out.append(float(part))
                except ValueError:
                    raise RecipeError(f"{flag} expects numbers, got {part!r}") from None
    return tuple(out)


def temperature_list(text: str) -> tuple[float, ...]:
    """One --temperature value: a number or a comma list ('0,0.7') -> its numbers."""
    return floats([text], "--temperature")


def _number(kind, text: str | None, flag: str, default):
    if text is None:
        return default
    try:
        return kind(text)
    except ValueError:
        raise RecipeError(f"{flag} expects {'an integer' if kind is int else 'a number'}, got {text!r}") from None


def _light_parser(flags: dict[str, str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    for flag, action in flags.items():
        p.add_argument(flag, action=action)
    return p


EVAL_FLAGS = {"--temperature": "append", "--max-new-tokens": "store", "--repeats": "store", "--warmup": "store",
              "--num-prompts": "store", "--top-p": "store", "--top-k": "store", "--threads": "store",
              "--cost-repeats": "store"}
# the eval command's defaults for the flags above (eval/command.py declares the same)
EVAL_DEFAULTS = {"max_new_tokens": 128, "repeats": 3, "warmup": 1, "top_p": 1.0, "top_k": 0, "cost_repeats": 5}


def _precheck_eval(argv: list[str]) -> None:
    args, _ = _light_parser(EVAL_FLAGS).parse_known_args(argv)
    d = EVAL_DEFAULTS
    check_eval_settings(
        floats(args.temperature, "--temperature") or (0.0,),
        _number(int, args.max_new_tokens, "--max-new-tokens", d["max_new_tokens"]),
        _number(int, args.repeats, "--repeats", d["repeats"]), _number(int, args.warmup, "--warmup", d["warmup"]),
        _number(int, args.num_prompts, "--num-prompts", None), _number(float, args.top_p, "--top-p", d["top_p"]),
        _number(int, args.top_k, "--top-k", d["top_k"]), _number(int, args.threads, "--threads", None),
        _number(int, args.cost_repeats, "--cost-repeats", d["cost_repeats"]))


def precheck(command: str | None, argv: list[str]) -> None:
    """The light checks of `command`'s plain flags (eval for now); a --help on the line skips them."""
    if command == "eval" and not {"-h", "--help"} & set(argv):
        _precheck_eval(argv)
