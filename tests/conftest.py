"""Shared fixtures, built offline: tiny byte-level BPE tokenizers (in memory for the data tests, saved for
the training tests) and a tiny text corpus."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import pytest

from tests.fixtures.tokenizers import byte_bpe, testbed_bpe

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def _stdlib_texts(n: int) -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    names = ["textwrap.py", "bisect.py", "heapq.py", "colorsys.py", "fnmatch.py", "keyword.py", "shlex.py",
             "string.py", "this.py", "queue.py", "sched.py", "glob.py"]
    return [(root / x).read_text() for x in names[:n] if (root / x).exists()]


def pytest_configure(config):
    config.addinivalue_line("markers", "kernel: runs a Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1)")


KERNEL_SKIP = ("the Triton kernel needs CUDA or TRITON_INTERPRET=1; on CPU "
               "tests/kernels/test_tree_scan.py::test_kernels_under_triton_interpreter_subprocess runs these cases")


def pytest_collection_modifyitems(config, items):
    """Skip kernel cases where no kernel can run, with the reason (a deselected case would vanish from the
    counts); tests/kernels/test_tree_scan.py re-runs them in a subprocess under the Triton interpreter."""
    import torch

    if os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available():
        return
    for item in items:
        if item.get_closest_marker("kernel"):
            item.add_marker(pytest.mark.skip(reason=KERNEL_SKIP))


@pytest.fixture(scope="session")
def tiny_corpus_dir(tmp_path_factory) -> Path:
    """A folder of ~10 real Python files (a small code corpus)."""
    d = tmp_path_factory.mktemp("corpus")
    for i, text in enumerate(_stdlib_texts(12)):
        (d / f"doc{i:02d}.py").write_text(text)
    return d


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> Path:
    """A 512-token byte-level BPE tokenizer with bos/eos/pad, saved with save_pretrained."""
    d = tmp_path_factory.mktemp("tokenizer")
    testbed_bpe(_stdlib_texts(12), d)
    return d


@pytest.fixture(scope="session")
def random_models(tmp_path_factory) -> dict:
    """benchmarks.decoding.spec_decode's seeded tiny random models, saved once: {"target", "transformer_drafter",
    "mamba_drafter"} -> path (a Llama target, a Llama and a Mamba drafter, vocabulary 128)."""
    from benchmarks.decoding import spec_decode

    return spec_decode.save_random_models(tmp_path_factory.mktemp("models"))


# The data tests' tokenizer: 400 tokens trained in-process on a few lines of code and prose.
_DATA_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "The user asks a question and the assistant answers it politely.",
    "import os\nimport sys\nprint(sys.argv)\n",
] * 20


def _data_tokenizer(chat_template=None):
    fast = byte_bpe(_DATA_CORPUS, 400, ["</s>", "<pad>"], eos_token="</s>", pad_token="<pad>")
    fast.chat_template = chat_template
    return fast


@pytest.fixture
def make_tokenizer():
    """A factory: make_tokenizer(chat_template=None) -> a fresh in-memory 400-token tokenizer (eos + pad)."""
    return _data_tokenizer


@pytest.fixture(scope="module")
def tok():
    """One in-memory 400-token tokenizer per test module (eos `</s>`, pad `<pad>`, no chat template)."""
    return _data_tokenizer()


@pytest.fixture(autouse=True)
def _grad_mode_is_restored():
    """A test (or code it runs in-process) must not leave autograd switched off for the tests after it."""
    yield
    import torch

    if not torch.is_grad_enabled():
        torch.set_grad_enabled(True)
        pytest.fail("autograd was left disabled globally (torch.set_grad_enabled(False) outside a context)")
