"""`draftforge chat`: the answer streamed is the target's own greedy answer, each followed by its numbers, and the
session ends with a summary; no colour codes when the output is not a terminal."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from tests import REPO


# strict, as many real templates are (Mistral, Gemma, Llama 2): user and assistant turns must alternate
TEMPLATE = ("{% for m in messages | rejectattr('role', 'equalto', 'system') %}"
            "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
            "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
            "{% endfor %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")


@pytest.fixture(scope="module", params=[None, TEMPLATE], ids=["plain", "chat-template"])
def models(tmp_path_factory, request):
    from tests.conftest import _data_tokenizer
    from tests.fixtures.decode import tiny_llama, tiny_mamba2

    tok = _data_tokenizer(chat_template=request.param)
    root = tmp_path_factory.mktemp("chat")
    target = tiny_llama(vocab=len(tok), layers=2, hidden=32)
    target.generation_config.eos_token_id = None
    target.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    tiny_mamba2(vocab=len(tok)).save_pretrained(root / "drafter")
    tok.save_pretrained(root / "drafter")
    return root, target, tok


def encode(tok, messages):
    """The prompt as a chat UI would build it: the chat template, or (without one) the contents joined by
    newlines."""
    if tok.chat_template:
        return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    return tok.encode("\n".join(m["content"] for m in messages) + "\n")


def greedy_answer(target, tok, messages, max_new):
    x = torch.tensor([encode(tok, messages)])
    out = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new)
    return tok.decode(out[0, x.shape[1]:], skip_special_tokens=True)


def test_chat_streams_the_targets_own_answer_and_its_numbers(models):
    root, target, tok = models
    questions = ["def add(a, b):", "print(sys.argv)"]
    proc = subprocess.run([sys.executable, "-m", "draftforge", "chat", "--target", str(root / "target"),
                           "--drafter", str(root / "drafter"), "--method", "tree", "--tree", "2,2,1",
                           "--max-new-tokens", "12", "--dtype", "float32"],
                          input="\n".join(questions) + "\n", capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = greedy_answer(target, tok, [{"role": "user", "content": questions[0]}], 12)
    second = greedy_answer(target, tok, [{"role": "user", "content": questions[0]},
                                         {"role": "assistant", "content": first},
                                         {"role": "user", "content": questions[1]}], 12)
    assert proc.stdout == first + "\n" + second + "\n"  # the second answer read the first turn back
    assert "\033[" not in proc.stdout
    per_answer = [ln for ln in proc.stderr.splitlines() if ln.startswith("[12 tokens, ")]
    assert len(per_answer) == 2 and all("τ" in ln and "plain decoding" in ln for ln in per_answer)
    assert "chat: 2 answers, 24 tokens" in proc.stderr


def chat_in_process(monkeypatch, capsys, root, lines, *extra):
    import io

    from draftforge.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(lines) + "\n"))
    rc = main(["chat", "--target", str(root / "target"), "--drafter", str(root / "drafter"), "--dtype", "float32",
               "--no-ar", *extra])
    out = capsys.readouterr()
    assert rc == 0, out.err[-2000:]
    return out


def test_an_answer_stops_at_the_generation_configs_eos(models, tmp_path, monkeypatch, capsys):
    """End-of-turn tokens live in the generation config's EOS list (the tokenizer names one EOS): chat stops at
    them as generate() does."""
    from tests.fixtures.decode import late_eos

    root, target, tok = models
    question = [{"role": "user", "content": "def add(a, b):"}]
    x = torch.tensor([encode(tok, question)])
    free = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=16)
    stop = late_eos(free[0, x.shape[1]:].tolist())
    assert stop != tok.eos_token_id
    model = copy.deepcopy(target)
    model.generation_config.eos_token_id = [tok.eos_token_id, stop]
    (tmp_path / "drafter").symlink_to(root / "drafter")
    model.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    want = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=16)
    assert want.shape[1] < x.shape[1] + 16 and want[0, -1].item() == stop
    out = chat_in_process(monkeypatch, capsys, tmp_path, [question[0]["content"]], "--max-new-tokens", "16")
    assert out.out == tok.decode(want[0, x.shape[1]:], skip_special_tokens=True) + "\n"
    assert f"[{want.shape[1] - x.shape[1]} tokens, " in out.err


def test_a_conversation_past_the_context_drops_its_oldest_turns(models, tmp_path, monkeypatch, capsys):
    """A 64-token target: the session goes on past its context, each answer the target's own greedy answer to
    the conversation that is left (the oldest turns, a question with its answer, dropped until the prompt leaves
    room for 12 tokens; dropping single messages broke the chat template's alternation)."""
    from tests.fixtures.decode import tiny_llama

    root, _, tok = models
    target = tiny_llama(vocab=len(tok), layers=2, hidden=32, ctx=64)
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    (tmp_path / "drafter").symlink_to(root / "drafter")
    questions = ["def add(a, b):", "print(sys.argv)", "import os", "x = [1, 2]", "return None"]
    out = chat_in_process(monkeypatch, capsys, tmp_path, questions, "--max-new-tokens", "12")
    messages, want, drops = [], "", 0
    for q in questions:
        messages.append({"role": "user", "content": q})
        while len(encode(tok, messages)) + 12 > 64 and len(messages) > 1:
            messages[:2] = []  # a question and its answer
            drops += 1
        answer = greedy_answer(target, tok, messages, 12)
        messages.append({"role": "assistant", "content": answer})
        want += answer + "\n"
    assert drops > 0, "the conversation never outgrew the context: the test shows nothing"
    assert out.out == want
    assert out.err.count("dropped the oldest") >= 1 and f"chat: {len(questions)} answers" in out.err


def test_a_message_longer_than_the_context_is_refused_and_the_session_goes_on(models, tmp_path, monkeypatch, capsys):
    from tests.fixtures.decode import tiny_llama

    root, _, tok = models
    target = tiny_llama(vocab=len(tok), layers=2, hidden=32, ctx=64)
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    (tmp_path / "drafter").symlink_to(root / "drafter")
    first, last = "def add(a, b):", "print(x)"
    out = chat_in_process(monkeypatch, capsys, tmp_path, [first, "word " * 80, last], "--max-new-tokens", "8")
    assert "the target's context is 64: send a shorter one" in out.err
    # the refused message took nothing with it: the last answer still reads the first turn (it dropped it)
    history = [{"role": "user", "content": first}]
    history.append({"role": "assistant", "content": greedy_answer(target, tok, history, 8)})
    assert "dropped the oldest" not in out.err
    want = [history[1]["content"], greedy_answer(target, tok, history + [{"role": "user", "content": last}], 8)]
    assert out.out == "\n".join(want) + "\n"
    assert "chat: 2 answers," in out.err


def test_a_message_the_chat_template_refuses_is_refused_in_one_line(models, tmp_path, monkeypatch, capsys):
    """A template's own rule (here: no system role, as Gemma's) ended the session in a traceback."""
    from tests.conftest import _data_tokenizer

    root, _, _ = models
    tok = _data_tokenizer(chat_template="{% if messages[0]['role'] == 'system' %}"
                                        "{{ raise_exception('System role not supported') }}{% endif %}" + TEMPLATE)
    for name in ("target", "drafter"):
        (tmp_path / name).mkdir()
        for f in (root / name).iterdir():
            if f.name.startswith(("config", "generation_config", "model")):
                (tmp_path / name / f.name).symlink_to(f)
        tok.save_pretrained(tmp_path / name)
    out = chat_in_process(monkeypatch, capsys, tmp_path, ["def add(a, b):"], "--system", "be brief")
    assert "[the target's chat template refused the conversation: System role not supported]" in out.err
    assert out.out == "" and "chat: 1 answer" not in out.err


def test_the_printer_shows_exactly_the_decoded_answer(models):
    """Tokens handed over one at a time or in rounds, through newlines and multi-byte characters: what is printed
    is the tokenizer's decode of the whole answer (the printer decodes only the current line)."""
    import io

    from draftforge.cli_chat import Printer

    _, _, tok = models
    text = "def f(x):\n    return x * 2  # doubled\n\nprint(f(3))\ncafé ✓ 日本\n"
    ids = tok.encode(text)
    for step in (1, 3):
        out = io.StringIO()
        printer = Printer(tok, color=False, out=out)
        for i in range(0, len(ids), step):
            printer.add(ids[i:i + step], own_last=True)
        printer.finish()
        assert out.getvalue() == tok.decode(ids, skip_special_tokens=True) + "\n"


@pytest.mark.parametrize("flags, message", [
    (["--method", "foo"], "unknown decoding method 'foo'"),
    (["--method", "tree", "--chain-length", "3"], "--chain-length does not apply to --method tree (it is read by"),
    (["--tree", "3,x"], "--tree expects comma-separated integers"),
    (["--chain-length", "0"], "--chain-length must be >= 1, got 0"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--temperature", "-1"], "--temperature must be >= 0 (0 = greedy), got -1.0"),  # it named both flags
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--method", "hf_prompt_lookup"], "--method hf_prompt_lookup is transformers' own generation"),  # crashed
    (["--drafter", "{missing}"], "cannot load the drafter: directory {missing} does not exist (--drafter)"),
])
def test_what_would_fail_after_the_models_load_is_refused_before(tmp_path, monkeypatch, capsys, flags, message):
    # these were refused only after the target and drafter loaded (seconds here, minutes for a large target)
    import draftforge.decode
    from draftforge.cli import main

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(draftforge.decode, "load_target", no_load)
    target = tmp_path / "target"
    target.mkdir()
    missing = str(tmp_path / "missing")
    argv = ["chat", "--target", str(target), "--drafter", "prompt-lookup"] + [f.format(missing=missing) for f in flags]
    assert main(argv) == 2
    assert message.format(missing=missing) in capsys.readouterr().err
