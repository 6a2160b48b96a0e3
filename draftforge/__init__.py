"""draftforge: train speculative-decoding drafters and measure what they are worth.

`draftforge.speculative_generate` is transformers' `custom_generate` for any draftforge drafter
(draftforge/decode/hf_generate.py); it is imported on first use, so `import draftforge` stays light.
"""

__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "speculative_generate":
        from draftforge.decode.hf_generate import speculative_generate

        return speculative_generate
    raise AttributeError(f"module 'draftforge' has no attribute {name!r}")
