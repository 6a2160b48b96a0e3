"""Chat rendering and the assistant-only loss mask.

The mask is template-agnostic: render the whole conversation to a string, find the
character span of every assistant message's content in it, then keep the label of each
token whose character span (fast tokenizer offset mapping) overlaps one of them.
"""

from __future__ import annotations

from draftforge.errors import DataError

IGNORE_INDEX = -100

DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\n' }}{%- endif -%}"
)
"""Template used when the tokenizer has none (Zephyr-like, plain text markers).

Each message renders as ``<|role|>\\n{content}{eos}\\n``; a generation prompt is
``<|assistant|>\\n``. Content starts right after a newline, so with byte-level BPE no
token straddles a marker and an assistant message's content. Only the content is
trained on (not the markers, not the eos that closes the turn).
"""


def chat_template_of(tokenizer) -> str:
    return getattr(tokenizer, "chat_template", None) or DEFAULT_CHAT_TEMPLATE


def render(messages: list[dict], tokenizer) -> str:
    """The conversation as the tokenizer's chat template (or the default) writes it."""
    return tokenizer.apply_chat_template(
        messages, chat_template=chat_template_of(tokenizer), tokenize=False, add_generation_prompt=False
    )


def assistant_char_spans(text: str, messages: list[dict]) -> list[tuple[int, int]]:
    """[start, end) of each assistant content in `text`, searched in turn order."""
    spans, cursor = [], 0
    for message in messages:
        # Templates may trim content; search the stripped text, in order, past earlier turns.
        content = message["content"].strip()
        if not content:
            continue
        at = text.find(content, cursor)
        if at < 0:
            raise DataError(
                f"the chat template changed a message's content ({content[:40]!r}...), so assistant "
                "tokens cannot be located; use a template that writes message contents verbatim"
            )
        cursor = at + len(content)
        if message["role"] == "assistant":
            spans.append((at, cursor))
    return spans


def tokenize_conversation(messages: list[dict], tokenizer, max_length: int) -> dict:
    """Render, tokenize and mask one conversation; truncated to `max_length` tokens."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("format=chat needs a fast tokenizer (offset mapping); load it with use_fast=True")
    text = render(messages, tokenizer)
    spans = assistant_char_spans(text, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = enc["input_ids"][:max_length]
    labels = []
    for token_id, (start, end) in zip(input_ids, enc["offset_mapping"]):
        in_assistant = any(start < s_end and end > s_start for s_start, s_end in spans)
        labels.append(token_id if in_assistant else IGNORE_INDEX)
    return {"input_ids": input_ids, "labels": labels}
