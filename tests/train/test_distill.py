"""Task `distill`: a tiny Mamba2 drafter learns a frozen hybrid target's distributions (KL falls), the
teacher stays bitwise unchanged and out of the optimizer, and the export loads as a normal drafter."""

from __future__ import annotations

import json

import pytest
import torch

from draftforge.errors import RecipeError
from draftforge.recipe import recipe_from_dict
from draftforge.train import checkpoint as ckpt
from draftforge.train import distill, run
from draftforge.train.loop import read_metrics
from tests.fixtures.hybrid import tiny_bamba
from tests.fixtures.resume import assert_resume_matches_uninterrupted


def distill_recipe(tmp_path, corpus, tokenizer, teacher_dir, **options) -> dict:
    return {
        "task": "distill", "output_dir": str(tmp_path / "run"),
        "model": {"arch": "mamba2", "size": "tiny", "tokenizer": str(tokenizer), "target": str(teacher_dir),
                  "overrides": {"hidden_size": 32, "num_hidden_layers": 2, "head_dim": 16, "state_size": 8}},
        "data": {"sources": [str(corpus)], "eval_fraction": 0.2},
        "distill": {"temperature": 2.0, "ce_weight": 0.1, **options},
        "optim": {"lr": 1e-2, "warmup_steps": 2},
        "train": {"max_steps": 30, "global_batch_size": 4, "micro_batch_size": 2, "block_size": 32,
                  "eval_every": 0, "save_every": 30, "log_every": 1, "trackers": []},
    }


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tiny_tokenizer_dir))
    d = tmp_path_factory.mktemp("teacher")
    tiny_bamba(vocab=vocab, seed=7).save_pretrained(d)
    return d


def test_distill_lowers_kl_keeps_teacher_bitwise_and_exports_a_drafter(tmp_path, tiny_corpus_dir,
                                                                        tiny_tokenizer_dir, teacher_dir, monkeypatch):
    seen = {}
    real_load = distill.load_teacher

    def spy(recipe):
        teacher = real_load(recipe)
        seen["teacher"], seen["before"] = teacher, {k: v.clone() for k, v in teacher.state_dict().items()}
        return teacher

    monkeypatch.setattr(distill, "load_teacher", spy)
    result = run(recipe_from_dict(distill_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, teacher_dir)))
    logged = read_metrics(result.run_dir)
    kl = [r["kl"] for r in logged if "kl" in r]
    assert sum(kl[-5:]) / 5 < 0.7 * sum(kl[:3]) / 3, kl  # the student moved towards the teacher
    after = seen["teacher"].state_dict()
    assert all(torch.equal(after[k], v) for k, v in seen["before"].items())  # frozen: bitwise unchanged
    opt_state = torch.load(ckpt.list_checkpoints(result.run_dir)[0] / "optimizer.bin", weights_only=True)
    from draftforge.decode import load_drafter, load_target

    student_params = sum(1 for _ in load_drafter(str(result.export_dir), load_target(str(teacher_dir))).model.parameters())
    assert len(opt_state["state"]) == student_params  # no optimizer state for the teacher
    meta = json.loads((result.export_dir / "draftforge.json").read_text())
    assert meta["task"] == "distill" and meta["distilled_from"] == str(teacher_dir)


class _Fixed(torch.nn.Module):
    """A model whose logits are given: the loss path around it is what is tested."""

    def __init__(self, logits_BTV):
        super().__init__()
        self.logits_BTV = logits_BTV

    def forward(self, input_ids):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.logits_BTV)


def test_the_distill_loss_at_a_temperature_against_a_float64_hand_computation():
    """make_loss, the path training runs, with loss mix at τ = 2: per kept position 0.3·τ²·KL(softmax(t/τ) ‖
    softmax(s/τ)) + 1.7·(1 − Σ min(p, q)) at T = 1, plus 0.2·CE of the data's next token, summed; the positions
    whose next label is -100 carry nothing. A teacher logit of −inf (an id it never emits) has no mass: the KL
    must stay finite (0·(−inf) made it NaN)."""
    torch.manual_seed(0)
    B, T, V, tau = 2, 5, 7, 2.0
    t_BTV, s_BTV = torch.randn(B, T, V) * 2, torch.randn(B, T, V) * 2
    t_BTV[0, 1, 3] = float("-inf")
    s_BTV.requires_grad_(True)
    ids_BT = torch.randint(0, V, (B, T))
    labels_BT = ids_BT.clone()
    labels_BT[0, :2] = -100  # a prompt: position 0 has no next label to learn (and the last never has one)
    options = distill.DistillConfig(loss="mix", temperature=tau, kl_weight=0.3, tvd_weight=1.7, ce_weight=0.2)
    student = _Fixed(s_BTV).train()
    total, count, metrics = distill.make_loss(_Fixed(t_BTV), options)(student, {"input_ids": ids_BT,
                                                                                "labels": labels_BT})
    want, kept = 0.0, 0
    t64, s64 = t_BTV.double(), s_BTV.detach().double()
    for b in range(B):
        for i in range(T - 1):
            nxt = int(labels_BT[b, i + 1])
            if nxt == -100:
                continue
            kept += 1
            p_t, q_t = (t64[b, i] / tau).softmax(-1), (s64[b, i] / tau).softmax(-1)
            kl = sum(float(p_t[v] * (p_t[v].log() - q_t[v].log())) for v in range(V) if p_t[v] > 0)
            p, q = t64[b, i].softmax(-1), s64[b, i].softmax(-1)
            tvd = 1.0 - float(torch.minimum(p, q).sum())
            ce = -float(q[nxt].log())
            want += 0.3 * tau**2 * kl + 1.7 * tvd + 0.2 * ce
    assert int(count) == kept == 2 * (T - 1) - 1
    assert float(total.detach()) == pytest.approx(want, rel=1e-5)
    assert torch.isfinite(metrics["kl"])
    total.backward()
    assert torch.isfinite(s_BTV.grad).all()


def test_distill_needs_a_target(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, teacher_dir):
    values = distill_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, teacher_dir)
    values["model"].pop("target")
    with pytest.raises(RecipeError, match="model.target"):
        recipe_from_dict(values)
    values = distill_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, teacher_dir, temperature=0)
    with pytest.raises(RecipeError, match="distill.temperature"):
        recipe_from_dict(values)


@pytest.mark.slow  # two accelerate launches on CPU
def test_distill_on_two_processes_matches_one(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, teacher_dir):
    """The teacher is frozen and never prepared, so N processes reproduce one process's KL curve."""
    import subprocess

    import yaml

    from tests.train.test_distributed import _command, _env

    values = distill_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, teacher_dir)
    # fp32: under bf16 autocast (precision auto on CPUs with native bf16) half a batch rounds differently
    values["train"].update(max_steps=6, save_every=6, log_every=1, precision="fp32")
    recipe = tmp_path / "distill.yaml"
    recipe.write_text(yaml.safe_dump(values))
    curves = {}
    for config in (None, "multi_cpu.yaml"):
        out = tmp_path / f"run-{config}"
        proc = subprocess.run(_command(config, recipe, out), cwd=str(recipe.parent), env=_env(), capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert ("2 process(es)" if config else "1 process(es)") in proc.stdout
        curves[config] = [r["kl"] for r in read_metrics(out) if "kl" in r]
    assert len(curves[None]) == 6
    assert curves["multi_cpu.yaml"] == pytest.approx(curves[None], rel=1e-4)


class Fixed(torch.nn.Module):
    """A model whose logits are given (teacher or student of a hand computation)."""

    def __init__(self, logits):
        super().__init__()
        self.out = logits

    def forward(self, input_ids):
        return type("Out", (), {"logits": self.out})()


def test_reduced_head_kl_is_against_the_teachers_restricted_renormalised_distribution():
    """Hand computation: p = softmax(teacher)[d2t] / its sum, KL(p ‖ softmax(student)); top-1 agreement maps the
    student's argmax back to a target id and compares it with the teacher's argmax over the whole vocabulary."""
    torch.manual_seed(0)
    d2t = torch.tensor([1, 4, 5, 9])
    teacher_logits = torch.randn(1, 3, 12)
    teacher_logits[0, 0, 7] = 9.0  # position 0: the teacher's favourite is outside the draft vocabulary
    teacher_logits[0, 1, 4] = 9.0  # position 1: inside (draft id 1)
    student = torch.randn(1, 3, 4)
    student[0, 0, 2] = student[0, 1, 1] = 9.0

    batch = {"input_ids": torch.zeros(1, 3, dtype=torch.long), "labels": torch.tensor([[0, 2, 3]])}
    loss = distill.make_loss(Fixed(teacher_logits), distill.DistillConfig(), d2t)
    total, count, metrics = loss(Fixed(student), batch)
    expected = 0.0
    for pos in range(2):  # the last position has no next token
        p = teacher_logits[0, pos].softmax(-1)[d2t]
        p = p / p.sum()
        q = student[0, pos].softmax(-1)
        expected += float((p * (p / q).log()).sum())
    assert count == 2
    assert float(total) == pytest.approx(expected, rel=1e-5)
    assert int(metrics["top1_agree"]) == 1  # position 1 only: draft id 1 is target id 4


def test_a_reduced_heads_acceptance_counts_the_positions_outside_its_draft_vocabulary():
    """Hand case: the target is sure of every next token (logit 30), the student is the target restricted to 3 of
    6 ids, and 2 of the 7 next tokens lie outside them. The head accepts 5 of 7: α = top-1 = 5/7, not 1 (the loss
    still counts the 5 positions it can learn). Eval chains (γ = 5) run over all 7: greedy agreement
    1,1,0,1,0,1,1 gives 2, 1 and 0 tokens from the three anchors, τ = 1 + 3/3 = 2."""
    from draftforge.models.draft_vocab import target_to_draft
    from draftforge.train.lm import labels_to_draft_ids

    d2t, tokens = [0, 2, 4], [0, 2, 4, 1, 0, 3, 2, 4]
    teacher_logits = torch.zeros(1, len(tokens), 6)
    for t, nxt in enumerate(tokens[1:]):
        teacher_logits[0, t, nxt] = 30.0

    collate = labels_to_draft_ids(target_to_draft(6, d2t))
    batch = collate({"input_ids": [tokens], "labels": [tokens]}, "cpu")
    assert batch["target_labels"].tolist() == [tokens]
    loss = distill.make_loss(Fixed(teacher_logits), distill.DistillConfig(), torch.tensor(d2t))
    for training in (True, False):
        student = Fixed(teacher_logits[..., d2t]).train(training)
        total, count, sums = loss(student, batch)
        means = {k: float(v) / float(count) for k, v in sums.items()}  # as the loop divides every sum
        means.update(distill.derive_metrics(means))
        assert int(count) == 5
        assert means["alpha"] == pytest.approx(5 / 7, abs=1e-6)
        assert means["top1_agree"] == pytest.approx(5 / 7)
    assert means["tau_chain_g5_greedy"] == pytest.approx(2.0)
    report = distill.acceptance_report(means, int(count))["acceptance"]
    assert report["positions"] == 7 and report["alpha"] == pytest.approx(5 / 7, abs=1e-6)


def test_distill_trains_a_reduced_head_student(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, teacher_dir):
    """A student with a draft vocabulary (model.draft_vocab) learns the teacher's restricted distribution, and its
    export loads as a reduced-vocabulary drafter of that target."""
    from draftforge.decode import load_drafter, load_target

    values = distill_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, teacher_dir)
    values["model"]["draft_vocab"] = 64
    result = run(recipe_from_dict(values))
    kl = [r["kl"] for r in read_metrics(result.run_dir) if "kl" in r]
    assert sum(kl[-5:]) / 5 < 0.7 * sum(kl[:3]) / 3, kl
    drafter = load_drafter(str(result.export_dir), load_target(str(teacher_dir)))
    assert drafter.model.get_output_embeddings().weight.shape[0] == 64
    assert len(drafter.model.config.draft_vocab) == 64


def test_a_reduced_head_distill_resumes_as_it_would_have_run(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir,
                                                             teacher_dir):
    values = distill_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, teacher_dir)
    values["model"]["draft_vocab"] = 64
    values["train"].update(max_steps=6, eval_every=2, save_every=2)
    assert_resume_matches_uninterrupted(values, tmp_path, stop=3)


def test_distills_export_keys_are_its_own_and_the_lm_spec_it_starts_from_is_untouched(
        tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, teacher_dir, monkeypatch):
    """distill composes the LM task's spec into a new one: its keys (distilled_from) reach its export, while the
    LM spec it started from, and that spec's own export, are left without them (no dict shared with a closure)."""
    from draftforge.train import lm
    from draftforge.train.export_run import _NoAccelerator

    recipe = recipe_from_dict(distill_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, teacher_dir))
    built, real_build = {}, lm.build_lm_task

    def spy(*args, **kwargs):
        built["lm"] = real_build(*args, **kwargs)
        return built["lm"]

    monkeypatch.setattr(lm, "build_lm_task", spy)
    spec = distill.build_distill_task(recipe, _NoAccelerator())
    plain = built["lm"]
    assert spec is not plain and spec.model is plain.model
    assert spec.export_metadata["distilled_from"] == str(teacher_dir)
    assert "distilled_from" not in plain.export_metadata and "teacher" not in plain.frozen
    assert plain.export_report is None and spec.export_report is distill.acceptance_report
    caller = {"task": "distill", "target": str(teacher_dir), "recipe": recipe.to_dict(), "metrics": {}}
    metas = {}
    for name, s in (("distill", spec), ("lm", plain)):
        metas[name] = json.loads((s.write_export(s.model, tmp_path / name, caller) / "draftforge.json").read_text())
    assert metas["distill"]["distilled_from"] == str(teacher_dir) and "distilled_from" not in metas["lm"]
    assert metas["distill"]["tokenizer_fingerprint"] == metas["lm"]["tokenizer_fingerprint"]
