"""Task eagle3 on a `draftforge harvest hidden` cache (eagle3.hidden_cache). The oracle is the online run on the
same rows: with the cached top-k holding the whole (draft) vocabulary, every step's loss, the eval loss and the
trained head agree with it to float32 rounding, and the target's model is never built. A cache from another
target, tokenizer or layer set, a truncated shard, or layer ids outside the target are refused before the run dir
is claimed, each by one error naming both sides."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftforge.cli import main as cli_main
from draftforge.errors import CompatibilityError, DataError, RecipeError
from draftforge.harvest.hidden import harvest_hidden
from draftforge.recipe import recipe_from_dict
from draftforge.train.eagle3_cache import build_task
from draftforge.train.loop import read_metrics, train
from tests.data.test_logits_cache import write_rows
from tests.train.test_eesd import save_target

BLOCK = 64  # rows of 40-60 ids: one per block, so the online target reads each row as the harvest did


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """These runs train in fp32 (the oracle is float32 rounding); a run in another precision before or after them
    in the same process (train.precision auto on a CPU with native bf16) would find Accelerate's process-wide state
    refusing it, so it is cleared on both sides."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tiny_tokenizer_dir):
    return save_target(tmp_path_factory.mktemp("target"), tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    return write_rows(tmp_path_factory.mktemp("rows") / "rows.jsonl", n=16)


def harvest(target, rows, out, **kw):
    settings = {"top_k": 512, "max_len": BLOCK, "batch_size": 4, "shard_rows": 6, "dtype": "float32",
                "progress": False}
    harvest_hidden(str(target), str(rows), str(out), **{**settings, **kw})
    return out


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory, target_dir, rows_file):  # K = the whole vocabulary of 512
    return harvest(target_dir, rows_file, tmp_path_factory.mktemp("hidden") / "whole")


def recipe(tmp_path, name, target, rows, cache=None, model=None, **eagle3):
    return {
        "task": "eagle3", "output_dir": str(tmp_path / name),
        "model": {"target": str(target), **(model or {})},
        "data": {"sources": [str(rows)], "format": "tokens", "eval_fraction": 0.2},
        "eagle3": {"steps": 3, **({"hidden_cache": str(cache)} if cache else {}), **eagle3},
        "optim": {"lr": 3e-3, "warmup_steps": 0, "weight_decay": 0.0},
        "train": {"max_steps": 4, "global_batch_size": 4, "micro_batch_size": 2, "block_size": BLOCK,
                  "eval_every": 4, "save_every": 4, "log_every": 1, "trackers": [], "precision": "fp32"},
    }


def run(values):
    built = {}

    def build(r, acc, with_data=True):
        built["spec"] = build_task(r, acc, with_data)
        return built["spec"]

    return train(recipe_from_dict(values), build), built["spec"]


@pytest.mark.parametrize("draft", [None, 64], ids=["whole-vocab", "reduced-head"])
def test_a_few_steps_from_the_cache_are_the_online_run(tmp_path, monkeypatch, target_dir, rows_file, cache_dir,
                                                       draft):
    import draftforge.loading

    model, cache = None, cache_dir
    if draft is not None:  # K = the draft vocabulary, counted on the rows as model.draft_vocab_from counts it
        model = {"draft_vocab": draft, "draft_vocab_from": str(rows_file)}
        cache = harvest(target_dir, rows_file, tmp_path / "draft-cache", top_k=draft, draft_vocab=str(draft))
    online, _ = run(recipe(tmp_path, "online", target_dir, rows_file, model=model))

    def no_target(*args, **kwargs):
        raise AssertionError("the target's model was built")

    monkeypatch.setattr(draftforge.loading, "load_causal_lm", no_target)
    cached, spec = run(recipe(tmp_path, "cached", target_dir, rows_file, cache, model=model))
    monkeypatch.undo()
    assert set(spec.frozen) == {"target_embedding"}
    assert len(cached.losses) == len(online.losses) == 4
    # step 1 (the same head): float32 rounding, through the KL's cancellation Σ p log p − Σ p log q; later steps: that rounding in the gradients, through Adam (which
    # scales a near-zero gradient's noise up to a step of lr), moves the heads apart by a little more
    assert cached.losses[0] == pytest.approx(online.losses[0], rel=2e-5)
    torch.testing.assert_close(torch.tensor(cached.losses), torch.tensor(online.losses), rtol=2e-4, atol=0)
    assert cached.eval_loss == pytest.approx(online.eval_loss, rel=2e-4)
    def acceptance(run_dir):  # α, top-1 per step and the simulated τ, train and eval
        return {(i, k): v for i, r in enumerate(read_metrics(run_dir)) for k, v in r.items()
                if any(part in k for part in ("alpha_at", "top1_at", "tau_ttt"))}

    logged, want = acceptance(cached.run_dir), acceptance(online.run_dir)
    assert logged.keys() == want.keys() and any(k[1] == "eval_tau_ttt" for k in want)
    assert logged == pytest.approx(want, rel=1e-4, abs=1e-6)
    a, b = (load_file(str(r.export_dir / "model.safetensors")) for r in (cached, online))
    lr, steps = 3e-3, 4  # the recipe's
    for name in b:  # the same rounding, through Adam, in the weights: nearly every element agrees to 1e-3, and an
        # element whose gradient is rounding noise moves by up to ~lr a step in either run (Adam normalises the
        # step, not the gradient), so no element may differ by more than 2 * lr * steps
        close = torch.isclose(a[name], b[name], rtol=1e-3, atol=1e-5)
        assert close.float().mean() >= 0.99, (name, int((~close).sum()), close.numel())
        assert float((a[name].double() - b[name].double()).abs().max()) <= 2 * lr * steps, name
    meta = json.loads((cached.export_dir / "draftforge.json").read_text())
    assert meta["hidden_cache"] == str(cache) and meta["aux_layers"] == [1, 2, 3]
    out = tmp_path / "again"  # `draftforge export RUN_DIR` rebuilds the head without the cache or the target
    monkeypatch.setattr(draftforge.loading, "load_causal_lm", no_target)
    assert cli_main(["export", str(cached.run_dir), "--out", str(out)]) == 0
    assert (out / "model.safetensors").read_bytes() == (cached.export_dir / "model.safetensors").read_bytes()


class _Quiet:
    """What a task builder uses of the accelerator, for building a spec outside the loop."""

    def main_process_first(self):
        import contextlib

        return contextlib.nullcontext()

    def print(self, *args, **kwargs):
        pass


@pytest.mark.parametrize("draft,loss,body", [(None, "kl", "attention"), (64, "kl", "attention"),
                                             (64, "mix", "attention"), (None, "kl", "mamba2")])
def test_the_cached_loss_and_its_gradient_are_the_online_ones_to_float32_rounding(tmp_path, target_dir, rows_file,
                                                                                 cache_dir, draft, loss, body):
    """Every training block, one head: the summed loss, the count, every metric (eval mode: the chain sums too) and
    the gradient of every head weight from the cache against those of the online loss with the target running.
    (TVD's gradient is a subgradient of a min: where p_v and q_v agree to rounding, as they do for a head started
    from the target, either branch may be taken, so with loss mix only the values are compared.)"""
    model, cache = None, cache_dir
    if draft is not None:
        model = {"draft_vocab": draft, "draft_vocab_from": str(rows_file)}
        cache = harvest(target_dir, rows_file, tmp_path / "draft-cache", top_k=draft, draft_vocab=str(draft))
    specs = [build_task(recipe_from_dict(recipe(tmp_path, "r", target_dir, rows_file, c, model=model,
                                                       loss=loss, body=body)), _Quiet()) for c in (None, cache)]
    online, cached = specs
    head = online.model
    cached.model.load_state_dict(head.state_dict())
    for training in (True, False):
        for i in range(0, len(online.train_data), 2):
            out = []
            for spec in specs:
                spec.model.train(training).zero_grad()
                batch = spec.collate(spec.train_data[i: i + 2], "cpu")
                total, count, metrics = spec.loss(spec.model, batch)
                if training and loss == "kl":
                    total.backward()
                out.append((float(total.detach()), int(count), {k: float(v) for k, v in metrics.items()},
                            {n: p.grad.clone() for n, p in spec.model.named_parameters() if p.grad is not None}))
            (t0, c0, m0, g0), (t1, c1, m1, g1) = out
            # float32 rounding through the KL's cancellation (Σ p log p − Σ p log q, each ~100x the KL here)
            assert c1 == c0 > 0 and t1 == pytest.approx(t0, rel=2e-5) and m1 == pytest.approx(m0, rel=2e-5, abs=1e-6)
            assert (len(g0) > 0 and g0.keys() == g1.keys()) if training and loss == "kl" else not g0 and not g1
            scale = max((float(g.abs().max()) for g in g0.values()), default=0.0)  # the largest gradient entry
            for name, grad in g0.items():
                torch.testing.assert_close(g1[name], grad, rtol=1e-4, atol=1e-6 * scale)


def _refused(values, error, match):
    with pytest.raises(error, match=match):
        run(values)
    assert not Path(values["output_dir"]).exists()  # the run dir was never claimed


def test_a_cache_of_another_target_tokenizer_or_layer_set_or_a_truncated_shard_is_refused(
        tmp_path, target_dir, rows_file, cache_dir, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    other = save_target(tmp_path / "other-target", tiny_tokenizer_dir, seed=4)
    _refused(recipe(tmp_path, "run", other, rows_file, cache_dir), CompatibilityError,
             rf"hidden-state cache .* was harvested from target {re.escape(str(target_dir))} \(weights fingerprint "
             rf"\w+\), not from model.target {re.escape(str(other))} \(weights fingerprint \w+\)")
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tok.eos_token = "<|bos|>"  # same ids, other special tokens: another tokenizer fingerprint
    retok = tmp_path / "retok"  # the same weights, its tokenizer files replaced since the harvest
    shutil.copytree(target_dir, retok)
    tok.save_pretrained(retok)
    values = recipe(tmp_path, "run", retok, rows_file, cache_dir)
    _refused(values, CompatibilityError, "hidden-state cache .* was harvested with .*tokenizer fingerprint \\w+.* "
                                         "but this run uses .*tokenizer fingerprint \\w+")
    _refused(recipe(tmp_path, "run", target_dir, rows_file, cache_dir, aux_layers=[0, 2, 3]), CompatibilityError,
             r"holds the states entering target layers \[1, 2, 3\], but eagle3.aux_layers is \[0, 2, 3\]")
    broken = tmp_path / "broken"
    shutil.copytree(cache_dir, broken)
    shard = broken / "shard-00001.safetensors"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:64])
    _refused(recipe(tmp_path, "run", target_dir, rows_file, broken), DataError,
             f"hidden-state cache shard .*shard-00001.safetensors is truncated .64 of {size:,} bytes.")
    with pytest.raises(CompatibilityError, match=r"eagle3.aux_layers: ids \[4\] outside 0..3 for a target of 4 layers"):
        recipe_from_dict(recipe(tmp_path, "run", target_dir, rows_file, cache_dir, aux_layers=[1, 4]))
    with pytest.raises(RecipeError, match="eagle3.temperature"):
        recipe_from_dict(recipe(tmp_path, "run", target_dir, rows_file, cache_dir, temperature=2.0))
    values = recipe(tmp_path, "run", target_dir, rows_file, cache_dir)
    values["data"]["format"] = "text"
    with pytest.raises(RecipeError, match="eagle3.hidden_cache holds a target's states"):
        recipe_from_dict(values)


def test_a_cached_fine_tune_starts_from_the_export_as_the_online_one_does(tmp_path, target_dir, rows_file, cache_dir):
    # model.init_from was ignored by the cached build: a fresh head (from the target) trained instead, silently
    from draftforge.train.eagle3 import build_eagle3_task

    first, _ = run(recipe(tmp_path, "first", target_dir, rows_file))
    exported = load_file(str(first.export_dir / "model.safetensors"))
    start = {"init_from": str(first.export_dir)}
    for name, cache, builder in (("online", None, build_eagle3_task), ("cached", cache_dir, build_task)):
        spec = builder(recipe_from_dict(recipe(tmp_path, name, target_dir, rows_file, cache, model=start)), _Quiet())
        state = spec.model.state_dict()
        assert [k for k in exported if not torch.equal(state[k].float(), exported[k].float())] == [], name
    online, _ = run(recipe(tmp_path, "online-ft", target_dir, rows_file, model=start))
    cached, _ = run(recipe(tmp_path, "cached-ft", target_dir, rows_file, cache_dir, model=start))
    assert cached.losses[0] == pytest.approx(online.losses[0], rel=2e-5)  # the same head on the same rows
    assert cached.losses[0] < first.losses[0]  # a trained head, not a fresh one
    # a head fusing other layers than the cache holds: only a new harvest helps (it advised "set eagle3.aux_layers:
    # [1, 2, 3]", which the fine-tune then refused as not the head's own layers)
    other, _ = run(recipe(tmp_path, "other", target_dir, rows_file, aux_layers=[0, 2, 3]))
    with pytest.raises(CompatibilityError) as refused:
        build_task(recipe_from_dict(recipe(tmp_path, "other-ft", target_dir, rows_file, cache_dir,
                                           model={"init_from": str(other.export_dir)})), _Quiet())
    assert str(refused.value).endswith("holds the states entering target layers [1, 2, 3], but model.init_from's "
                                       "head is [0, 2, 3]; harvest again with --layers 0,2,3")
