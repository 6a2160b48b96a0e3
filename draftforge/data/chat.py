"""Chat rendering and the assistant-only loss mask.

The mask is template-agnostic: render the whole conversation to a string, find the
character span of every assistant message's content in it, then keep the label of each
token whose character span (fast tokenizer offset mapping) overlaps one of them. A token
that straddles a template marker and assistant content (possible when a template glues
them without a separator) counts as assistant.

The special token that closes an assistant turn (ChatML's <|im_end|>, Llama 3's <|eot_id|>,
the default template's eos) is labelled too, with any whitespace between it and the content:
the target emits it to end its answer, so a drafter that never learnt it fails that round
of every answer. The template names it: the special token it writes after an answer, with
nothing but whitespace between (a template without one labels the content alone).
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
token straddles a marker and an assistant message's content. The content and the eos that
closes its turn are trained on, not the markers.
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
    or an earlier turn. A template that trims contents (Llama 3's, Gemma's `| trim`) rebuilds
    the real rendering from the stripped contents instead. If neither rebuilds it, fall back
    to searching the contents in turn order, each after its own turn's marker.
    """
    text = render(messages, tokenizer)
    sentinels = [f"\x00DF{i}\x00" for i in range(len(messages))]
    marked = render([{**m, "content": s} for m, s in zip(messages, sentinels)], tokenizer)
    for contents in ([m["content"] for m in messages], [m["content"].strip() for m in messages]):
        spans = _rebuild(text, marked, sentinels, messages, contents)
        if spans is not None:
            return text, spans
    return text, _search_spans(text, messages, _markers(marked, sentinels))


def _rebuild(text: str, marked: str, sentinels: list[str], messages: list[dict], contents: list[str]):
    """The assistant spans where `marked` with each sentinel replaced by its content is `text`, else None."""
    pieces, spans, cursor = [], [], 0
    for message, sentinel, content in zip(messages, sentinels, contents):
        at = marked.find(sentinel, cursor)
        if at < 0:
            return None
        pieces.append(marked[cursor:at])
        start = sum(map(len, pieces))
        pieces.append(content)
        if message["role"] == "assistant":
            spans.append((start, start + len(content)))
        cursor = at + len(sentinel)
    pieces.append(marked[cursor:])
    return spans if "".join(pieces) == text else None


def _markers(marked: str, sentinels: list[str]) -> list[str] | None:
    """What the template writes before each message's content (its turn marker), from the sentinel rendering;
    None where a sentinel is missing (a template that drops a message)."""
    markers, cursor = [], 0
    for sentinel in sentinels:
        at = marked.find(sentinel, cursor)
        if at < 0:
            return None
        markers.append(marked[cursor:at])
        cursor = at + len(sentinel)
    return markers


def _search_spans(text: str, messages: list[dict], markers: list[str] | None = None) -> list[tuple[int, int]]:
    """Fallback: find each content (stripped, as templates may trim) in turn order, past its turn's marker where
    it is known: an answer such as "a" would otherwise be found inside the next marker ("<|start_header_id|>")."""
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        marker = markers[i].strip() if markers else ""
        if marker and (m := text.find(marker, cursor)) >= 0:
            cursor = m + len(marker)
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


def tokenize_conversation(messages: list[dict], tokenizer, max_length: int, closer: int | None | str = "find"
                          ) -> dict:
    """Render, tokenize and mask one conversation; truncated to `max_length` tokens. `closer`: the template's
    turn-closing token id (`closing_token`), found here unless a caller of many conversations found it once."""
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("format=chat needs a fast tokenizer (offset mapping); load it with use_fast=True")
    try:
        text, spans = render_with_spans(messages, tokenizer)
    except Exception as e:  # a template's raise_exception ("System role not supported", roles must alternate)
        from jinja2 import TemplateError

        if not isinstance(e, TemplateError):
            raise
        # the row is skipped and counted by its reason (one row ended the run with jinja's traceback)
        return {"input_ids": [], "labels": [], "lost_loss_tokens": 0, "refused": str(e).split("\n")[0] or "?"}
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids, offsets = enc["input_ids"], enc["offset_mapping"]
    labels = []
    for token_id, (start, end) in zip(input_ids, offsets):
        in_assistant = any(start < s_end and end > s_start for s_start, s_end in spans)
        labels.append(token_id if in_assistant else IGNORE_INDEX)
    closer = closing_token(tokenizer) if closer == "find" else closer
    if closer is not None:
        for _, s_end in spans:
            for i in _turn_end(input_ids, offsets, text, s_end, closer):
                labels[i] = input_ids[i]
    lost = sum(t != IGNORE_INDEX for t in labels[max_length:])  # the loss tokens truncation cuts off (reported)
    return {"input_ids": input_ids[:max_length], "labels": labels[:max_length], "lost_loss_tokens": lost, "refused": ""}


def closing_token(tokenizer) -> int | None:
    """The special token the chat template writes to close an assistant turn, or None: read from a rendered
    one-turn conversation, where everything after the answer is the template's closing (a special token after
    whitespace only). The next message's opening marker, also special, is never taken for it."""
    answer = "\x00DF-answer\x00"
    try:
        text = render([{"role": "user", "content": "Hello"}, {"role": "assistant", "content": answer}], tokenizer)
    except Exception:  # a template that refuses this conversation (it still renders the real ones): no closer
        return None
    if text.count(answer) != 1:
        return None
    tail = text[text.index(answer) + len(answer):]
    enc = tokenizer(tail, add_special_tokens=False, return_offsets_mapping=True)
    special = set(getattr(tokenizer, "all_special_ids", None) or ())
    for token_id, (start, end) in zip(enc["input_ids"], enc["offset_mapping"]):
        if token_id in special:
            return token_id if not tail[:start].strip() else None
        if tail[start:end].strip():
            return None
    return None


def _turn_end(input_ids, offsets, text: str, content_end: int, closer: int) -> list[int]:
    """Indices of the tokens that close the assistant content ending at character `content_end`: whitespace
    tokens, then `closer`, when it comes before anything else; else none."""
    between = []
    for i, (start, end) in enumerate(offsets):
        if start < content_end:
            continue
        if input_ids[i] == closer:
            return between + [i] if not text[content_end:start].strip() else []
        if text[start:end].strip():
            return []
        between.append(i)
    return []
