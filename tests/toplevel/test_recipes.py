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


def test_a_key_given_twice_or_broken_yaml_is_one_line_naming_the_line(tmp_path):
    # PyYAML keeps the last of two equal keys: a second `optim:` block replaced the first whole (lr 1000 trained, exit
    # 0); broken YAML printed PyYAML's several-line report with its caret block
    from draftforge.errors import RecipeError
    from draftforge.recipe import load_recipe

    twice = tmp_path / "twice.yaml"
    twice.write_text("task: pretrain\noptim:\n  lr: 0.001\ndata:\n  sources: [x]\noptim:\n  lr: 1000\n")
    with pytest.raises(RecipeError, match=r"twice.yaml:6 is not valid YAML \(the key 'optim' is given twice"):
        load_recipe(twice)
    nested = tmp_path / "nested.yaml"
    nested.write_text("task: pretrain\noptim:\n  lr: 0.001\n  lr: 0.1\n")
    with pytest.raises(RecipeError, match=r"nested.yaml:4 is not valid YAML \(the key 'lr' is given twice"):
        load_recipe(nested)
    broken = tmp_path / "broken.yaml"
    broken.write_text("task: pretrain\n  bad: [\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(broken)
    assert "\n" not in str(err.value) and "broken.yaml:2 is not valid YAML" in str(err.value)


@pytest.mark.parametrize("override, message", [
    # each passed validation: an infinite clip is no clip under another name, a negative alpha flips the adapters'
    # sign, and an empty key was reported as "unknown recipe key ''"
    ("optim.grad_clip=.inf", "recipe key 'optim.grad_clip': must be >= 0 and finite (0 disables clipping), got inf"),
    ("model.lora.alpha=-3", "recipe key 'model.lora.alpha': must be > 0"),
    ("model.lora.alpha=0", "recipe key 'model.lora.alpha': must be > 0"),
    ("=3", "override '=3' must look like key.path=value (the key path has an empty part)"),
    ("train..max_steps=3", "override 'train..max_steps=3' must look like key.path=value"),
])
def test_values_that_cannot_mean_what_they_say_are_refused(override, message):
    from draftforge.errors import RecipeError

    with pytest.raises(RecipeError) as err:
        load_recipe(RECIPES / "tiny" / "pretrain.yaml", [override])
    assert message in str(err.value)
