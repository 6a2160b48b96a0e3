"""Tests of draftforge/train: the loop, tasks, distillation, EESD, C2T, θ, multi-process runs."""
