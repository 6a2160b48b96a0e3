"""Every shipped recipe validates, and the tiny ones are exactly what `draftforge demo` runs."""

from __future__ import annotations


import pytest
import yaml

from draftforge import demo
from draftforge.recipe import load_recipe
from tests import REPO

RECIPES = REPO / "recipes"


@pytest.mark.parametrize("path", sorted(RECIPES.rglob("*.yaml")), ids=lambda p: str(p.relative_to(RECIPES)))
def test_shipped_recipe_validates(path):
    load_recipe(path)


def test_the_demo_runs_the_shipped_tiny_recipes():
    assert demo.RECIPES == RECIPES / "tiny"
    for name in ("target", "pretrain", "sft"):
        assert demo.tiny_recipe(name) == yaml.safe_load((RECIPES / "tiny" / f"{name}.yaml").read_text())


@pytest.mark.parametrize("name", ["target", "pretrain", "sft"])
def test_demo_reroots_only_the_testbed_and_output_paths(name):
    """With another testbed and output dir, every path moves there and every other value is the YAML's."""
    shipped = yaml.safe_load((RECIPES / "tiny" / f"{name}.yaml").read_text())
    moved = demo.tiny_recipe(name, "/tb", "/out")

    def walk(a, b):
        if isinstance(a, dict):
            assert a.keys() == b.keys()
            for k in a:
                walk(a[k], b[k])
        elif isinstance(a, list):
            assert len(a) == len(b)
            for x, y in zip(a, b):
                walk(x, y)
        elif isinstance(a, str) and a.startswith(demo.TESTBED):
            assert b == "/tb" + a[len(demo.TESTBED):]
        elif isinstance(a, str) and a.startswith(demo.OUT):
            assert b == "/out" + a[len(demo.OUT):]
        else:
            assert a == b

    walk(shipped, moved)
    assert moved != shipped  # each tiny recipe has at least one path to move


def test_overrides_and_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    r = load_recipe(RECIPES / "tiny" / "pretrain.yaml", ["optim.lr=1e-4", "train.max_steps=7"])
    assert r.optim.lr == 1e-4 and r.train.max_steps == 7
    assert r.model.target == "runs/demo/testbed/target"  # the demo's link to the testbed it used
    assert load_recipe(RECIPES / "tiny" / "pretrain.yaml", ["model.target=~/t"]).model.target == f"{tmp_path}/t"
