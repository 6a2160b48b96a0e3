"""Task `distill`: a small SSM drafter trained on a frozen target's distributions (STree §5.2).

The student (by default a few Mamba2 layers, `model.arch: mamba2`, with the target's vocabulary and
optionally its input embeddings) minimises the forward KL(p_target ‖ p_student) at temperature τ,
scaled by τ² (Hinton et al.), plus an optional next-token CE on the data. The teacher's logits are
computed on the fly in the same step from the same packed blocks; the teacher is a `TaskSpec.frozen`
module, so it has no optimizer state, no gradient sync and no sharding on 1 or N processes. The
export is a normal drafter checkpoint (`load_drafter` reads it like a pretrain export).

A student with a reduced draft head (`model.draft_vocab`, or one that comes with `model.init_from`)
predicts only N of the target's V tokens; its KL is taken against the teacher's distribution
restricted to those N ids and renormalised (the target-side mass it cannot predict is not a loss it
can lower), and its top-1 agreement compares its argmax, mapped back to a target id, with the
teacher's argmax over the full vocabulary. Positions whose next token lies outside the draft
vocabulary carry no label after the draft-id mapping and are left out of KL and CE alike.

Legend: B batch, T block size, V vocabulary, N draft vocabulary, D hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftforge.errors import CompatibilityError, RecipeError
from draftforge.models.draft_vocab import d2t_of
from draftforge.recipe import Recipe, doc, require


@dataclass
class DistillConfig:
    temperature: float = doc(1.0, "softmax temperature τ of teacher and student in the KL (the KL is scaled by τ²)")
    kl_weight: float = doc(1.0, "weight of KL(p_target ‖ p_student) (STree's recipe: 1.0)")
    ce_weight: float = doc(0.0, "weight of the next-token CE on the data (STree's recipe: 0.0)")
    embeddings_from_target: bool = doc(False, "start the student's input embeddings (and a tied head) from the "
                                              "target's; needs the same hidden size")
    trainable: list[str] = doc([], "train only parameters whose name contains one of these strings (e.g. [mamba] "
                                   "for a converted hybrid's new mixers); []: all")

    def check(self, at: str) -> None:
        require(self.temperature > 0, f"{at}.temperature", "must be > 0")
        require(self.kl_weight >= 0 and self.ce_weight >= 0, f"{at}.kl_weight", "weights must be >= 0")
        require(self.kl_weight + self.ce_weight > 0, f"{at}.kl_weight", "kl_weight + ce_weight must be > 0")


def check_distill(recipe: Recipe) -> None:
    require(bool(recipe.model.target), "model.target",
            "distill needs the teacher: point model.target at the target model (a local directory)")


def kl_loss(student_logits_BTV, teacher_logits_BTV, keep_BT, temperature: float):
    """Summed τ²·KL(softmax(t/τ) ‖ softmax(s/τ)) over the kept positions (fp32)."""
    s_NV = student_logits_BTV[keep_BT].float() / temperature
    t_NV = teacher_logits_BTV[keep_BT].float() / temperature
    t_logp_NV = t_NV.log_softmax(-1)
    kl_N = (t_logp_NV.exp() * (t_logp_NV - s_NV.log_softmax(-1))).sum(-1)
    return kl_N.sum() * temperature**2


def make_loss(teacher, options: DistillConfig, d2t_N: torch.Tensor | None = None):
    """loss(model, batch) -> (summed loss, counted positions, metrics): KL on the teacher's fresh logits (+CE).

    d2t_N: the target ids of a reduced draft head's rows (None: the student predicts the whole vocabulary).
    """

    def loss(model, batch):
        ids_BT = batch["input_ids"]
        next_BT = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
        keep_BT = next_BT != -100
        with torch.no_grad():
            teacher_BTV = teacher(input_ids=ids_BT).logits
        student_BTN = model(input_ids=ids_BT).logits
        want = teacher_BTV.shape[-1] if d2t_N is None else len(d2t_N)
        if student_BTN.shape[-1] != want:
            raise CompatibilityError(f"the student predicts {student_BTN.shape[-1]} tokens, the teacher's vocabulary"
                                     f"{' restricted to its draft vocabulary' if d2t_N is not None else ''} has {want}: "
                                     "build the student with the target's vocabulary (model.target)")
        if d2t_N is None:
            teacher_BTN, student_top_BT = teacher_BTV, student_BTN.argmax(-1)
        else:
            d2t = d2t_N.to(teacher_BTV.device)
            teacher_BTN, student_top_BT = teacher_BTV[..., d2t], d2t[student_BTN.argmax(-1)]
        kl_sum = kl_loss(student_BTN, teacher_BTN, keep_BT, options.temperature)
        ce_sum = F.cross_entropy(student_BTN.flatten(0, 1).float(), next_BT.flatten(), ignore_index=-100,
                                 reduction="sum")
        agree = (student_top_BT == teacher_BTV.argmax(-1))[keep_BT].sum()
        total = options.kl_weight * kl_sum + (options.ce_weight * ce_sum if options.ce_weight else 0.0)
        return total, keep_BT.sum(), {"kl": kl_sum.detach(), "ce": ce_sum.detach(), "top1_agree": agree}

    return loss


def load_teacher(recipe: Recipe):
    from draftforge.loading import load_causal_lm

    teacher = load_causal_lm(recipe.model.target, what="target (teacher)")
    return teacher.eval().requires_grad_(False)


def copy_target_embeddings(student, teacher) -> None:
    """Initialise the student's input embeddings from the teacher's (same vocabulary and hidden size)."""
    src, dst = teacher.get_input_embeddings().weight, student.get_input_embeddings().weight
    if src.shape != dst.shape:
        raise CompatibilityError(f"distill.embeddings_from_target: the target's embeddings are {tuple(src.shape)} but "
                                 f"the student's are {tuple(dst.shape)}; give the student the target's hidden size")
    with torch.no_grad():
        dst.copy_(src.to(dst.dtype))


def freeze_except(model, patterns: list[str]) -> None:
    """requires_grad only for parameters whose name contains one of `patterns` (the rest stays as loaded)."""
    names = [n for n, _ in model.named_parameters()]
    if not any(pat in n for n in names for pat in patterns):
        raise RecipeError(f"recipe key 'distill.trainable': no parameter name contains any of {patterns} "
                          f"(names look like {names[:3]})")
    for name, param in model.named_parameters():
        param.requires_grad_(any(pat in name for pat in patterns))


def build_distill_task(recipe: Recipe, accelerator, with_data: bool = True):
    """The student (a pretrain-style drafter), packed text blocks, and the frozen teacher."""
    from draftforge.train.lm import build_lm_task

    spec = build_lm_task(recipe, accelerator, with_data=with_data)
    options = recipe.task_options or DistillConfig()
    if not with_data:  # `draftforge export`: only the student and its export hook are used
        return spec
    teacher = load_teacher(recipe)
    if options.embeddings_from_target and not recipe.model.init_from:
        copy_target_embeddings(spec.model, teacher)
    accelerator.print(f"[draftforge] distill: teacher {type(teacher).__name__} "
                      f"({sum(p.numel() for p in teacher.parameters()):,} params, frozen), τ={options.temperature}, "
                      f"KL×{options.kl_weight} + CE×{options.ce_weight}")
    if options.trainable:
        freeze_except(spec.model, options.trainable)
        n_train = sum(p.numel() for p in spec.model.parameters() if p.requires_grad)
        accelerator.print(f"[draftforge] distill: training {n_train:,} parameters matching {options.trainable}")
    d2t_N = d2t_of(spec.model)
    if d2t_N is not None and int(d2t_N.max()) >= teacher.get_output_embeddings().weight.shape[0]:
        raise CompatibilityError(f"the student's draft vocabulary names target id {int(d2t_N.max())}, beyond the "
                                 f"teacher's {teacher.get_output_embeddings().weight.shape[0]} tokens: "
                                 "it was built for another target")
    spec.loss = make_loss(teacher, options, d2t_N)
    spec.frozen = {**spec.frozen, "teacher": teacher}
    spec.export_metadata["distilled_from"] = recipe.model.target  # the same dict the export hook reads
    return spec
