"""Scale-out: rank sharding (map-style + streaming), DeepSpeed/FSDP config handling, bad input, and
(slow) multi-process runs compared against the 1-process run of the same recipe."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import warnings
from copy import deepcopy
from pathlib import Path
from types import SimpleNamespace

import datasets
import numpy as np
import pytest
import torch
import yaml

from draftforge.errors import CheckpointError, DataError, DraftforgeError
from draftforge.recipe import recipe_from_dict
from draftforge.train import checkpoint as ckpt
from draftforge.train import distributed as dist
from draftforge.train import run
from draftforge.train.batches import BatchPlan, DataExhausted
from draftforge.train.metrics_log import read_metrics
from tests import REPO
from tests.train.test_loop import tiny_recipe

T = 4  # block size of the synthetic rows below


def _rows(n: int) -> list[dict]:
    """Row i holds the token i everywhere, so a batch names the rows it came from."""
    return [{"input_ids": [i] * T, "labels": [i] * T} for i in range(n)]


def _map_data(n: int):
    return datasets.Dataset.from_list(_rows(n))


def _stream_data(n: int):
    def gen(n):
        yield from _rows(n)
    return datasets.IterableDataset.from_generator(gen, gen_kwargs={"n": n})


def _seen(plan: BatchPlan, step: int) -> list[int]:
    return [int(x) for mb in plan.micro_batches(step, "cpu") for x in mb["input_ids"][:, 0]]


def _documented_row(pos: int, n: int, seed: int) -> int:
    """Map-style data: the row at global position `pos` walks a fresh seeded permutation of the n rows each epoch."""
    epoch, i = divmod(pos, n)
    return int(np.random.default_rng([seed, epoch]).permutation(n)[i])


@pytest.mark.parametrize("streaming", [False, True], ids=["map", "stream"])
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_split_each_global_batch_without_overlap_or_gap(streaming, world):
    make = _stream_data if streaming else _map_data
    n, G, B, steps = 40, 8, 2, 4 if streaming else 9  # map-style: 9 steps x 8 rows crosses an epoch edge
    one = BatchPlan(make(n), G, B, rank=0, world=1, seed=3)
    ranks = [BatchPlan(make(n), G, B, rank=r, world=world, seed=3) for r in range(world)]
    for step in range(steps):
        expected = _seen(one, step)
        assert len(set(expected)) == G
        got = [x for p in ranks for x in _seen(p, step)]
        assert sorted(got) == sorted(expected), f"step {step}: union over ranks differs from 1 process"
        for p in ranks:  # what a rank reads is what its plan says it reads
            positions = [q for mb in p.rows_for_step(step) for q in mb]
            if streaming:
                assert _seen(p, step) == positions  # stream order: global position = row id
            else:  # position q: row perm_e[q mod n] of epoch e = q // n, perm_e drawn from the seed as documented
                assert _seen(p, step) == [_documented_row(q, n, seed=3) for q in positions]
    if not streaming:  # every row once per epoch: the first epoch whole, the next one's 32 rows all different
        every = [x for s in range(steps) for x in _seen(one, s)]
        assert sorted(every[:n]) == list(range(n)) and len(set(every[n:])) == steps * G - n
        assert every != [q % n for q in range(steps * G)]  # shuffled, not read in order
    if streaming:  # no row is read twice, none skipped: the first steps*G rows of the stream, once each
        every = [x for p in ranks for s in range(steps) for x in _seen(p, s)]
        assert sorted(every) == list(range(steps * G))


def test_streaming_plan_resumes_mid_stream_and_signals_the_end():
    fresh = BatchPlan(_stream_data(30), 8, 2, rank=1, world=2, seed=0)
    cont = BatchPlan(_stream_data(30), 8, 2, rank=1, world=2, seed=0)
    for step in range(3):
        rows = _seen(cont, step)
    assert _seen(fresh, 2) == rows == [17, 19, 21, 23]  # a resumed plan skips to its step directly
    assert _seen(fresh, 1) == [9, 11, 13, 15]  # and may go back
    with pytest.raises(DataExhausted) as e:  # 30 rows: step 3 would need rows 24..31
        _seen(cont, 3)
    assert e.value.step == 3


def test_indivisible_process_count_names_nearest_valid_sizes(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir,
                                                             monkeypatch):
    from accelerate import Accelerator

    from draftforge.train.loop import make_accelerator

    monkeypatch.setattr(Accelerator, "num_processes", property(lambda self: 3))
    recipe = recipe_from_dict(tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, global_batch_size=8))
    with pytest.raises(DraftforgeError, match=r"2 x 3; nearest valid global batch: 6 or 12$"):
        make_accelerator(recipe)  # 8 sequences cannot split over 3 processes: only another global batch does


def test_a_micro_batch_too_large_for_the_processes_names_one_that_keeps_the_global_batch():
    # the tiny recipes (global 16 = micro 16) on launch/multi_cpu.yaml's 2 processes: the error offered only other
    # global batches, which change the training, where micro-batch 8 with accumulation 1 is the same training
    from draftforge.train.loop import batch_problem

    assert batch_problem(16, 16, 2).endswith("set train.micro_batch_size=8 (it must divide 8 sequences per "
                                             "process), or give another global batch: 32 or 64")
    assert "set train.micro_batch_size=6 " in batch_problem(12, 8, 2)  # the largest divisor of 6 not above 8
    assert "set train.micro_batch_size=4 " in batch_problem(64, 6, 8)  # 8 per process: 6 does not divide it


def test_deepspeed_launch_without_deepspeed_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    dist.require_backend_installed({"ACCELERATE_USE_DEEPSPEED": "false"})  # not a DeepSpeed launch: fine
    with pytest.raises(DraftforgeError, match=r"pip install 'draftforge\[deepspeed\]'"):
        dist.require_backend_installed({"ACCELERATE_USE_DEEPSPEED": "true"})


def test_a_deepspeed_json_that_is_not_there_from_here_is_one_line(tmp_path, monkeypatch):
    # launch/deepspeed_zero2.yaml names launch/ds_zero2.json relative to the repository root: launched from
    # elsewhere, Accelerate's traceback ended in "Expected a string path to an existing deepspeed config"
    pytest.importorskip("deepspeed")
    monkeypatch.chdir(tmp_path)
    env = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "launch/ds_zero2.json"}
    with pytest.raises(DraftforgeError, match=r"deepspeed_config_file 'launch/ds_zero2.json' does not exist from .*; "
                                              r"launch from the repository root"):
        dist.require_backend_installed(env)
    monkeypatch.chdir(REPO)
    dist.require_backend_installed(env)


def _fake_acc(world=2, A=2, ds=None, fsdp=None):
    return SimpleNamespace(num_processes=world, gradient_accumulation_steps=A,
                           state=SimpleNamespace(deepspeed_plugin=ds, fsdp_plugin=fsdp))


def test_deepspeed_batch_fields_come_from_the_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    recipe = recipe_from_dict(tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, global_batch_size=8))
    config = json.loads((REPO / "launch" / "ds_zero2.json").read_text())
    plugin = SimpleNamespace(deepspeed_config=config, zero_stage=2)
    dist.configure_deepspeed(_fake_acc(world=2, A=2, ds=plugin), recipe)
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"], config["gradient_clipping"]) == (2, 2, 8, 1.0)
    config["train_batch_size"] = 16  # an explicit value that disagrees with the recipe
    with pytest.raises(DraftforgeError, match="train_batch_size=16 but the recipe implies 8"):
        dist.configure_deepspeed(_fake_acc(world=2, A=2, ds=plugin), recipe)


def test_launch_configs_parse_and_name_installed_block_classes():
    from transformers.models.llama import modeling_llama
    from transformers.models.mamba import modeling_mamba
    from transformers.models.mamba2 import modeling_mamba2

    fsdp = yaml.safe_load((REPO / "launch" / "fsdp.yaml").read_text())["fsdp_config"]
    names = fsdp["fsdp_transformer_layer_cls_to_wrap"].split(",")
    assert tuple(names) == dist.FSDP_BLOCK_CLASSES
    for module, name in zip((modeling_mamba, modeling_mamba2, modeling_llama), names):
        assert hasattr(module, name), f"transformers has no {name}"
    for z in (2, 3):
        launch = yaml.safe_load((REPO / "launch" / f"deepspeed_zero{z}.yaml").read_text())
        ds = json.loads((REPO / launch["deepspeed_config"]["deepspeed_config_file"]).read_text())
        assert ds["zero_optimization"]["stage"] == z and ds["train_batch_size"] == "auto"
    assert yaml.safe_load((REPO / "launch" / "multi_cpu.yaml").read_text())["num_processes"] == 2
    # CPU processes even where CUDA is present (else one GPU per process: NCCL DDP, or a missing cuda:1)
    assert yaml.safe_load((REPO / "launch" / "multi_cpu.yaml").read_text())["use_cpu"] is True
    for z in (2, 3):  # several machines: torchrun per node (pdsh without a hostfile made each node its own job)
        launch = yaml.safe_load((REPO / "launch" / f"deepspeed_zero{z}.yaml").read_text())
        assert launch["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"


def test_deepspeed_bucket_sizes_of_a_model_without_a_config_get_deepspeeds_defaults():
    # theta's and c2t's heads have no model.config: Accelerate's prepare raised "Can't find `model.config` entry"
    # for the "auto" bucket sizes of launch/ds_zero2.json and ds_zero3.json
    from draftforge.models.c2t import C2TClassifier
    from draftforge.models.cali_ts import ThetaPredictor

    for name in ("ds_zero2.json", "ds_zero3.json"):
        for model in (ThetaPredictor(8, 8), C2TClassifier()):
            config = json.loads((REPO / "launch" / name).read_text())
            plugin = SimpleNamespace(deepspeed_config=config, zero_stage=config["zero_optimization"]["stage"])
            filled = dist.fill_deepspeed_buckets(_fake_acc(ds=plugin), model)
            zero = config["zero_optimization"]
            assert filled and "auto" not in zero.values()
            assert zero["reduce_bucket_size"] == 500_000_000
            assert filled == [k for k in dist.DEEPSPEED_BUCKET_DEFAULTS if k in zero]
    config = json.loads((REPO / "launch" / "ds_zero3.json").read_text())  # a transformers model: Accelerate sizes them
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=64))
    assert dist.fill_deepspeed_buckets(_fake_acc(ds=SimpleNamespace(deepspeed_config=config)), model) == []
    assert config["zero_optimization"]["reduce_bucket_size"] == "auto"


def test_fsdp_wrap_policy_keeps_the_model_block_class(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    from draftforge.train.lm import build_model, load_tokenizer

    recipe = recipe_from_dict(tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir))
    model = build_model(recipe, load_tokenizer(recipe))
    plugin = SimpleNamespace(transformer_cls_names_to_wrap=list(dist.FSDP_BLOCK_CLASSES))
    dist.fit_fsdp_wrap_policy(_fake_acc(fsdp=plugin), model)
    assert plugin.transformer_cls_names_to_wrap == ["Mamba2Block"]
    plugin.transformer_cls_names_to_wrap = ["GPT2Block"]
    with pytest.raises(DraftforgeError, match="has none of them"):
        dist.fit_fsdp_wrap_policy(_fake_acc(fsdp=plugin), model)
    from draftforge.models.cali_ts import ThetaPredictor  # a small head: the way out is DDP, not another class

    plugin.transformer_cls_names_to_wrap = list(dist.FSDP_BLOCK_CLASSES)
    with pytest.raises(DraftforgeError, match=r"ThetaPredictor, .* launch with DDP \(launch/multi_gpu.yaml"):
        dist.fit_fsdp_wrap_policy(_fake_acc(fsdp=plugin), ThetaPredictor(8, 8))


def test_resume_on_another_world_size_only_where_resharding_works():
    ddp2 = {"world_size": 2, "backend": "ddp"}
    dist.check_resume(ddp2, _fake_acc(world=1), "ck")  # DDP: the data position is global, weights are full
    dist.check_resume({"world_size": 4, "backend": "fsdp"}, _fake_acc(world=2, fsdp=object()), "ck")
    zero = SimpleNamespace(zero_stage=2, deepspeed_config={})
    dist.check_resume({"world_size": 2, "backend": "deepspeed-zero2"}, _fake_acc(world=2, ds=zero), "ck")
    with pytest.raises(CheckpointError, match="written by 2 processes under deepspeed-zero2.*Relaunch with 2"):
        dist.check_resume({"world_size": 2, "backend": "deepspeed-zero2"}, _fake_acc(world=4, ds=zero), "ck")
    with pytest.raises(CheckpointError, match="written under ddp; this launch is deepspeed-zero2"):
        dist.check_resume(ddp2, _fake_acc(world=2, ds=zero), "ck")


def test_an_fsdp_checkpoint_resumed_on_one_cpu_process_says_why(monkeypatch):
    # launched with launch/fsdp.yaml and --num_processes 1, the refusal said "written under fsdp; this launch is
    # single. Resume with the launch config of the original run", which the user had done
    fsdp2 = {"world_size": 2, "backend": "fsdp"}
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(CheckpointError, match="FSDP on CPU processes needs 2 or more.*--num_processes 2 or more"):
        dist.check_resume(fsdp2, _fake_acc(world=1), "ck")
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    with pytest.raises(CheckpointError, match="written under fsdp; this launch is single. Resume with the launch"):
        dist.check_resume(fsdp2, _fake_acc(world=1), "ck")  # not an FSDP launch: the launch config is the fix


def test_gathered_state_rebuilds_the_same_model(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    from draftforge.train.lm import build_model, load_tokenizer

    recipe = recipe_from_dict(tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir))
    model = build_model(recipe, load_tokenizer(recipe)).eval()
    # another state than the model holds (the same map for tied keys): the copy must be a new model holding it
    state = {k: v * 1.5 + 0.01 if v.is_floating_point() else v.clone() for k, v in model.state_dict().items()}
    oracle = deepcopy(model)
    oracle.load_state_dict(state)
    copy = dist.model_from_state(model, state)
    assert copy is not model and not _shared_storage(copy, model)
    ids = torch.randint(0, 100, (2, 16))
    torch.testing.assert_close(copy(ids).logits, oracle(ids).logits, rtol=0, atol=0)
    assert not torch.equal(copy(ids).logits, model(ids).logits)


def _shared_storage(a: torch.nn.Module, b: torch.nn.Module) -> set[int]:
    return {p.data_ptr() for p in a.parameters()} & {p.data_ptr() for p in b.parameters()}


@pytest.mark.slow  # trains ~40 steps until the stream runs dry
def test_streaming_run_that_runs_out_of_data_finishes_cleanly(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir,
                                                              capsys):
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=10_000, save_every=0,
                         eval_every=0, export=True, keep_best="loss")
    values["data"].update(streaming=True, max_documents=3, eval_fraction=0.3)
    result = run(recipe_from_dict(values))
    out = capsys.readouterr().out
    assert 0 < result.step < 10_000 and "streaming data is exhausted" in out
    # the last step's eval is logged and competes for keep_best (it was computed, then neither)
    last = read_metrics(result.run_dir)[-1]
    assert last["step"] == result.step and "eval_loss" in last
    kept = json.loads((result.run_dir / "best" / "best.json").read_text())
    assert kept["step"] == result.step and kept["value"] == last["eval_loss"]
    from draftforge.train.export_run import export_checkpoint  # its final loss is the last step's, not None

    again = export_checkpoint(result.run_dir, tmp_path / "again", say=lambda *a: None)
    assert json.loads((again / "draftforge.json").read_text())["metrics"]["final_loss"] == result.losses[-1]
    state = ckpt.read_loop_state(ckpt.latest_valid(result.run_dir))
    assert state["step"] == result.step and state["backend"] == "single"
    assert (result.export_dir / "model.safetensors").is_file()
    values["data"]["max_documents"] = None
    values["train"]["global_batch_size"] = 4096  # more blocks than one step of the whole corpus
    values["train"]["micro_batch_size"] = 4096
    with pytest.raises(DataError, match="fewer than one global batch"):
        run(recipe_from_dict(values), overwrite=True)


# ---------------------------------------------------------------- multi-process runs (slow)

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "DS_BUILD_OPS": "0",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("WORLD_SIZE", None)
    return env


def _command(config: str | None, recipe: Path, out: Path, *extra: str, procs: int = 2) -> list[str]:
    args = ["-m", "draftforge", "train", str(recipe), "--set", f"output_dir={out}", *extra]
    if config is None:
        return [sys.executable, *args]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "launch" / config),
            "--num_processes", str(procs), "--main_process_port", str(_free_port()), *args]


# A gloo worker aborting at interpreter exit ("terminate called without an active exception", SIGABRT) after
# the run has finished and exported: seen only under FSDP2 on a heavily loaded 2-core machine, never in the
# training itself. One retry on exactly that signature; any other failure fails the test at once.
TEARDOWN_ABORT = "terminate called without an active exception"


def _finished_then_aborted(proc, out: Path) -> bool:
    text = proc.stdout + proc.stderr
    return proc.returncode != 0 and TEARDOWN_ABORT in text and "[draftforge] done:" in text and (
        out / "export").is_dir()


def _train(config, recipe, out, *extra) -> Path:
    proc = subprocess.run(_command(config, recipe, out, *extra), cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=600)
    if _finished_then_aborted(proc, out) and not {"--resume", "--auto-resume"} & set(extra):
        warnings.warn(f"{config}: the launch aborted at process exit after a finished run; retried once")
        proc = subprocess.run(_command(config, recipe, out, "--overwrite", *extra), cwd=REPO, env=_env(),
                              capture_output=True, text=True, timeout=600)
    errors = "\n".join(ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("error:"))
    assert proc.returncode == 0, errors + "\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    assert ("2 process(es)" if config else "1 process(es)") in proc.stdout
    return out


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]


def _weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def _assert_same_weights(a: Path, b: Path, atol: float) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=atol, msg=lambda m: f"{k}: {m}")


def _fp32_recipe(root: Path, corpus, tokenizer, steps: int) -> Path:
    """root/recipe.yaml: the tiny recipe for `steps` steps in fp32, a checkpoint every 2 steps (all kept), export.

    fp32: under bf16 autocast (train.precision auto on CPUs with native bf16) half a batch per process rounds
    differently from the whole batch, by up to ~2e-4 relative, and the 1e-5 bound would measure that."""
    values = tiny_recipe(root, corpus, tokenizer, max_steps=steps, save_every=2, eval_every=0, export=True,
                         keep_checkpoints=steps, precision="fp32")
    recipe = root / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(values))
    return recipe


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_corpus_dir, tiny_tokenizer_dir):
    """A 20-step tiny recipe on disk and its 1-process run (the reference every launch is held to)."""
    root = tmp_path_factory.mktemp("dist")
    recipe = _fp32_recipe(root, tiny_corpus_dir, tiny_tokenizer_dir, steps=20)
    return SimpleNamespace(root=root, recipe=recipe, one=_train(None, recipe, root / "one"))


@pytest.mark.slow
def test_ddp_two_processes_match_one_process(tiny_run):
    two = _train("multi_cpu.yaml", tiny_run.recipe, tiny_run.root / "ddp")
    assert _losses(two) == pytest.approx(_losses(tiny_run.one), rel=1e-5)
    _assert_same_weights(tiny_run.one / "export" / "model.safetensors", two / "export" / "model.safetensors", 1e-5)
    assert ckpt.read_loop_state(ckpt.latest_valid(two))["backend"] == "ddp"


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero_two_processes_match_one_process(tiny_run, stage):
    pytest.importorskip("deepspeed")
    run_dir = _train(f"deepspeed_zero{stage}.yaml", tiny_run.recipe, tiny_run.root / f"zero{stage}")
    assert _losses(run_dir) == pytest.approx(_losses(tiny_run.one), rel=1e-5)
    # ZeRO-3 holds no full copy anywhere: this export is the gathered, consolidated state.
    _assert_same_weights(tiny_run.one / "export" / "model.safetensors",
                         run_dir / "export" / "model.safetensors", 1e-4)
    state = ckpt.read_loop_state(ckpt.latest_valid(run_dir))
    assert state["backend"] == f"deepspeed-zero{stage}" and state["world_size"] == 2


FAKE_SRUN = """#!/bin/bash
# srun on one machine: its options dropped, the command run once per "node" at once, SLURM_NODEID set, a log each
while [[ $# -gt 0 && "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do
  SLURM_NODEID=$i "$@" > "$FAKE_LOGDIR/node$i.log" 2>&1 &
  pids+=($!)
done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
"""
FAKE_SCONTROL = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] && printf 'localhost\\nlocalhost\\n'
"""


def _sbatch(tmp_path, recipe: Path, out: Path, *extra: str, restart: int = 0, config: str = "deepspeed_zero2.yaml"):
    """launch/slurm/draftforge.sbatch as SLURM would run it on 2 nodes of 1 process each, both nodes this machine
    (stand-ins for srun and scontrol on PATH): (the script's output, each node's log)."""
    bin_dir, logs = tmp_path / "fakeslurm", tmp_path / f"logs{restart}"
    bin_dir.mkdir(exist_ok=True)
    logs.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**_env(), "PATH": f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "1", "SLURM_JOB_NODELIST": "localhost", "SLURM_SUBMIT_DIR":
           str(REPO), "SLURM_RESTART_COUNT": str(restart), "LAUNCH_CONFIG": f"launch/{config}",
           "MASTER_PORT": str(_free_port()), "FAKE_LOGDIR": str(logs)}
    proc = subprocess.run(["bash", str(REPO / "launch" / "slurm" / "draftforge.sbatch"), str(recipe), "--set",
                           f"output_dir={out}", *extra], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    nodes = [(logs / f"node{i}.log").read_text() if (logs / f"node{i}.log").exists() else "" for i in range(2)]
    assert proc.returncode == 0, proc.stdout + proc.stderr + "\n".join(n[-3000:] for n in nodes)
    return proc.stdout, nodes


@pytest.mark.slow
def test_sbatch_two_nodes_are_one_deepspeed_job_and_a_requeue_continues_the_run(tiny_run, tmp_path):
    """Two nodes under launch/deepspeed_zero2.yaml trained as two separate one-node jobs (accelerate's pdsh launcher
    with no hostfile fell back to the local machine); a requeued job's --overwrite replaced the run it had made."""
    pytest.importorskip("deepspeed")
    env_file = REPO / ".deepspeed_env"
    had_env_file = env_file.exists()
    out = tmp_path / "run"
    said, nodes = _sbatch(tmp_path, tiny_run.recipe, out, "--overwrite")
    assert "2 nodes x 1 GPUs = 2 processes" in said
    for log in nodes:  # each node in one 2-process world, not a 1-process world of its own
        assert "2 process(es) x micro-batch" in log and "1 process(es)" not in log, log[-2000:]
    assert _losses(out) == pytest.approx(_losses(tiny_run.one), rel=1e-5)
    assert env_file.exists() == had_env_file  # no copy of the environment (tokens included) left in the repo
    metrics = (out / "metrics.jsonl").read_bytes()
    said, nodes = _sbatch(tmp_path, tiny_run.recipe, out, "--overwrite", restart=1)  # SLURM reruns the same line
    assert "restart 1 of this job: continuing its run (--auto-resume)" in said
    assert "--auto-resume: continuing the run in" in nodes[0] and "no step left to run" in nodes[0], nodes[0][-2000:]
    assert (out / "metrics.jsonl").read_bytes() == metrics and not list(out.parent.glob(".run.replaced*"))


@pytest.mark.slow
def test_theta_under_deepspeed_matches_one_process(tmp_path):
    """theta's predictor (no model.config, no 1-D parameters) under launch/deepspeed_zero2.yaml died in prepare
    (Accelerate could not size the "auto" bucket sizes) and then in the scheduler's first step (ZeRO dropped the
    empty no-decay parameter group the scheduler had a rate for)."""
    pytest.importorskip("deepspeed")
    from draftforge.harvest.cali_ts import harvest_theta
    from tests.fixtures.decode import tiny_llama, tiny_mamba2

    vocab = 16
    tiny_llama(vocab=vocab).save_pretrained(tmp_path / "target")
    tiny_mamba2(vocab=vocab).save_pretrained(tmp_path / "drafter")
    rows = [{"input_ids": [(5 * i + j) % vocab for i in range(30)], "prompt_len": 4} for j in range(8)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    harvest_theta(tmp_path / "target", tmp_path / "drafter", [str(tmp_path / "rows.jsonl")], tmp_path / "h",
                  max_offset=4, anchor_stride=2, progress=False, dtype="float32")
    recipe = tmp_path / "theta.yaml"
    recipe.write_text(yaml.safe_dump({
        "task": "theta", "model": {"target": str(tmp_path / "target")},
        "data": {"sources": [str(tmp_path / "h")], "eval_fraction": 0.0}, "theta": {"max_offset": 4},
        "optim": {"lr": 3e-3, "warmup_steps": 0, "weight_decay": 0.0},
        "train": {"max_steps": 4, "global_batch_size": 32, "micro_batch_size": 16, "eval_every": 0, "save_every": 0,
                  "log_every": 1, "trackers": [], "precision": "fp32"}}))
    one = _train(None, recipe, tmp_path / "one")
    zero2 = _train("deepspeed_zero2.yaml", recipe, tmp_path / "zero2")
    assert len(_losses(one)) == 4 and _losses(zero2) == pytest.approx(_losses(one), rel=1e-5)


def _kill_tree(proc) -> None:
    """SIGKILL a launcher and every process under it, and wait until all are gone. torchrun starts each worker in a
    session of its own, so killing the launcher's process group left the workers training on as orphans: the
    "resumed" run then found their later checkpoints (or raced them for the run's lock)."""
    import psutil

    procs = [psutil.Process(proc.pid)]
    procs += procs[0].children(recursive=True)  # listed before any dies: an orphan is no child of anyone here
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    _, alive = psutil.wait_procs(procs, timeout=60)
    assert not alive, f"still running after SIGKILL: {alive}"


def _kill_after_checkpoint(config: str, recipe: Path, out: Path, step: int, max_steps: int, *extra) -> None:
    """Launch, SIGKILL the launcher and all its workers once checkpoint `step` exists, check it was mid-run."""
    proc = subprocess.Popen(_command(config, recipe, out, *extra), cwd=REPO, env=_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not (out / "checkpoints" / f"step-{step:08d}").exists():
            assert proc.poll() is None and time.time() < deadline, "the run ended before it could be killed"
            time.sleep(0.05)
    finally:
        _kill_tree(proc)  # the launcher and both workers, mid-run
    steps = [int(p.name[5:]) for p in ckpt.list_checkpoints(out)]
    assert max(steps) < max_steps and not (out / "export").exists(), "the kill came after the run had finished"


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_matches_uninterrupted_two_process_run(tiny_run):
    full = tiny_run.root / "ddp"  # shared with the equivalence test when it ran first
    if not (full / "export").exists():
        _train("multi_cpu.yaml", tiny_run.recipe, full)
    killed = tiny_run.root / "ddp-killed"
    _kill_after_checkpoint("multi_cpu.yaml", tiny_run.recipe, killed, 4, 20)
    _train("multi_cpu.yaml", tiny_run.recipe, killed, "--resume")
    assert _losses(killed) == _losses(full)
    _assert_same_weights(full / "export" / "model.safetensors", killed / "export" / "model.safetensors", 0)


def _eval_losses(run_dir: Path) -> list[float]:
    return [r["eval_loss"] for r in read_metrics(run_dir) if r.get("eval_loss") is not None]


@pytest.mark.slow
def test_keep_best_and_the_evals_of_two_processes_are_one_processs(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    # each process evaluated eval_batches micro-batches of its own, so the held-out set (and every eval loss) grew
    # with the process count; and keep_best's record lived on the main process only, so at the first eval that did
    # not improve the other process went to keep the weights alone and the run hung
    def recipe(name: str, lr: float) -> Path:
        values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=6, save_every=0, eval_every=1,
                             export=True, precision="fp32", keep_best="loss", eval_batches=2)
        values["optim"]["lr"] = lr
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(values))
        return path

    steady = recipe("steady", 3e-3)
    one, two = _train(None, steady, tmp_path / "one"), _train("multi_cpu.yaml", steady, tmp_path / "two")
    evals = _eval_losses(one)
    assert len(evals) == 6 and _eval_losses(two) == pytest.approx(evals, rel=1e-5)
    # lr 1.5: some evals get worse, so a best is kept and then not beaten (the run hung there); the kept step is
    # the best eval's of this run (the large steps amplify the processes' rounding, so not one process's curve)
    rough = _train("multi_cpu.yaml", recipe("rough", 1.5), tmp_path / "rough")
    evals = _eval_losses(rough)
    assert len(evals) == 6 and min(evals) != evals[-1]
    kept = json.loads((rough / "export" / "draftforge.json").read_text())["metrics"]["kept"]
    assert kept["step"] == 1 + evals.index(min(evals)) and kept["value"] == pytest.approx(min(evals))


@pytest.mark.slow
def test_a_two_process_run_resumed_on_one_process_steps_as_an_uninterrupted_one(tmp_path, tiny_corpus_dir,
                                                                                tiny_tokenizer_dir):
    # Accelerate restored its micro-step counter (3 steps x 1 micro-batch) under accumulation 2: every step synced
    # at its first micro-batch, so no optimizer step ran after the resume, silently. Oracle: one process, no stop
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=6, save_every=3, eval_every=0,
                         export=True, precision="fp32")
    values["optim"]["schedule"] = "constant"  # an extension keeps the rate: the same steps as one 6-step run
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(values))
    whole = _train(None, recipe, tmp_path / "whole")
    part = _train("multi_cpu.yaml", recipe, tmp_path / "part", "--set", "train.max_steps=3")
    _train(None, recipe, part, "--resume")
    assert _losses(part) == pytest.approx(_losses(whole), rel=1e-5)
    _assert_same_weights(whole / "export" / "model.safetensors", part / "export" / "model.safetensors", 1e-5)


@pytest.mark.slow
def test_deepspeed_checkpoint_refuses_another_world_size(tiny_run):
    pytest.importorskip("deepspeed")
    run_dir = tiny_run.root / "zero2"
    if not run_dir.exists():
        _train("deepspeed_zero2.yaml", tiny_run.recipe, run_dir)
    proc = subprocess.run(_command("deepspeed_zero2.yaml", tiny_run.recipe, run_dir, "--resume", procs=1),
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "written by 2 processes under deepspeed-zero2" in proc.stdout + proc.stderr


def test_cpu_processes_get_gloo_and_fsdp1_without_gpus_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    several = {"WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    assert dist.accelerator_kwargs({"WORLD_SIZE": "1"}) == {}
    assert dist.accelerator_kwargs(several) == {"cpu": True}
    (handler,) = dist.accelerator_kwargs({**several, "ACCELERATE_USE_DEEPSPEED": "true"})["kwargs_handlers"]
    assert handler.backend == "gloo"
    fsdp = {**several, "ACCELERATE_USE_FSDP": "true"}
    assert dist.accelerator_kwargs({**fsdp, "FSDP_VERSION": "2"}) == {"cpu": True}  # adopt_cpu_fsdp finishes it
    for version in ({"FSDP_VERSION": "1"}, {}):  # Accelerate's default is FSDP1
        with pytest.raises(DraftforgeError, match=r"FSDP1 .*needs CUDA GPUs.*set fsdp_version: 2"):
            dist.accelerator_kwargs({**fsdp, **version})
    assert yaml.safe_load((REPO / "launch" / "fsdp.yaml").read_text())["fsdp_config"]["fsdp_version"] == 2


def test_gathered_state_rebuilds_a_model_that_has_no_config_constructor():
    """eesd's ExitHead is built from a target's layers, not from a config: the export rebuilds it with the
    task's builder and loads the gathered weights (oracle: the trained head's own outputs)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from draftforge.models.eesd import ExitHead, Trunk, split_target

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2)).eval()
    parts = split_target(target)
    trained = ExitHead.from_target(parts, 2).eval()
    with torch.no_grad():  # as training would: every weight moves away from the target's
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    rebuild = lambda: ExitHead.from_target(parts, 2, layer_init="random", head_init="random", seed=5)  # noqa: E731
    copy = dist.model_from_state(trained, {k: v.clone() for k, v in trained.state_dict().items()}, rebuild)
    assert copy is not trained and not _shared_storage(copy, trained)
    with torch.no_grad():
        inputs = Trunk(parts, 2)(torch.randint(0, 64, (2, 8)))  # (H^N, position ids, rope, mask)
        torch.testing.assert_close(copy(*inputs)[0], trained(*inputs)[0], rtol=0, atol=0)


@pytest.mark.slow  # two processes, gloo
def test_frozen_modules_are_rank_zeros_on_every_process_under_fsdp(tmp_path):
    """A frozen module that loaded differently on rank 1 (as transformers' FSDP loading may leave it) holds
    rank 0's parameters and buffers after share_frozen; under DDP nothing is sent."""
    torch.multiprocessing.spawn(_share_frozen_worker, args=(str(tmp_path),), nprocs=2, join=True)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    for k in rank0["fsdp"]:
        torch.testing.assert_close(rank1["fsdp"][k], rank0["fsdp"][k], rtol=0, atol=0)
    assert not torch.equal(rank1["ddp"]["weight"], rank0["ddp"]["weight"])


def _share_frozen_worker(rank: int, root: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=2)
    out = {}
    for name, fsdp in (("fsdp", object()), ("ddp", None)):
        torch.manual_seed(rank)  # each rank its own weights and buffer
        teacher = torch.nn.Linear(4, 3)
        teacher.register_buffer("inv_freq", torch.rand(2), persistent=False)
        teacher.register_buffer("ids", (torch.arange(3) + rank).expand(2, -1), persistent=False)  # not dense
        acc = SimpleNamespace(num_processes=2, state=SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=fsdp))
        dist.share_frozen(acc, {"teacher": teacher})
        out[name] = {k: v.clone() for k, v in [*teacher.named_parameters(), *teacher.named_buffers()]}
    torch.save(out, f"{root}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


def test_streaming_eval_reads_the_same_rows_as_map_style(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    from accelerate import Accelerator

    from draftforge.train.lm import build_model, lm_loss, load_tokenizer
    from draftforge.train.loop import evaluate
    from draftforge.train.spec import TaskSpec

    recipe = recipe_from_dict(tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, eval_batches=3))
    model = build_model(recipe, load_tokenizer(recipe))
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 300, (9, 16), generator=g).tolist()]

    def stream():
        yield from rows
    losses = [evaluate(model, TaskSpec(model, lm_loss, eval_data=data), Accelerator(cpu=True), recipe.train)
              for data in (datasets.Dataset.from_list(rows), datasets.IterableDataset.from_generator(stream))]
    with torch.no_grad():  # oracle: eval_batches x micro-batch = the first 6 rows, token-weighted mean
        s, n, _ = lm_loss(model.eval(), {k: torch.tensor([r[k] for r in rows[:6]]) for k in ("input_ids", "labels")})
    assert losses[0] == pytest.approx(s.item() / n.item(), rel=1e-5)
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)


@pytest.mark.slow
def test_streaming_two_processes_match_one_and_stop_at_the_same_step(tiny_run):
    values = yaml.safe_load(tiny_run.recipe.read_text())
    values["data"].update(streaming=True, max_documents=1, eval_fraction=0.0)
    values["train"].update(max_steps=10_000, save_every=0, export=True)
    recipe = tiny_run.root / "stream.yaml"
    recipe.write_text(yaml.safe_dump(values))
    one = _train(None, recipe, tiny_run.root / "stream-one")
    two = _train("multi_cpu.yaml", recipe, tiny_run.root / "stream-two")
    assert 0 < len(_losses(one)) < 10_000
    assert _losses(two) == pytest.approx(_losses(one), rel=1e-5)  # same rows per step, same end
    assert (two / "export" / "model.safetensors").is_file()


def test_eval_runs_the_same_number_of_forwards_on_every_rank(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    """5 eval rows, 2 processes, micro-batch 2: rank 0 holds 3 rows, rank 1 two. Under FSDP / ZeRO-3 a
    forward is a collective, so both must run 2 forwards (rank 1's second counts nothing), and the
    token-weighted sums over ranks must still equal one process's."""
    from types import SimpleNamespace

    from draftforge.train.lm import build_model, lm_loss, load_tokenizer
    from draftforge.train.loop import evaluate
    from draftforge.train.spec import TaskSpec

    recipe = recipe_from_dict(tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, eval_batches=3))
    recipe.train.micro_batch_size = 2
    model = build_model(recipe, load_tokenizer(recipe))
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 300, (5, 16), generator=g).tolist()]
    data = datasets.Dataset.from_list(rows)
    forwards, reduced = {0: 0, 1: 0}, {0: [], 1: []}
    for rank in (0, 1):
        def counting_loss(model, batch, rank=rank):
            forwards[rank] += 1
            return lm_loss(model, batch)

        acc = SimpleNamespace(num_processes=2, process_index=rank, device=torch.device("cpu"),
                              reduce=lambda x, op, rank=rank: reduced[rank].append(x) or x)
        evaluate(model, TaskSpec(model, counting_loss, eval_data=data), acc, recipe.train)
    assert forwards == {0: 2, 1: 2}
    # one stacked reduce per evaluate: [loss sum, unit count, the task's metric sums...]
    total = sum(reduced[r][0][0] for r in (0, 1))
    count = sum(reduced[r][0][1] for r in (0, 1))
    with torch.no_grad():  # oracle: all 5 rows in one process
        s, n, _ = lm_loss(model.eval(), {k: torch.tensor([r[k] for r in rows]) for k in ("input_ids", "labels")})
    assert count.item() == n.item()
    assert total.item() == pytest.approx(s.item(), rel=1e-5)


# ---------------------------------------------------------------- FSDP2 on CPU processes (slow)
# launch/fsdp.yaml itself, on 2 CPU processes (gloo): the loss curve of 1 process, an export of the same
# tensors that loads and predicts as 1 process's does, and a resume after SIGKILL. The recipes pin
# train.precision: fp32. `auto` is bf16 on CPUs with native bf16, where FSDP2 casts the parameters (its
# MixedPrecisionPolicy) while 1 process autocasts: measured 1.8e-3 apart on the pretrain curve, not 1e-4.

def _fsdp_vs_one(recipe: Path, root: Path) -> SimpleNamespace:
    one, two = _train(None, recipe, root / "one"), _train("fsdp.yaml", recipe, root / "fsdp")
    state = ckpt.read_loop_state(ckpt.latest_valid(two))
    assert state["backend"] == "fsdp" and state["world_size"] == 2
    # Sharded, not silently DDP: each rank wrote its own shard of the weights.
    shards = sorted(p.name for p in (ckpt.latest_valid(two) / "pytorch_model_fsdp_0").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]
    return SimpleNamespace(one=one, two=two)


def _assert_curves_match(one: Path, two: Path, *keys: str) -> None:
    rows = [[json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()] for d in (one, two)]
    assert len(rows[0]) == len(rows[1]) > 0
    for key in keys:
        assert [r[key] for r in rows[1]] == pytest.approx([r[key] for r in rows[0]], rel=0, abs=1e-4), key


def _assert_same_tensors(a: Path, b: Path, atol: float) -> None:
    """The same names, shapes and dtypes; values within atol."""
    wa, wb = _weights(a), _weights(b)
    assert {k: (v.shape, v.dtype) for k, v in wa.items()} == {k: (v.shape, v.dtype) for k, v in wb.items()}
    _assert_same_weights(a, b, atol)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, tiny_corpus_dir, tiny_tokenizer_dir):
    root = tmp_path_factory.mktemp("fsdp")
    recipe = _fp32_recipe(root, tiny_corpus_dir, tiny_tokenizer_dir, steps=8)
    return SimpleNamespace(root=root, recipe=recipe, **vars(_fsdp_vs_one(recipe, root)))


@pytest.mark.slow
def test_fsdp_two_processes_match_one_process(fsdp_run):
    from draftforge.loading import load_causal_lm

    _assert_curves_match(fsdp_run.one, fsdp_run.two, "loss")
    _assert_same_tensors(fsdp_run.one / "export" / "model.safetensors", fsdp_run.two / "export" / "model.safetensors",
                         1e-4)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = [load_causal_lm(str(d / "export")).eval()(ids).logits for d in (fsdp_run.one, fsdp_run.two)]
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-4)


@pytest.mark.slow
def test_fsdp_sigkill_mid_run_then_resume_matches_uninterrupted_run(fsdp_run):
    killed = fsdp_run.root / "fsdp-killed"
    # --auto-resume both times (the same command line, as a requeued job reruns it): a start, then a resume, the
    # choice made by the main process and shared with the other (the DDP test above resumes with --resume)
    _kill_after_checkpoint("fsdp.yaml", fsdp_run.recipe, killed, 4, 8, "--auto-resume")
    _train("fsdp.yaml", fsdp_run.recipe, killed, "--auto-resume")  # the sharded model and optimizer state come back
    assert _losses(killed) == _losses(fsdp_run.two)
    _assert_same_weights(fsdp_run.two / "export" / "model.safetensors", killed / "export" / "model.safetensors", 0)


@pytest.mark.slow
@pytest.mark.parametrize("task", ["distill", "eesd"])
def test_fsdp_with_a_frozen_teacher_matches_one_process(task, tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    """The frozen module (distill's teacher, eesd's trunk) is never wrapped: each rank holds it whole and
    rank 0's copy; only the student / exit head is sharded. eesd's head is not a transformers model, so its
    export is rebuilt by the task's builder."""
    from draftforge.loading import load_causal_lm

    if task == "distill":
        from tests.fixtures.hybrid import tiny_bamba
        from tests.train.test_distill import distill_recipe
        from transformers import AutoTokenizer

        teacher = tmp_path / "teacher"
        tiny_bamba(vocab=len(AutoTokenizer.from_pretrained(tiny_tokenizer_dir)), seed=7).save_pretrained(teacher)
        values = distill_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, teacher)
        values["train"].update(max_steps=6, save_every=6, export=True)
        weights, keys = "model.safetensors", ("loss", "kl", "top1_agree")
    else:
        from tests.train.test_eesd import recipe as eesd_recipe
        from tests.train.test_eesd import save_target, token_rows

        target = save_target(tmp_path / "target", tiny_tokenizer_dir)
        values = eesd_recipe(tmp_path, target, token_rows(tmp_path / "rows.jsonl", target, n=8))
        values["train"].update(max_steps=4, save_every=4, log_every=1, eval_every=0, export=True)
        weights, keys = "exit_head.safetensors", ("loss",)
    values["train"]["precision"] = "fp32"
    recipe = tmp_path / f"{task}.yaml"
    recipe.write_text(yaml.safe_dump(values))
    runs = _fsdp_vs_one(recipe, tmp_path)
    _assert_curves_match(runs.one, runs.two, *keys)
    _assert_same_tensors(runs.one / "export" / weights, runs.two / "export" / weights, 1e-4)
    if task == "distill":  # loads as a drafter checkpoint and predicts as 1 process's
        ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(0))
        logits = [load_causal_lm(str(d / "export")).eval()(ids).logits for d in (runs.one, runs.two)]
    else:  # attaches to its target and predicts as 1 process's
        from draftforge.models.eesd import Trunk, split_target
        from draftforge.models.eesd_export import load_exit_head

        target_model = load_causal_lm(str(target)).eval()
        inputs = Trunk(split_target(target_model), 2)(torch.randint(0, 300, (2, 16)))
        logits = [load_exit_head(d / "export", target_model)[0].eval()(*inputs)[0] for d in (runs.one, runs.two)]
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-4)


@pytest.mark.slow
def test_two_processes_normalise_by_the_global_batchs_count_when_micro_batches_count_unequally(tmp_path):
    """Every micro-batch of the tiny corpus counts the same tokens, so a process dividing by its own count (or a mean
    of micro-batch means) gave the same curve on 1 and 2 processes. The counted task's rows count 1-4 units: the
    launch of two matches one process only when each step divides the global batch's summed loss by its count."""
    from tests.train.test_training_math import counted_recipe

    values = counted_recipe(tmp_path, max_steps=6, micro_batch_size=1, save_every=0)
    recipe = tmp_path / "counted.yaml"
    recipe.write_text(yaml.safe_dump(values))
    one, two = _train(None, recipe, tmp_path / "one"), _train("multi_cpu.yaml", recipe, tmp_path / "two")
    assert _losses(two) == pytest.approx(_losses(one), rel=1e-6)
    _assert_same_weights(ckpt.latest_valid(one) / "model.safetensors", ckpt.latest_valid(two) / "model.safetensors",
                         1e-6)


def test_a_frozen_module_zero3_partitioned_while_loading_is_one_line():
    """distill under launch/deepspeed_zero3.yaml (zero3_init_flag false): transformers still partitioned the teacher
    it loaded under the ZeRO-3 config, and the first forward died with torch's "'weight' must be 2-D"."""
    from draftforge.train.distributed import check_frozen_placement

    def acc(stage, init_flag=False):
        plugin = SimpleNamespace(zero_stage=stage, zero3_init_flag=init_flag)
        return SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin))

    whole = torch.nn.Linear(4, 4)
    partitioned = torch.nn.Linear(4, 4)
    partitioned.weight = torch.nn.Parameter(torch.empty(0))  # what a ZeRO-3 partition leaves on a process
    partitioned.weight.ds_id = 7
    with pytest.raises(DraftforgeError, match=r"frozen modules \(teacher\) outside ZeRO, but under ZeRO-3 "
                                              r"transformers partitioned them while loading.*ZeRO-2"):
        check_frozen_placement(acc(3), {"teacher": partitioned})
    check_frozen_placement(acc(3), {"teacher": whole})  # loaded whole: fine
    check_frozen_placement(acc(2), {"teacher": partitioned})  # not ZeRO-3: not this check's case
    with pytest.raises(DraftforgeError, match="sets zero3_init_flag: true"):
        check_frozen_placement(acc(3, init_flag=True), {"teacher": whole})
    check_frozen_placement(SimpleNamespace(state=SimpleNamespace()), {"teacher": partitioned})  # no DeepSpeed
