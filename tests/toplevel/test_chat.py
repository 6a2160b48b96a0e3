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


def run_chat(monkeypatch, capsys, root, stdin, *extra):
    """(exit status, captured output) of an in-process chat reading `stdin` (a list of lines, or a file object)."""
    import io

    from draftforge.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(stdin) + "\n") if isinstance(stdin, list) else stdin)
    rc = main(["chat", "--target", str(root / "target"), "--drafter", str(root / "drafter"), "--dtype", "float32",
               "--no-ar", *extra])
    return rc, capsys.readouterr()


def chat_in_process(monkeypatch, capsys, root, lines, *extra):
    rc, out = run_chat(monkeypatch, capsys, root, lines, *extra)
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


def printed(tok, ids: list[int], step: int) -> str:
    """What the chat's Printer shows for `ids` handed over `step` tokens at a time."""
    import io

    from draftforge.cli_chat import Printer

    out = io.StringIO()
    printer = Printer(tok, color=False, out=out)
    for i in range(0, len(ids), step):
        printer.add(ids[i:i + step], own_last=True)
    printer.finish()
    return out.getvalue()


def test_the_printer_shows_exactly_the_decoded_answer(models):
    """Tokens handed over one at a time or in rounds, through newlines and multi-byte characters: what is printed
    is the tokenizer's decode of the whole answer (the printer decodes only the current line)."""
    _, _, tok = models
    text = "def f(x):\n    return x * 2  # doubled\n\nprint(f(3))\ncafé ✓ 日本\n"
    ids = tok.encode(text)
    for step in (1, 3):
        assert printed(tok, ids, step) == tok.decode(ids, skip_special_tokens=True) + "\n"


def sentencepiece_tokenizer():
    """A Llama-2 / Mistral-style tokenizer built offline: spaces as "▁" prepended to the text, a decoder that strips
    the first token's leading space, byte fallback (Llama's tokenizer.json layout)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["def f(x):\n    if x:\n        return 1\n    return 2\n", "Hello world, a test.\n  café ✓ line\n"] * 50
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_the_printer_keeps_the_leading_spaces_a_sentencepiece_decoder_strips():
    """Each line after a newline token was decoded on its own, and a sentencepiece decoder strips the leading space
    of the first token it decodes: the screen showed one space less on those lines than the stored answer."""
    tok = sentencepiece_tokenizer()
    text = "def f(x):\n    if x:\n        return 1\n    return 2\n  indented line\n two é ✓\n end"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=True) == text
    pieces = tok.convert_ids_to_tokens(ids)
    assert any(a.endswith("\n") and b.startswith("▁") for a, b in zip(pieces, pieces[1:]))  # the case shown
    for step in (1, 3):
        assert printed(tok, ids, step) == tok.decode(ids, skip_special_tokens=True) + "\n"


def test_max_new_tokens_the_context_cannot_hold_is_refused_before_the_first_question(models, tmp_path, monkeypatch,
                                                                                      capsys):
    """--max-new-tokens at or above the target's context left no room for the conversation: every turn dropped all
    the turns before it. Refused in one line once the target is loaded, before the drafter and any question."""
    import draftforge.decode
    from tests.fixtures.decode import tiny_llama

    root, _, tok = models
    tiny_llama(vocab=len(tok), layers=2, hidden=32, ctx=64).save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    (tmp_path / "drafter").symlink_to(root / "drafter")

    def no_load(*args, **kwargs):
        raise AssertionError("the drafter was loaded")

    monkeypatch.setattr(draftforge.decode, "load_drafter", no_load)
    rc, out = run_chat(monkeypatch, capsys, tmp_path, ["def add(a, b):", "import os"], "--max-new-tokens", "64")
    assert rc == 2 and out.out == ""
    assert out.err.endswith("error: --max-new-tokens 64 leaves no room for the conversation in the target's context "
                            "of 64 tokens; give fewer, e.g. --max-new-tokens 32\n"), out.err[-2000:]


@pytest.mark.parametrize("stdin_errors", ["strict", "surrogateescape"])
def test_a_line_that_is_not_utf8_is_refused_and_the_session_goes_on(models, monkeypatch, capsys, stdin_errors):
    """Bytes that are not UTF-8 came back from input() as lone surrogates (a TypeError from the tokenizer), or, where
    stdin decodes strictly, as a UnicodeDecodeError: a traceback either way."""
    import io

    root, target, tok = models
    stdin = io.TextIOWrapper(io.BytesIO(b"abc\xff\xfe\ndef add(a, b):\n"), encoding="utf-8", errors=stdin_errors)
    rc, out = run_chat(monkeypatch, capsys, root, stdin, "--max-new-tokens", "8")
    assert rc == 0, out.err[-2000:]
    assert "[that line is not UTF-8 text: set your terminal or input to UTF-8 and send it again]" in out.err
    # the refused line took no part in the conversation
    assert out.out == greedy_answer(target, tok, [{"role": "user", "content": "def add(a, b):"}], 8) + "\n"
    assert "chat: 1 answer," in out.err


class SigintAt:
    """A stdout that sends this process a real SIGINT (what Ctrl-C does) right after the writes it is told to;
    `writes` counts those with text (input() writes its empty prompt)."""

    def __init__(self, when):
        import io

        self.buf, self.when, self.writes = io.StringIO(), when, 0

    def write(self, text):
        import os
        import signal

        self.buf.write(text)
        self.writes += bool(text)
        if self.when(self):
            os.kill(os.getpid(), signal.SIGINT)
        return len(text)

    def flush(self):
        pass

    def isatty(self):
        return False


def test_ctrl_c_at_the_prompt_ends_the_session_with_its_summary(models, monkeypatch, capsys):
    """It printed only "interrupted": the answers' summary was lost."""
    import io
    import os
    import signal

    root, target, tok = models

    class Stdin(io.StringIO):
        def readline(self, *args):
            line = super().readline(*args)
            if not line:  # the second prompt: the user presses Ctrl-C instead of typing
                os.kill(os.getpid(), signal.SIGINT)
            return line

    handler = signal.getsignal(signal.SIGINT)
    rc, out = run_chat(monkeypatch, capsys, root, Stdin("def add(a, b):\n"), "--max-new-tokens", "8")
    assert rc == 130
    assert out.out == greedy_answer(target, tok, [{"role": "user", "content": "def add(a, b):"}], 8) + "\n"
    assert "chat: 1 answer, 8 tokens" in out.err and "Traceback" not in out.err
    assert signal.getsignal(signal.SIGINT) is handler


def test_ctrl_c_during_an_answer_stops_it_and_the_session_goes_on(models, monkeypatch, capsys):
    """Ctrl-C mid-answer ended the session, the answer's line left open. Now the answer stops after its round, its
    line ends, and the next answer reads it back as the assistant's turn."""
    import signal

    root, target, tok = models
    q1, q2 = "def add(a, b):", "print(sys.argv)"
    stdout = SigintAt(lambda s: s.writes == 1)  # Ctrl-C as the first token shows
    monkeypatch.setattr("sys.stdout", stdout)
    handler = signal.getsignal(signal.SIGINT)
    rc, out = run_chat(monkeypatch, capsys, root, [q1, q2], "--max-new-tokens", "24", "--chain-length", "2")
    assert rc == 0, out.err[-2000:]
    assert signal.getsignal(signal.SIGINT) is handler
    assert out.err.count("[answer stopped by Ctrl-C: what it said so far stays in the conversation; Ctrl-C at the "
                         "prompt ends the session]") == 1
    numbers = [ln for ln in out.err.splitlines() if ln.startswith("[") and " tok/s" in ln]
    assert len(numbers) == 2 and not numbers[0].startswith("[24 tokens") and numbers[1].startswith("[24 tokens")
    assert "chat: 2 answers" in out.err
    full = greedy_answer(target, tok, [{"role": "user", "content": q1}], 24)
    printed = stdout.buf.getvalue()
    # the stopped answer is a start of the full one, on its own line; the second answer reads it back
    matches = [k for k in range(1, len(full)) if printed.startswith(full[:k] + "\n")
               and printed[k + 1:] == greedy_answer(target, tok, [{"role": "user", "content": q1},
                                                                   {"role": "assistant", "content": full[:k]},
                                                                   {"role": "user", "content": q2}], 24) + "\n"]
    assert matches, printed


def test_a_second_ctrl_c_during_an_answer_ends_the_session_with_its_summary(models, monkeypatch, capsys):
    import signal

    root, target, tok = models
    q1 = "def add(a, b):"
    first = greedy_answer(target, tok, [{"role": "user", "content": q1}], 8) + "\n"

    def twice_in_the_second_answer(s):  # two Ctrl-C as its first tokens show
        if len(s.buf.getvalue()) <= len(first):
            return False
        s.late = getattr(s, "late", 0) + 1
        return s.late <= 2

    stdout = SigintAt(twice_in_the_second_answer)
    monkeypatch.setattr("sys.stdout", stdout)
    rc, out = run_chat(monkeypatch, capsys, root, [q1, "print(sys.argv)", "import os"], "--max-new-tokens", "8",
                       "--chain-length", "2")
    assert rc == 130, out.err[-2000:]
    printed = stdout.buf.getvalue()
    assert printed.startswith(first) and printed.endswith("\n") and printed.count("\n") == first.count("\n") + 1
    assert "chat: 1 answer, 8 tokens" in out.err and "Traceback" not in out.err


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
    # a traceback (Torch not compiled with CUDA enabled) after the flags were read
    (["--device", "cuda"], "--device cuda: no CUDA device here (torch "),
    # refused only after the models loaded and the first question was asked
    (["--method", "eagle2", "--temperature", "1"], "--method eagle2 chooses its tree's children deterministically"),
    (["--method", "c2t", "--temperature", "0.7"], "use it at --temperature 0, or sample with chain, tree or ucb"),
])
def test_what_would_fail_after_the_models_load_is_refused_before(tmp_path, monkeypatch, capsys, flags, message):
    # these were refused only after the target and drafter loaded (seconds here, minutes for a large target)
    import draftforge.decode
    from draftforge.cli import main

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(draftforge.decode, "load_target", no_load)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a CPU-only machine, wherever this runs
    target = tmp_path / "target"
    target.mkdir()
    missing = str(tmp_path / "missing")
    argv = ["chat", "--target", str(target), "--drafter", "prompt-lookup"] + [f.format(missing=missing) for f in flags]
    assert main(argv) == 2
    assert message.format(missing=missing) in capsys.readouterr().err
