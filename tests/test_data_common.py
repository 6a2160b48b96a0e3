"""Shared helpers for the data tests: a tiny byte-level BPE tokenizer trained in-process."""

import json
from types import SimpleNamespace

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "The user asks a question and the assistant answers it politely.",
    "import os\nimport sys\nprint(sys.argv)\n",
] * 20


def tiny_tokenizer(chat_template=None) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>")
    fast.chat_template = chat_template
    return fast


def data_cfg(sources, **overrides) -> SimpleNamespace:
    """Duck-typed stand-in for draftforge.recipe.DataConfig with its defaults."""
    cfg = dict(sources=[str(s) for s in sources], format="text", text_field="text", hf_config=None,
               split="train", streaming=False, eval_fraction=0.0, max_documents=None, num_proc=1,
               file_glob="**/*")
    cfg.update(overrides)
    return SimpleNamespace(**cfg)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path
