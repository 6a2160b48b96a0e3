"""Every shipped recipe validates, and the tiny ones are exactly what `draftforge demo` runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from draftforge import demo
from draftforge.recipe import load_recipe

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


@pytest.mark.parametrize("path", sorted(RECIPES.rglob("*.yaml")), ids=lambda p: str(p.relative_to(RECIPES)))
def test_shipped_recipe_validates(path):
    load_recipe(path)


@pytest.mark.parametrize("name,fn", [("target", demo.target_recipe), ("pretrain", demo.drafter_pretrain_recipe),
                                     ("sft", demo.drafter_sft_recipe)])
def test_tiny_recipes_match_the_demo(name, fn):
    assert yaml.safe_load((RECIPES / "tiny" / f"{name}.yaml").read_text()) == fn()


def test_overrides_and_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    r = load_recipe(RECIPES / "tiny" / "pretrain.yaml", ["optim.lr=1e-4", "train.max_steps=7"])
    assert r.optim.lr == 1e-4 and r.train.max_steps == 7
    assert r.model.target == f"{tmp_path}/.cache/draftforge/testbed/target"  # ~ expanded
