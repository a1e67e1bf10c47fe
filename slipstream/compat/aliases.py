"""DeepSpeed's module paths that client code imports, mapped to where the code lives here.

Each alias is a name under `slipstream` with no file of its own; importing it gives the target module itself
(one object: its classes and state are shared), and `python -m <alias>` runs the target's code. The table is the one place such paths are declared, so the
package's own layers keep their layout (a compat tool never has to live in utils/ for its DeepSpeed path).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Sequence

__all__ = ["ALIASES", "install"]

ALIASES: dict[str, str] = {
    "slipstream.utils.zero_to_fp32": "slipstream.compat.zero_to_fp32",
    "slipstream.moe.sharded_moe": "slipstream.moe.layer",  # TopKGate, MOELayer
}
"""DeepSpeed-style path -> the module whose source it runs."""


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
        loader: Any = None if spec is None else spec.loader
        return None if loader is None else loader.get_code(self.target)


class _AliasFinder:
    """A meta path finder for the names of `ALIASES` (after the regular finders, which know no such file).
    importlib is imported on the first alias lookup, so `import slipstream` stays cheap."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        target_name = ALIASES.get(fullname)
        if target_name is None:
            return None
        import importlib.util

        if importlib.util.find_spec(target_name) is None:
            return None
        loader: Any = _AliasLoader(target_name)
        return importlib.util.spec_from_loader(fullname, loader)


def install() -> None:
    """Register the alias finder once per interpreter (called by `import slipstream`)."""
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.append(_AliasFinder())
