"""The inputs of the bad-input sweep, made on this machine: nothing is downloaded.

`build(root, repo)` writes, under root/in: a byte-level BPE tokenizer and a small corpus from the
stdlib (`draftforge.testbed`), a tiny random Llama target (safetensors, and pickle / fake /
hybrid / config-less variants), bad data files and recipes; and trains, through the real CLI,
the tiny Mamba2 drafter run `runs/good` (checkpoints + export) that the export, eval and kill
cases start from. It returns the paths as a dict that the case table formats its commands with.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

DRAFTER = {"hidden_size": 32, "num_hidden_layers": 2, "head_dim": 16, "state_size": 8}


def cli_env(root: Path, repo: Path) -> dict:
    """A fresh user: HOME under root, offline, one thread, this checkout's draftforge first on the path."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DRAFTFORGE_", "HF_", "TRANSFORMERS_")) and k not in ("PYTHONPATH", "XDG_CACHE_HOME")}
    env.update(HOME=str(root / "home"), PYTHONPATH=str(repo), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONHASHSEED="0")
    return env


def cli(argv: list[str], root: Path, repo: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m draftforge ARGV` as the fresh user, in root/cwd."""
    return subprocess.run([sys.executable, "-m", "draftforge", *argv], cwd=root / "cwd", env=cli_env(root, repo),
                          capture_output=True, text=True, timeout=timeout, check=False)


def cli_interrupted(argv: list[str], root: Path, repo: Path, after: str, timeout: float = 600):
    """`python -m draftforge ARGV` as the fresh user, sent SIGINT (Ctrl-C) once `after` shows on its stderr."""
    import signal
    import time

    # SIGINT back to its default in the child: under `nohup ... &` (CI in the background) it is inherited ignored,
    # and Python then installs no KeyboardInterrupt handler, so the Ctrl-C under test would never arrive
    proc = subprocess.Popen([sys.executable, "-m", "draftforge", *argv], cwd=root / "cwd", env=cli_env(root, repo),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    head, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        head.append(line)
        if after in line or not line:
            break
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=timeout)[1]
    return subprocess.CompletedProcess(proc.args, proc.returncode, "", "".join(head) + rest)


def good_recipe(p: dict, output_dir: str, **train) -> dict:
    return {
        "task": "pretrain", "output_dir": output_dir,
        "model": {"arch": "mamba2", "size": "tiny", "target": p["target"], "overrides": dict(DRAFTER)},
        "data": {"sources": [p["corpus"]], "eval_fraction": 0.1},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "train": {"max_steps": 24, "global_batch_size": 4, "micro_batch_size": 2, "block_size": 32, "eval_every": 8,
                  "save_every": 8, "log_every": 1, "trackers": [], **train},
    }


def _save_target(out: Path, tokenizer, hybrid: bool = False) -> None:
    import torch
    from transformers import JambaConfig, JambaForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
               eos_token_id=tokenizer.eos_token_id, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=1, intermediate_size=64)
    if hybrid:  # a Mamba-1 + attention hybrid: the one kind the harness still refuses (Mamba2 hybrids now run)
        config = JambaConfig(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, num_experts=1,
                             mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, **ids)
        model = JambaForCausalLM(config)
    else:
        model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=512, tie_word_embeddings=True, **ids))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _pickle_copy(src: Path, out: Path, name: str = "pytorch_model.bin") -> None:
    """src's files, with its safetensors weights re-saved as a pickle (torch.save) named `name`."""
    import torch
    from safetensors.torch import load_file

    shutil.copytree(src, out)
    state = load_file(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    torch.save(state, out / name)


def _data_files(d: Path, corpus: Path) -> None:
    (d / "empty.jsonl").write_text("")
    (d / "empty.txt").write_text("")
    (d / "malformed.jsonl").write_text('{"text": "def f():\\n    return 1\\n"}\n{"text": "oops\n')
    (d / "wrong_field.jsonl").write_text('{"body": "def f():\\n    return 1\\n"}\n' * 4)
    chat = [{"role": "user", "content": "def add(a, b):\n"}, {"role": "assistant", "content": "    return a + b\n"}]
    (d / "chat.jsonl").write_text((json.dumps({"messages": chat}) + "\n") * 8)
    (d / "no_assistant.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    (d / "bad_tokens.jsonl").write_text('{"input_ids": [1, 2, "x"]}\n')
    # `draftforge generate` rows whose sidecar names another tokenizer and target (ids valid in ours)
    (d / "foreign_rows.jsonl").write_text(json.dumps({"input_ids": [5, 6, 7, 8], "prompt_len": 1, "prompt_id": "p0",
                                                      "temperature": 0.0}) + "\n")
    (d / "foreign_rows.jsonl.meta.json").write_text(json.dumps({
        "tokenizer": "other-org/other-tokenizer", "tokenizer_fingerprint": "0" * 64, "target": "other-org/other-target",
        "target_fingerprint": "0" * 64, "written_by": "draftforge generate", "version": 1}))
    (d / "not_yaml.yaml").write_text("task: pretrain\nmodel: [unclosed\n")
    (d / "a_file").write_text("not a directory\n")
    rows = [json.loads(line) for line in corpus.read_text().splitlines()[:3]]
    from draftforge.testbed import prompt_candidates

    prompts = [c for r in rows for c in prompt_candidates(r["text"])][:4]
    (d / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    (d / "empty_prompts.jsonl").write_text("")
    (d / "no_prompt_field.jsonl").write_text('{"question": "x"}\n')
    (d / "not_a_wheel.whl").write_text("this is not a zip file\n")
    # issue 35: the user's own files where a run would go, and data that is not text
    (d / "userdir" / "data").mkdir(parents=True, exist_ok=True)
    (d / "userdir" / "my_code.py").write_text("print('mine')\n")
    (d / "userdir" / "data" / "notes.txt").write_text("keep me\n")
    noise = random.Random(35).randbytes(4096)
    (d / "random.bin").write_bytes(noise)
    (d / "random.txt").write_bytes(noise)
    png = b"\x89PNG\r\n\x1a\n" + noise[:512]
    (d / "binary.jsonl").write_bytes(png)
    (d / "pngonly").mkdir(exist_ok=True)
    (d / "pngonly" / "logo.png").write_bytes(png)
    (d / "mixed").mkdir(exist_ok=True)
    (d / "mixed" / "logo.png").write_bytes(png)
    (d / "mixed" / "code.py").write_text(json.loads(corpus.read_text().splitlines()[0])["text"] * 4)


def build(root: Path, repo: Path, log=print, train: bool = True) -> dict:
    """Every input of the sweep under root (HOME = root/home, cwd = root/cwd); returns the path table.

    train=False skips the reference run and what is made from it (the quick cases need none of it)."""
    from draftforge.testbed import train_tokenizer, write_corpus_jsonl

    d = root / "in"
    for sub in ("in", "home", "cwd", "runs"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    (root / "cwd" / "notes.txt").write_text("the user's file in the directory draftforge runs from\n")
    log("fixtures: tokenizer + corpus from the stdlib, tiny targets")
    tokenizer = train_tokenizer(d / "tokenizer", vocab_size=512, max_files=12)
    corpus = write_corpus_jsonl(d / "corpus.jsonl", "train", max_files=12)
    _save_target(d / "target", tokenizer)
    _save_target(d / "target-hybrid", tokenizer, hybrid=True)
    # a target of another tokenizer: a drafter trained for the one above does not share its ids
    _save_target(d / "target-other-tokenizer", train_tokenizer(d / "tokenizer-other", vocab_size=384, max_files=4))
    _pickle_copy(d / "target", d / "target-pickle")
    _pickle_copy(d / "target", d / "target-fake", name="model.safetensors")
    (d / "target-noconfig").mkdir(exist_ok=True)
    (d / "target-noconfig" / "README.md").write_text("weights went elsewhere\n")
    _data_files(d, corpus)
    p = {"root": str(root), "in": str(d), "runs": str(root / "runs"), "tok": str(d / "tokenizer"),
         "corpus": str(corpus), "target": str(d / "target")}
    (d / "recipe.yaml").write_text(yaml.safe_dump(good_recipe(p, str(root / "runs" / "good"))))
    sft = good_recipe(p, str(root / "runs" / "sft"))
    sft.update(task="sft", model={"init_from": str(root / "runs" / "good"), "target": p["target"]},
               data={"sources": [str(d / "chat.jsonl")], "format": "chat", "eval_fraction": 0.1})
    (d / "sft.yaml").write_text(yaml.safe_dump(sft))
    if not train:
        return p
    log("fixtures: training the reference drafter run (runs/good) through the CLI")
    done = cli(["train", str(d / "recipe.yaml")], root, repo)
    if done.returncode != 0:
        raise RuntimeError(f"the reference run failed:\n{done.stderr[-3000:]}")
    good = root / "runs" / "good"
    _pickle_copy(good / "export", d / "drafter-pickle")
    nockpt = root / "runs" / "nockpt"  # a run killed before its first checkpoint
    nockpt.mkdir()
    shutil.copy(good / "recipe.yaml", nockpt / "recipe.yaml")
    corrupt = root / "runs" / "corrupt"  # every checkpoint truncated, no export
    shutil.copytree(good, corrupt, ignore=shutil.ignore_patterns("export"))
    for f in corrupt.glob("checkpoints/*/model.safetensors"):
        f.write_bytes(f.read_bytes()[:100])
    return p
