"""DeepSpeed's module paths that client code imports, mapped to where the code lives here.

Two tables, declared in compat/alias_table.py (the one place such paths are written down), so the package's
own layers keep their layout (a compat tool never has to live in utils/ for its DeepSpeed path):

- `ALIASES`: a path with no file of its own whose module is one of ours. Importing it gives the target
  module itself (one object: its classes and state are shared, and a library that swaps one of its
  attributes swaps it for our code too), and `python -m <alias>` runs the target's code. Names below an
  alias resolve below its target (`slipstream.runtime.zero.stage3` is `slipstream.zero.stage3`).
- `COMPOSITES`: a DeepSpeed module whose names live in several of ours (`deepspeed.runtime.utils` has a data
  loader, a seeding helper and a memory report). Each name is `"module:attribute"`, loaded on first access.
  A path that is not a module of ours becomes a small module object holding just those names; a package
  of ours that is also a DeepSpeed path (`slipstream.utils`, `slipstream.ops`) answers them from its
  `__getattr__` through `composite_attribute`.

`add_prefix` maps a whole import name onto ours: the opt-in `deepspeed` distribution (compat/deepspeed_dist.py)
registers `deepspeed` -> `slipstream`, so `import deepspeed.runtime.zero.partition_parameters` works.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

from slipstream.compat.alias_table import ALIASES, COMPOSITES

__all__ = ["ALIASES", "COMPOSITES", "add_prefix", "composite_attribute", "composite_names", "install"]

_PREFIXES: dict[str, str] = {}
"""Import names mapped onto ours (`deepspeed` -> `slipstream`), registered by `add_prefix`."""


def _load(where: str) -> Any:
    import importlib

    module_name, _, attribute = where.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attribute) if attribute else module


def composite_attribute(module_name: str, name: str) -> Any:
    """The DeepSpeed name `name` of module `module_name` (COMPOSITES), or AttributeError."""
    names = COMPOSITES.get(module_name, {})
    if name in names and name != "*":
        return _load(names[name])
    for source in names.get("*", "").split():
        module = _load(source)
        if not name.startswith("_") and hasattr(module, name):
            return getattr(module, name)
    child = declared_child(module_name, name)
    if child is not None:  # DeepSpeed imports its subpackages eagerly: `deepspeed.runtime.lr_schedules` works
        return child
    raise AttributeError(f"module {module_name!r} has no attribute {name!r}")


def declared_child(module_name: str, name: str) -> Any:
    """The declared DeepSpeed path `module_name.name` (an alias or a composite) as a module, or None."""
    fullname = f"{module_name}.{name}"
    if fullname not in ALIASES and fullname not in COMPOSITES:
        return None
    import importlib

    return importlib.import_module(fullname)


def composite_names(module_name: str) -> list[str]:
    """Every DeepSpeed name of `module_name` (for `dir()` and `__all__`)."""
    names = COMPOSITES.get(module_name, {})
    found = {name for name in names if name != "*" and not name.startswith("__")}
    for source in names.get("*", "").split():
        module = _load(source)
        found |= set(getattr(module, "__all__", [n for n in vars(module) if not n.startswith("_")]))
    return sorted(found)


def _target(fullname: str) -> str | None:
    """Our module for `fullname` by the longest aliased (or prefixed) ancestor, or None."""
    if fullname in ALIASES:
        return ALIASES[fullname]
    parts = fullname.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        head, tail = ".".join(parts[:cut]), ".".join(parts[cut:])
        if head in ALIASES:
            return f"{ALIASES[head]}.{tail}"
        if head in _PREFIXES:
            return f"{_PREFIXES[head]}.{tail}"
    return None


class _AliasLoader:
    """Loads an alias as the target module itself (one module object, so classes and state are shared), and
    gives `python -m <alias>` the target's code to run as __main__."""

    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: Any) -> Any:
        import importlib

        module = importlib.import_module(self.target)
        self._target_spec = module.__spec__
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = self._target_spec  # the import system stamped the alias spec on the shared module

    def get_code(self, fullname: str) -> Any:
        import importlib.util

        spec = importlib.util.find_spec(self.target)
        get_code = getattr(None if spec is None else spec.loader, "get_code", None)
        return None if get_code is None else get_code(self.target)


class _CallableModule(types.ModuleType):
    """A composite that declares `__call__`: DeepSpeed has a function and a module of one name in one package
    (`deepspeed.utils.z3_leaf_module`), and importing the module sets it on the package over the function."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return composite_attribute(self.__name__, "__call__")(*args, **kwargs)


class _CompositeLoader:
    """Makes a small package holding one COMPOSITES entry's names, each loaded on first access."""

    def create_module(self, spec: Any) -> Any:
        name = spec.name
        kind = _CallableModule if "__call__" in COMPOSITES[name] else types.ModuleType
        module = kind(name, f"DeepSpeed's `{name}` names (declared in slipstream/compat/alias_table.py).")
        module.__path__ = []  # a package: DeepSpeed paths below it may be composites too
        module.__getattr__ = lambda attribute: composite_attribute(name, attribute)  # type: ignore[method-assign]
        module.__dir__ = lambda: composite_names(name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: Any) -> None:
        return None


def _declared_below_target(fullname: str) -> str | None:
    """The declared DeepSpeed path that `fullname` spells through an alias's target, or None.

    `from slipstream.runtime.zero import config` looks up `config` below the module's own name,
    `slipstream.zero`; that name stands for the declared `slipstream.runtime.zero.config`."""
    for alias, target in ALIASES.items():
        if fullname.startswith(target + "."):
            candidate = alias + fullname[len(target) :]
            if candidate in ALIASES or candidate in COMPOSITES:
                return candidate
    return None


def _is_ours(fullname: str) -> bool:
    """True when `fullname` is a file of the package under its own name (the regular finders load it)."""
    import importlib.machinery

    parent = sys.modules.get(fullname.rpartition(".")[0])
    if parent is None or parent.__name__ != fullname.rpartition(".")[0]:
        return False
    search = getattr(parent, "__path__", None)
    return bool(search) and importlib.machinery.PathFinder.find_spec(fullname, search) is not None


class _AliasFinder:
    """A meta path finder for the names of `ALIASES`, `COMPOSITES` and registered prefixes. It runs first, so a
    name below an alias never loads a second copy of one of our files; any other name costs a few dict
    lookups. importlib.util is imported on the first alias lookup (`import slipstream` stays cheap)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        if not fullname.startswith(("slipstream.", *(prefix + "." for prefix in _PREFIXES))):
            return None
        import importlib.util

        if fullname in COMPOSITES:
            if _is_ours(fullname):
                return _ours_answering_composites(fullname)
            composite: Any = _CompositeLoader()
            return importlib.util.spec_from_loader(fullname, composite, is_package=True)
        target_name = _target(fullname)
        if target_name is None and not _is_ours(fullname):
            target_name = _declared_below_target(fullname)
        if target_name is None:
            return None
        if target_name not in COMPOSITES and importlib.util.find_spec(target_name) is None:
            return None
        loader: Any = _AliasLoader(target_name)
        return importlib.util.spec_from_loader(fullname, loader)


def _answer_composites(module: Any) -> None:
    """Give a module of ours that is also a DeepSpeed path its declared names, unless it answers them itself
    (a package such as `slipstream.utils` has its own `__getattr__`)."""
    if "__getattr__" not in vars(module):
        name = module.__name__
        module.__getattr__ = lambda attribute: composite_attribute(name, attribute)


class _OursLoader:
    """Runs the regular loader of a module of ours, then `_answer_composites` on it."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        _answer_composites(module)


def _ours_answering_composites(fullname: str) -> Any:
    import importlib.machinery

    parent = sys.modules[fullname.rpartition(".")[0]]
    spec = importlib.machinery.PathFinder.find_spec(fullname, parent.__path__)
    if spec is not None and spec.loader is not None:
        spec.loader = _OursLoader(spec.loader)  # type: ignore[assignment]  # a loader by protocol
    return spec


def add_prefix(prefix: str, target: str) -> None:
    """Map every module below `prefix` to the same path below `target` (`deepspeed.zero` -> `slipstream.zero`)."""
    _PREFIXES[prefix] = target


def install() -> None:
    """Register the alias finder once per interpreter, ahead of the regular finders (`import slipstream`)."""
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())
    for name in COMPOSITES:  # modules of ours imported before the finder was installed
        if name in sys.modules and sys.modules[name].__name__ == name:
            _answer_composites(sys.modules[name])
