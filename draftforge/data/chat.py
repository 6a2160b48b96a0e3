"""Chat rendering and the assistant-only loss mask.

The mask is template-agnostic: render the whole conversation to a string, find the
character span of every assistant message's content in it, then keep the label of each
token whose character span (fast tokenizer offset mapping) overlaps one of them. A token
that straddles a template marker and assistant content (possible when a template glues
them without a separator) counts as assistant.
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


def render_with_spans(messages: list[dict], tokenizer) -> tuple[str, list[tuple[int, int]]]:
    """Rendered text and the [start, end) character span of each assistant content in it.

    Render once with a unique sentinel per message content: where the sentinels land says
    exactly where each content goes, even if the same words also appear in a role marker
    or an earlier turn. If the template alters contents (so the sentinel rendering does not
    rebuild the real one), fall back to searching the contents in turn order.
    """
    text = render(messages, tokenizer)
    sentinels = [f"\x00DF{i}\x00" for i in range(len(messages))]
    marked = render([{**m, "content": s} for m, s in zip(messages, sentinels)], tokenizer)
    pieces, spans, cursor = [], [], 0
    for message, sentinel in zip(messages, sentinels):
        at = marked.find(sentinel, cursor)
        if at < 0:
            return text, _search_spans(text, messages)
        pieces.append(marked[cursor:at])
        start = sum(map(len, pieces))
        pieces.append(message["content"])
        if message["role"] == "assistant":
            spans.append((start, start + len(message["content"])))
        cursor = at + len(sentinel)
    pieces.append(marked[cursor:])
    return (text, spans) if "".join(pieces) == text else (text, _search_spans(text, messages))


def _search_spans(text: str, messages: list[dict]) -> list[tuple[int, int]]:
    """Fallback: find each content (stripped, as templates may trim) in turn order."""
    spans, cursor = [], 0
    for message in messages:
        content = message["content"].strip()
        at = text.find(content, cursor) if content else -1
        if at < 0:
            if message["role"] == "assistant" and content:
                raise DataError(
                    f"the chat template changed an assistant message ({content[:40]!r}...), so its tokens "
                    "cannot be located; use a template that writes message contents verbatim"
                )
            continue  # e.g. a template that drops system messages
        cursor = at + len(content)
        if message["role"] == "assistant":
            spans.append((at, cursor))
    return spans


def tokenize_conversation(messages: list[dict], tokenizer, max_length: int) -> dict:
    """Render, tokenize and mask one conversation; truncated to `max_length` tokens."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("format=chat needs a fast tokenizer (offset mapping); load it with use_fast=True")
    text, spans = render_with_spans(messages, tokenizer)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = enc["input_ids"][:max_length]
    labels = []
    for token_id, (start, end) in zip(input_ids, enc["offset_mapping"]):
        in_assistant = any(start < s_end and end > s_start for s_start, s_end in spans)
        labels.append(token_id if in_assistant else IGNORE_INDEX)
    return {"input_ids": input_ids, "labels": labels}
