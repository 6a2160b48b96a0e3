"""draftforge: train speculative-decoding drafters and measure what they are worth."""

__version__ = "0.1.0"
