"""Chat: loss mask covers exactly the assistant tokens (ShareGPT and OpenAI formats), truncation, packing."""

import numpy as np
import pytest

from draftforge.data import DEFAULT_CHAT_TEMPLATE, IGNORE_INDEX, build_block_data
from draftforge.data.chat import tokenize_conversation
from tests.data.common import data_cfg, write_jsonl

CONVO = [
    ("system", "You are a tiny helper."),
    ("user", "def add(a, b):"),
    ("assistant", "return a + b"),
    ("user", "Hello world, again"),
    ("assistant", "The assistant answers it politely."),
]
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
)


def sharegpt_row(convo):
    return {"conversations": [{"from": SHAREGPT_ROLE[r], "value": c} for r, c in convo]}


def openai_row(convo):
    return {"messages": [{"role": r, "content": c} for r, c in convo]}


def expected_default(tok, convo):
    """Hand-built oracle for DEFAULT_CHAT_TEMPLATE: tokenize each piece alone, label the assistant content and the
    eos that closes its turn (the target emits it to end an answer)."""
    ids, labels = [], []

    def piece(text, train):
        t = tok(text, add_special_tokens=False)["input_ids"]
        ids.extend(t)
        labels.extend(t if train else [IGNORE_INDEX] * len(t))

    for role, content in convo:
        piece(f"<|{role}|>\n", False)
        piece(content, role == "assistant")
        piece("</s>", role == "assistant")
        piece("\n", False)
    return ids, labels


def expected_chatml(tok, convo):
    ids, labels = [], []
    for role, content in convo:
        for text, train in ((f"<|im_start|>{role}\n", False), (content, role == "assistant"),
                            ("<|im_end|>", role == "assistant"), ("\n", False)):
            t = tok(text, add_special_tokens=False)["input_ids"]
            ids.extend(t)
            labels.extend(t if train else [IGNORE_INDEX] * len(t))
    return ids, labels


@pytest.mark.parametrize("make_row", [sharegpt_row, openai_row])
def test_default_template_mask_is_exactly_assistant_tokens(tmp_path, make_row, make_tokenizer):
    tok = make_tokenizer()
    assert tok.chat_template is None  # exercises DEFAULT_CHAT_TEMPLATE
    ids, labels = expected_default(tok, CONVO)
    src = write_jsonl(tmp_path / "chat.jsonl", [make_row(CONVO)])
    bd = build_block_data(data_cfg([src], format="chat"), tok, 256, seed=0)
    row = bd.train[0]
    n = len(ids)
    assert row["input_ids"][:n] == ids
    assert row["labels"][:n] == labels
    assert row["labels"][n:] == [IGNORE_INDEX] * (256 - n)
    assert bd.stats["loss_tokens"] == sum(1 for x in labels if x != IGNORE_INDEX) > 0


def test_tokenizer_own_chat_template_is_used(make_tokenizer):
    tok = make_tokenizer(chat_template=CHATML)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    ids, labels = expected_chatml(tok, CONVO)
    out = tokenize_conversation(openai_row(CONVO)["messages"], tok, max_length=1000)
    assert out["input_ids"] == ids and out["labels"] == labels
    assert tok.apply_chat_template(openai_row(CONVO)["messages"], tokenize=False) != \
        tok.apply_chat_template(openai_row(CONVO)["messages"], chat_template=DEFAULT_CHAT_TEMPLATE, tokenize=False)


def test_truncation_and_greedy_packing(tmp_path, make_tokenizer):
    tok = make_tokenizer()
    full_ids, full_labels = expected_default(tok, CONVO)
    short = [("user", "Hello"), ("assistant", "world")]
    s_ids, s_labels = expected_default(tok, short)
    block = 64
    assert len(full_ids) > block and 2 * len(s_ids) <= block
    src = write_jsonl(tmp_path / "c.jsonl", [openai_row(short), openai_row(short), openai_row(CONVO)])
    bd = build_block_data(data_cfg([src], format="chat"), tok, block, seed=0)
    ids_BS, labels_BS = np.array(bd.train["input_ids"]), np.array(bd.train["labels"])
    assert ids_BS.shape == (2, block)
    # two short conversations share block 0, then padding; the long one is truncated into block 1
    assert ids_BS[0].tolist() == s_ids + s_ids + [tok.pad_token_id] * (block - 2 * len(s_ids))
    assert labels_BS[0].tolist() == s_labels + s_labels + [IGNORE_INDEX] * (block - 2 * len(s_ids))
    assert ids_BS[1].tolist() == full_ids[:block] and labels_BS[1].tolist() == full_labels[:block]


def test_conversation_truncated_before_assistant_is_skipped(tmp_path, caplog, make_tokenizer):
    tok = make_tokenizer()
    long_user = [("user", "Hello world " * 30), ("assistant", "ok")]
    src = write_jsonl(tmp_path / "c.jsonl", [openai_row(long_user), openai_row(CONVO[1:3])])
    bd = build_block_data(data_cfg([src], format="chat"), tok, 32, seed=0)
    assert bd.stats["rows_skipped"] == 1 and bd.stats["documents"] == 1
    assert "truncated away" in caplog.text


def _labelled_text(tok, out):
    return tok.decode([t for t in out["labels"] if t != IGNORE_INDEX])


def test_assistant_content_equal_to_a_marker_word_is_located_exactly(make_tokenizer):
    tok = make_tokenizer()
    convo = [("user", "assistant"), ("assistant", "assistant")]
    ids, labels = expected_default(tok, convo)
    out = tokenize_conversation(openai_row(convo)["messages"], tok, max_length=1000)
    assert out["input_ids"] == ids and out["labels"] == labels


TRIMMING_NO_SYSTEM = (
    "{% for m in messages %}{% if m['role'] != 'system' %}"
    "{{ '[' + m['role'] + ']\n' + (m['content'] | trim) + '\n' }}{% endif %}{% endfor %}"
)
GLUED_GENERATION = (  # like the testbed's: contents glued together, assistant wrapped in {% generation %}
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
    "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
)


def test_templates_that_trim_drop_or_glue_contents(make_tokenizer):
    tok = make_tokenizer(chat_template=TRIMMING_NO_SYSTEM)
    convo = [("system", "be brief"), ("user", " Hello world "), ("assistant", "  return a + b\n")]
    out = tokenize_conversation(openai_row(convo)["messages"], tok, max_length=1000)
    assert _labelled_text(tok, out) == "return a + b"
    tok = make_tokenizer(chat_template=GLUED_GENERATION)
    convo = [("user", "def add(a, b):\n"), ("assistant", "    return a + b\n")]
    out = tokenize_conversation(openai_row(convo)["messages"], tok, max_length=1000)
    assert tok.decode(out["input_ids"]) == "def add(a, b):\n    return a + b\n"
    assert _labelled_text(tok, out).strip() == "return a + b"


LLAMA3_LIKE = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' "
               "+ m['content'] | trim + '<|eot_id|>' }}{% endfor %}")


@pytest.mark.parametrize("convo, answers", [
    ([("user", "Pick a or b.\n"), ("assistant", "a")], ["a"]),  # the user's trailing newline: trimmed
    ([("user", "Is it true?\n"), ("assistant", "True"), ("user", "Sure?"), ("assistant", "d")], ["True", "d"]),
    ([("user", " x "), ("assistant", " t ")], ["t"]),
])
def test_a_trimming_templates_answers_are_labelled_not_its_markers(make_tokenizer, convo, answers):
    """A trimming template (Llama 3's, Gemma's) sent every conversation with surrounding whitespace to a search
    that found a one-letter answer inside the next turn's marker: "<|start_header_id|>" was labelled and the
    answer was not. The labels are the answers and their <|eot_id|>, by hand."""
    tok = make_tokenizer(chat_template=LLAMA3_LIKE)
    tok.add_special_tokens({"additional_special_tokens": ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    out = tokenize_conversation(openai_row(convo)["messages"], tok, max_length=1000)
    labelled = [tok.decode([t]) for t in out["labels"] if t != IGNORE_INDEX]
    assert "".join(labelled) == "".join(a + "<|eot_id|>" for a in answers), labelled
    # the search (a template that changes contents otherwise) is held past each turn's marker too
    from draftforge.data.chat import _markers, _search_spans, render

    messages = openai_row(convo)["messages"]
    text = render(messages, tok)
    sentinels = [f"\x00DF{i}\x00" for i in range(len(messages))]
    marked = render([{**m, "content": x} for m, x in zip(messages, sentinels)], tok)
    spans = _search_spans(text, messages, _markers(marked, sentinels))
    assert [text[a:b] for a, b in spans] == answers


NO_SYSTEM_ROLE = (  # Gemma's way: a system message raises
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}{{ '[' + m['role'] + ']\n' + m['content'] + '\n' }}{% endfor %}"
)


def test_a_conversation_the_chat_template_refuses_is_skipped_and_counted(tmp_path, make_tokenizer):
    # one system-led row ended the whole run with jinja's TemplateError traceback, naming no row
    from draftforge.data import describe

    tok = make_tokenizer(chat_template=NO_SYSTEM_ROLE)
    rows = [openai_row([("user", f"hi {i}"), ("assistant", f"return {i}")]) for i in range(3)]
    rows.insert(1, openai_row([("system", "be brief"), ("user", "hi"), ("assistant", "ok")]))
    bd = build_block_data(data_cfg([write_jsonl(tmp_path / "c.jsonl", rows)], format="chat"), tok, 64, seed=0)
    assert bd.stats["documents"] == 3 and bd.stats["rows_skipped"] == 1
    assert bd.stats["skip_reasons"] == {"chat template refused: System role not supported": 1}
    assert "1/4 rows skipped" in describe(bd)


def test_a_change_to_the_masking_code_re_tokenizes_cached_conversations(tmp_path, make_tokenizer, monkeypatch):
    """`datasets` caches a tokenizing map by that function's own code and kwargs: a fix to how conversations are
    masked (draftforge/data/chat.py) was silently not applied to data tokenized before it. The chat module's
    source hash is part of the key now; a stand-in for an edited module (another mask, another hash) must give
    the new labels from the same files."""
    from draftforge.data import pipeline
    from draftforge.data.chat import render

    tok = make_tokenizer()
    src = write_jsonl(tmp_path / "c.jsonl", [openai_row([("user", f"hi {i}"), ("assistant", f"return a + {i}")])
                                             for i in range(4)])
    before = build_block_data(data_cfg([src], format="chat"), tok, 64, seed=0).stats["loss_tokens"]

    def every_token(messages, tokenizer, max_length, closer=None):
        ids = tokenizer(render(messages, tokenizer), add_special_tokens=False)["input_ids"][:max_length]
        return {"input_ids": ids, "labels": list(ids), "lost_loss_tokens": 0, "refused": ""}

    monkeypatch.setattr(pipeline, "tokenize_conversation", every_token)
    monkeypatch.setattr(pipeline, "_CHAT_CODE", "an-edited-chat-module", raising=False)
    after = build_block_data(data_cfg([src], format="chat"), tok, 64, seed=0).stats
    assert after["loss_tokens"] == after["tokens"] - after["documents"] > before  # all but each row's first


@pytest.mark.parametrize("closing, labelled", [
    ("\n<|im_end|>\n", "\n<|im_end|>"),  # whitespace the template writes before the end token: the target emits it
    (" [done]<|im_end|>\n", ""),  # text between: the content alone (a marker the template writes, not the target)
    ("\n\n", ""),  # no special token closes the turn
])
def test_the_token_that_closes_an_assistant_turn_is_labelled(make_tokenizer, closing, labelled):
    template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
                + repr(closing) + " }}{% endfor %}")
    tok = make_tokenizer(chat_template=template)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    convo = [("user", "Hello world"), ("assistant", "return a + b"), ("user", "again"), ("assistant", "ok")]
    out = tokenize_conversation(openai_row(convo)["messages"], tok, max_length=1000)
    spans = [tok.decode([t for t, lab in zip(out["input_ids"], out["labels"]) if lab != IGNORE_INDEX])]
    assert spans == [f"return a + b{labelled}ok{labelled}"]
    end = out["input_ids"].index(tok.convert_tokens_to_ids("<|im_end|>")) if "<|im_end|>" in closing else 12
    for n in (end, end + 1):  # truncated just before the closing token, and just after it: the same labels as whole
        cut = tokenize_conversation(openai_row(convo)["messages"], tok, max_length=n)
        assert cut["input_ids"] == out["input_ids"][:n] and cut["labels"] == out["labels"][:n]
