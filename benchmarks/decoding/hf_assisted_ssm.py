"""Does the installed transformers' own assisted generation stay lossless with SSM drafters and SSM / hybrid targets?

Greedy `generate(assistant_model=...)` and `generate(prompt_lookup_num_tokens=...)` against plain greedy
`generate()`, on the seeded random fp32 models of tests/fixtures (CPU, seconds). An assistant agreeing on part of the
argmaxes (a noisy copy) drafts 4 tokens a round, never cut short by its confidence, so rounds that accept part of
their drafts, the ones that must roll a recurrent state back to a point between drafts, are many. Greedy decoding is
the oracle: a prompt "diverged" when any token differs. What it found for transformers 5.25 is in
docs/use-your-drafter.md; draftforge's hf_assisted and hf_prompt_lookup follow it.

    python -m benchmarks.decoding.hf_assisted_ssm [--out bench_out/hf_assisted_ssm.json]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import checked_args, print_table, write_json

VOCAB, PROMPTS, DRAFTS = 48, 6, 4


def _prompts():
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(1, 40, (1, 5 + i), generator=gen) for i in range(PROMPTS)]


def _assistant(model, noise):
    from tests.fixtures.decode import noisy_copy

    copy = noisy_copy(model, noise=noise)
    config = copy.generation_config
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = DRAFTS, "constant"
    config.assistant_confidence_threshold = 0.0
    return copy


def diverged(target, new_tokens: int, **assist) -> int | str:
    """Prompts whose assisted greedy output differs from plain greedy generate(), or the error that stopped it."""
    count = 0
    for ids in _prompts():
        kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        try:
            count += not torch.equal(target.generate(ids, **assist, **kwargs), target.generate(ids, **kwargs))
        except (ValueError, RuntimeError, TypeError, AttributeError) as e:  # an older transformers refusing it
            return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:90]}"
    return count


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out/hf_assisted_ssm.json")
    args = checked_args(parser, argv)
    import transformers

    from tests.fixtures.decode import tiny_llama, tiny_mamba2
    from tests.fixtures.hybrid import HYBRIDS

    rows = []
    llama = tiny_llama(vocab=VOCAB)
    rows.append(("llama", "a random Mamba2 (assistant)", 24,
                 diverged(llama, 24, assistant_model=_assistant(tiny_mamba2(vocab=VOCAB), 0.0))))
    for name, make in HYBRIDS.items():
        target = make(vocab=VOCAB)
        rows.append((name, "a noisy copy of it (assistant)", 24,
                     diverged(target, 24, assistant_model=_assistant(target, 0.01))))
        rows.append((name, "prompt lookup", 48, diverged(target, 48, prompt_lookup_num_tokens=DRAFTS)))
    result = {"transformers": transformers.__version__, "prompts": PROMPTS, "drafts_per_round": DRAFTS,
              "rows": [dict(target=t, drafts=d, new_tokens=n, diverged=k) for t, d, n, k in rows]}
    print(f"transformers {transformers.__version__}: prompts (of {PROMPTS}) whose assisted greedy output differs "
          "from generate()")
    print_table(["target", "drafts from", "new tokens", "diverged"], [list(r) for r in rows], right={2, 3})
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
