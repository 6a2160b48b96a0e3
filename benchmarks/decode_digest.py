"""Decode digest: the proof a harness refactor moved nothing (same tokens, same accepted drafts per round).

Tiny float64 models built from tests/test_decode_fixtures.py (seeded), Mamba2 and Transformer drafters,
chain / tree / UCB, T=0 and T=1, three prompts. Run on two checkouts and compare:

    python benchmarks/decode_digest.py --out /tmp/new.json
    (cd OLD_CHECKOUT && PYTHONPATH=. python NEW_CHECKOUT/benchmarks/decode_digest.py --out /tmp/old.json)
    python benchmarks/decode_digest.py --compare /tmp/old.json /tmp/new.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"


def digest() -> dict:
    import torch

    sys.path.insert(0, str(TESTS))
    from test_decode_fixtures import noisy_copy, tiny_llama, tiny_mamba2

    from draftforge.decode import build_decoder, load_drafter, load_target

    torch.set_num_threads(1)
    target = load_target(tiny_llama(vocab=16, dtype=torch.float64))
    drafters = {"mamba2": load_drafter(tiny_mamba2(vocab=16, dtype=torch.float64), target),
                "transformer": load_drafter(noisy_copy(target.model, noise=0.05), target)}
    out = {}
    for kind, drafter in drafters.items():
        for method, opts in [("chain", {"chain_length": 4}), ("tree", {"tree": (3, 2, 1)}), ("ucb", {})]:
            dec = build_decoder(method, target, drafter, **opts)
            for temp in (0.0, 1.0):
                for i, prompt in enumerate([[1], [3, 5, 7], list(range(2, 14))]):
                    res = dec.generate(prompt, max_new_tokens=20, temperature=temp, seed=i)
                    out[f"{kind}/{method}/T{temp:g}/{i}"] = [res.tokens, res.stats.accepted_per_round]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the digest JSON here")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two digests (exit 1 if they differ)")
    args = p.parse_args()
    if args.compare:
        a, b = (json.loads(Path(x).read_text()) for x in args.compare)
        tokens = [k for k in a if a[k][0] != b.get(k, [None])[0]]
        rounds = [k for k in a if a[k][1] != b.get(k, [None, None])[1]]
        print(f"{len(a)} decodes: {len(a) - len(tokens)} with identical tokens, {len(a) - len(rounds)} with "
              f"identical accepted drafts per round" + (f"; differ: {sorted(set(tokens + rounds))[:8]}" if
                                                       tokens or rounds else ""))
        return 1 if tokens or rounds else 0
    if not args.out:
        p.error("give --out or --compare")
    Path(args.out).write_text(json.dumps(digest()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
