"""Decode digest: the proof a harness refactor moved nothing (same tokens, same accepted drafts per round).

Tiny float64 models built from tests/fixtures/decode.py (seeded), Mamba2 and Transformer drafters,
chain / tree / UCB, T=0 and T=1, three prompts (and the tree with i.i.d. siblings at T=1); then an attention-free Mamba2 target and a Bamba hybrid
(tests/fixtures/hybrid.py, float32: the tree-scan path) with a Mamba2 drafter, chain and tree, T=0 and T=1
(keys "mamba2-target/..." and "bamba-target/..."); and the two drafters that read the target's hidden states, the
EAGLE-3 head and the feature-conditioned Mamba2 drafter, chain / tree (T=0 and T=1) / EAGLE-2 (T=0), three prompts
(keys "eagle3/..." and "feature_mamba2/..."). Run it on two checkouts (from each one's root) and compare:

    python -m benchmarks.regression.decode_digest --out /tmp/new.json
    (cd OLD_CHECKOUT && PYTHONPATH=.:NEW_CHECKOUT python -m benchmarks.regression.decode_digest --out /tmp/old.json)
    python -m benchmarks.regression.decode_digest --compare /tmp/old.json /tmp/new.json

In the old checkout its own `draftforge` decodes; where that checkout has no `benchmarks/regression/` (or no
`tests/fixtures/`), Python takes these packages from NEW_CHECKOUT.
"""

from __future__ import annotations

import sys

from benchmarks.common import digest_cli, read_digest, write_digest


def digest() -> dict:
    import torch

    from draftforge.decode import build_decoder, load_drafter, load_target
    from tests.fixtures.decode import noisy_copy, tiny_llama, tiny_mamba2

    torch.set_num_threads(1)
    target = load_target(tiny_llama(vocab=16, dtype=torch.float64))
    drafters = {"mamba2": load_drafter(tiny_mamba2(vocab=16, dtype=torch.float64), target),
                "transformer": load_drafter(noisy_copy(target.model, noise=0.05), target)}
    out = {}
    for kind, drafter in drafters.items():
        # ucb with a fixed λ_γ: measured online (its default) it is a wall-clock ratio, so the arms it picks, and with
        # them the drafts, would follow the machine's load (two runs of one checkout differed on a busy machine)
        for method, opts in [("chain", {"chain_length": 4}), ("tree", {"tree": (3, 2, 1)}),
                             ("ucb", {"lambda_gamma": 0.1})]:
            dec = build_decoder(method, target, drafter, **opts)
            for temp in (0.0, 1.0):
                for i, prompt in enumerate([[1], [3, 5, 7], list(range(2, 14))]):
                    res = dec.generate(prompt, max_new_tokens=20, temperature=temp, seed=i)
                    out[f"{kind}/{method}/T{temp:g}/{i}"] = [res.tokens, res.stats.accepted_per_round]
        dec = build_decoder("tree", target, drafter, tree=(3, 2, 1))  # i.i.d. siblings (not the default) at T=1
        for i, prompt in enumerate([[1], [3, 5, 7], list(range(2, 14))]):
            res = dec.generate(prompt, max_new_tokens=20, temperature=1.0, seed=i, tree_draws="iid")
            out[f"{kind}/tree-iid/T1/{i}"] = [res.tokens, res.stats.accepted_per_round]
    out.update(ssm_targets())
    out.update(feature_drafters())
    return out


def feature_drafters() -> dict:
    """The EAGLE-3 head's and the feature Mamba2 drafter's decodes (features handed over by the verification)."""
    import torch

    from draftforge.decode import build_decoder, load_drafter, load_target
    from tests.fixtures.decode import eagle3_head, feature_mamba_head, tiny_llama

    vocab = 12
    target = load_target(tiny_llama(vocab=vocab, dtype=torch.float64))
    out = {}
    for kind, make in (("eagle3", eagle3_head), ("feature_mamba2", feature_mamba_head)):
        drafter = load_drafter(make(target.model), target)
        for method, opts in (("chain", {"chain_length": 3}), ("tree", {"tree": (vocab, 2, 1)}), ("eagle2", {})):
            dec = build_decoder(method, target, drafter, **opts)
            for temp in (0.0,) if method == "eagle2" else (0.0, 1.0):
                for i, prompt in enumerate(([4], [3, 5, 7], [(7 * j + 3) % vocab for j in range(40)])):
                    res = dec.generate(prompt, max_new_tokens=20, temperature=temp, seed=7)
                    out[f"{kind}/{method}/T{temp:g}/{i}"] = [res.tokens, res.stats.accepted_per_round]
    return out


def ssm_targets() -> dict:
    """The Mamba2 and hybrid targets' decodes (each model's own forward; the harness's tree scan and replay)."""
    import torch

    from draftforge.decode import build_decoder, load_drafter, load_target
    from tests.fixtures.decode import tiny_mamba2
    from tests.fixtures.hybrid import tiny_bamba, tiny_mamba2_target

    out = {}
    for name, make in [("mamba2-target", tiny_mamba2_target), ("bamba-target", tiny_bamba)]:
        target = load_target(make(vocab=48))
        drafter = load_drafter(tiny_mamba2(vocab=48, seed=7), target)
        for method, opts in [("chain", {"chain_length": 4}), ("tree", {"tree": (3, 2, 1)})]:
            dec = build_decoder(method, target, drafter, **opts)
            for temp in (0.0, 1.0):
                for i, prompt in enumerate([[1], [3, 5, 7], list(range(2, 14))]):
                    res = dec.generate(prompt, max_new_tokens=20, temperature=temp, seed=i)
                    out[f"{name}/mamba2/{method}/T{temp:g}/{i}"] = [res.tokens, res.stats.accepted_per_round]
    return out


def compare(a_path: str, b_path: str) -> int:
    a, b = (read_digest(x) for x in (a_path, b_path))
    both = [k for k in a if k in b]
    tokens = [k for k in both if a[k][0] != b[k][0]]
    rounds = [k for k in both if a[k][1] != b[k][1]]
    lost, added = sorted(set(a) - set(b)), sorted(set(b) - set(a))  # B (the newer) may add decodes, not drop any
    print(f"{len(both)} decodes in both: {len(both) - len(tokens)} with identical tokens, {len(both) - len(rounds)} "
          f"with identical accepted drafts per round" + (f"; differ: {sorted(set(tokens + rounds))[:8]}" if
                                                         tokens or rounds else "")
          + (f"; {len(added)} only in {b_path} (added since, not compared)" if added else "")
          + (f"; {len(lost)} missing from {b_path}: {lost[:8]}" if lost else ""))
    if not both:
        print(f"no decode is in both {a_path} and {b_path}: nothing was compared")
    return 1 if tokens or rounds or lost or not both else 0


def write(out: str) -> int:
    write_digest(out, digest())
    return 0


if __name__ == "__main__":
    sys.exit(digest_cli(__doc__, write, compare))
