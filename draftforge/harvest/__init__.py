"""Training data harvested from a target (and a drafter): `draftforge harvest trees|theta|logits|hidden`.

- `c2t.py`: EAGLE-2 trees with per-node features and accept labels, for the C2T classifier (task c2t);
- `cali_ts.py`: χ acceptance labels and hidden states, for Cali-TS's θ predictor (task theta);
- `logits.py`: a target's top-k distributions over token rows, so distill needs no teacher forward;
- `hidden.py`: the same plus the target's states at chosen layers, so eagle3 trains without the target.

Each job is resumable, fingerprints what it read (target, drafter, settings) and refuses to mix runs. This package
sits above decode/ (it drives drafters and targets) and below train/ and eval/.
"""
