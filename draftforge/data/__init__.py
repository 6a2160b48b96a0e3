"""draftforge.data: sources, chat templates + assistant-only loss masks, token-id rows, packing into blocks.

    bd = build_block_data(recipe.data, tokenizer, block_size, seed)
    bd.train / bd.eval: rows of `input_ids`, `labels` (block_size ints; -100 = no loss)
"""

from draftforge.data.chat import DEFAULT_CHAT_TEMPLATE, IGNORE_INDEX
from draftforge.data.pipeline import BlockData, build_block_data, describe

__all__ = ["BlockData", "build_block_data", "describe", "DEFAULT_CHAT_TEMPLATE", "IGNORE_INDEX"]
