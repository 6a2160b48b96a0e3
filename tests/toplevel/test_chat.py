"""`draftforge chat`: the answer streamed is the target's own greedy answer, each followed by its numbers, and the
session ends with a summary; no colour codes when the output is not a terminal."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests import REPO


TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
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


def test_chat_streams_the_targets_own_answer_and_its_numbers(models):
    root, target, tok = models
    questions = ["def add(a, b):", "print(sys.argv)"]
    proc = subprocess.run([sys.executable, "-m", "draftforge", "chat", "--target", str(root / "target"),
                           "--drafter", str(root / "drafter"), "--method", "tree", "--tree", "2,2,1",
                           "--max-new-tokens", "12", "--dtype", "float32"],
                          input="\n".join(questions) + "\n", capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    if tok.chat_template:
        ids = list(tok.apply_chat_template([{"role": "user", "content": questions[0]}], add_generation_prompt=True,
                                           tokenize=True)["input_ids"])
    else:
        ids = tok.encode(questions[0] + "\n")  # no chat template: the question and a newline
    x = torch.tensor([ids])
    greedy = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=12)
    first_answer = tok.decode(greedy[0, len(ids):], skip_special_tokens=True)
    assert proc.stdout.startswith(first_answer) and "\033[" not in proc.stdout
    per_answer = [ln for ln in proc.stderr.splitlines() if ln.startswith("[12 tokens, ")]
    assert len(per_answer) == 2 and all("τ" in ln and "plain decoding" in ln for ln in per_answer)
    assert "chat: 2 answers, 24 tokens" in proc.stderr
