"""draftforge/deprecation.py on throwaway modules in tmp_path: a moved module's old name gives the new module's
own objects (its submodules too, for a package) with one DeprecationWarning at the importing line; a renamed
name is served through a module __getattr__."""

from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path

import pytest

from draftforge.deprecation import moved_module, renamed

SHIM = "from draftforge.deprecation import moved_module\nmoved_module(__name__, {new!r})\n"


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """Write {relative path: text} under tmp_path (on sys.path); the modules and finders made are removed after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    modules, finders = set(sys.modules), list(sys.meta_path)

    def write(files: dict[str, str]) -> None:
        for rel, text in files.items():
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / rel).write_text(text)
        importlib.invalidate_caches()

    yield write
    sys.meta_path[:] = finders
    for name in set(sys.modules) - modules:
        del sys.modules[name]


def test_a_moved_module_is_the_new_module_with_one_warning_at_the_import(tree):
    tree({"dep_new_mod.py": "def f():\n    return 1\n\n\nclass C:\n    pass\n",
          "dep_old_mod.py": SHIM.format(new="dep_new_mod")})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import dep_old_mod
    assert [str(w.message) for w in caught] == ["dep_old_mod moved to dep_new_mod; the old name goes in the next release"]
    assert caught[0].category is DeprecationWarning and caught[0].filename == __file__  # this file's import line
    import dep_new_mod

    assert dep_old_mod is dep_new_mod
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # imported once: no second warning
        from dep_old_mod import C, f
    assert (f, C) == (dep_new_mod.f, dep_new_mod.C) and f() == 1


def test_a_moved_packages_submodules_are_the_new_ones(tree):
    tree({"dep_new_pkg/__init__.py": "TOP = 1\n", "dep_new_pkg/sub.py": "X = object()\n",
          "dep_new_pkg/inner/__init__.py": "", "dep_new_pkg/inner/deep.py": "def g():\n    return 2\n",
          "dep_old_pkg/__init__.py": SHIM.format(new="dep_new_pkg")})
    with pytest.warns(DeprecationWarning) as caught:
        import dep_old_pkg.sub
        from dep_old_pkg.inner.deep import g
    assert [str(w.message).split(";")[0] for w in caught] == [
        "dep_old_pkg moved to dep_new_pkg", "dep_old_pkg.sub moved to dep_new_pkg.sub",
        "dep_old_pkg.inner moved to dep_new_pkg.inner", "dep_old_pkg.inner.deep moved to dep_new_pkg.inner.deep"]
    import dep_new_pkg.inner.deep
    import dep_new_pkg.sub

    assert dep_old_pkg is dep_new_pkg and dep_old_pkg.TOP == 1
    assert sys.modules["dep_old_pkg.sub"] is dep_new_pkg.sub and dep_old_pkg.sub.X is dep_new_pkg.sub.X  # one copy
    assert g is dep_new_pkg.inner.deep.g and dep_new_pkg.sub.__spec__.name == "dep_new_pkg.sub"
    with pytest.raises(ModuleNotFoundError, match="dep_old_pkg.nothing"):
        import dep_old_pkg.nothing  # noqa: F401


def test_a_renamed_name_is_the_new_object_with_a_warning(tree):
    tree({"dep_other.py": "def h():\n    return 3\n",
          "dep_renames.py": "from draftforge.deprecation import renamed\n\n\ndef f():\n    return 1\n\n\n"
                            "__getattr__ = renamed(__name__, old_f='f', old_h='dep_other:h')\n"})
    import dep_other
    import dep_renames

    with pytest.warns(DeprecationWarning, match="dep_renames.old_f moved to dep_renames.f; the old name goes"):
        from dep_renames import old_f
    with pytest.warns(DeprecationWarning, match="dep_renames.old_h moved to dep_other.h"):
        assert dep_renames.old_h is dep_other.h
    assert old_f is dep_renames.f
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        dep_renames.nothing  # noqa: B018


def test_moved_module_returns_the_new_module_and_layer_0_imports_nothing_of_draftforge():
    import ast
    from pathlib import Path

    import draftforge.deprecation as dep

    tree = ast.parse(Path(dep.__file__).read_text())
    names = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level]
    names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in names if m.split(".")[0] == "draftforge"]
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]  # nor relative ones
    with pytest.warns(DeprecationWarning, match="dep_alias_json moved to json"):
        assert moved_module("dep_alias_json", "json") is sys.modules["dep_alias_json"] is importlib.import_module("json")
    del sys.modules["dep_alias_json"]


def test_every_moved_module_of_the_package_imports_as_its_new_home_with_a_warning():
    import importlib
    import sys
    import warnings

    import draftforge.decode  # noqa: F401  (each package installs its table when imported)
    import draftforge.models  # noqa: F401
    import draftforge.train  # noqa: F401
    from draftforge.deprecation import _MovedModules

    tables = {old: new for f in sys.meta_path if isinstance(f, _MovedModules) for old, new in f.table.items()}
    assert len(tables) >= 18
    for old, new in tables.items():
        sys.modules.pop(old, None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = importlib.import_module(old)
        assert module is importlib.import_module(new), old
        assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message) for w in caught), old
        stale = Path(draftforge.decode.__file__).parents[1].joinpath(*old.split(".")[1:]).with_suffix(".py")
        assert not stale.exists(), f"{stale} would shadow the moved module"
