"""Old names that keep working for one release after a module or a name moves (layer 0: imports no draftforge).

A moved module leaves a shim at its old path whose whole body is

    from draftforge.deprecation import moved_module
    moved_module(__name__, "draftforge.new.place")

`import old`, `from old import f` and, for a moved package, `import old.sub` then give the new module's own
objects (the same objects, not copies), with one DeprecationWarning per old module name. A renamed function or
class keeps its old name through a module `__getattr__`:

    __getattr__ = renamed(__name__, old_name="new_name")   # or "draftforge.other.module:new_name"
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Callable


def message(old: str, new: str) -> str:
    return f"{old} moved to {new}; the old name goes in the next release"


def _warn(old: str, new: str) -> None:
    """Warn at the frame that imported the old name, past the import machinery and the shims between."""
    frame, level = sys._getframe(1), 2  # stacklevel 2: _warn's caller
    while frame is not None and (_bootstrap(frame) or frame.f_globals.get("__name__") in (__name__, old, "importlib")):
        level += not _bootstrap(frame)  # warnings.warn passes over the import machinery's frames by itself
        frame = frame.f_back
    warnings.warn(message(old, new), DeprecationWarning, stacklevel=level)


def _bootstrap(frame) -> bool:
    name = frame.f_code.co_filename
    return "importlib" in name and "_bootstrap" in name


def moved_module(old_name: str, new_name: str) -> ModuleType:
    """Make the module being imported as `old_name` the module `new_name` (see the module docstring)."""
    module = importlib.import_module(new_name)
    _warn(old_name, new_name)
    sys.modules[old_name] = module  # what the import statement running this shim hands back
    if hasattr(module, "__path__") and not any(isinstance(f, _MovedPackage) and f.old == old_name
                                               for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedPackage(old_name, new_name))
    return module


class _MovedPackage(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`old.sub` (any depth) is the module `new.sub`: found here, before the parent's __path__ (the new package's
    folder) would load a second copy of it under the old name."""

    def __init__(self, old: str, new: str):
        self.old, self.new = old, new
        self.specs = {}  # the new module's own spec, by old name

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(self.old + "."):
            return None
        new_name = self.new + fullname[len(self.old):]
        if importlib.util.find_spec(new_name) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new_name = self.new + spec.name[len(self.old):]
        module = importlib.import_module(new_name)
        self.specs[spec.name] = module.__spec__  # the machinery writes the old name's spec on it; exec_module undoes it
        _warn(spec.name, new_name)
        return module

    def exec_module(self, module):
        module.__spec__ = self.specs.pop(module.__spec__.name)


def moved_modules(table: dict[str, str]) -> None:
    """Old module names (keys) that import as their new modules (values), for a package that moved many files at
    once: call it from the package's __init__ instead of leaving a shim file per module. Same objects, one
    DeprecationWarning per old name, as `moved_module`."""
    if not any(isinstance(f, _MovedModules) and f.table == table for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedModules(dict(table)))


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, table: dict[str, str]):
        self.table, self.specs = table, {}

    def find_spec(self, fullname, path=None, target=None):
        return importlib.util.spec_from_loader(fullname, self) if fullname in self.table else None

    def create_module(self, spec):
        module = importlib.import_module(self.table[spec.name])
        self.specs[spec.name] = module.__spec__
        _warn(spec.name, module.__name__)
        return module

    def exec_module(self, module):
        module.__spec__ = self.specs.pop(module.__spec__.name)


def renamed(module_name: str, **old_to_new: str) -> Callable[[str], object]:
    """A module `__getattr__` that serves each old name as its new object ("name" in the same module, or
    "module:name"), with a DeprecationWarning where the old name is used."""

    def __getattr__(name: str):
        if name not in old_to_new:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        where, _, attr = old_to_new[name].rpartition(":")
        module = importlib.import_module(where or module_name)
        warnings.warn(message(f"{module_name}.{name}", f"{module.__name__}.{attr}"), DeprecationWarning, stacklevel=2)
        return getattr(module, attr)

    return __getattr__
