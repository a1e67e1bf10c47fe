"""DeepSpeed's module paths that client code imports, mapped to where the code lives here.

Each alias is a name under `slipstream` with no file of its own; an import of it (or `python -m` on it) loads
the target module's source under the alias name. The table is the one place such paths are declared, so the
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
}
"""DeepSpeed-style path -> the module whose source it runs."""


class _AliasFinder:
    """A meta path finder for the names of `ALIASES` (after the regular finders, which know no such file).
    importlib is imported on the first alias lookup, so `import slipstream` stays cheap."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> Any:
        target_name = ALIASES.get(fullname)
        if target_name is None:
            return None
        import importlib.util

        found = importlib.util.find_spec(target_name)
        if found is None or found.origin is None:
            return None
        return importlib.util.spec_from_file_location(fullname, found.origin)


def install() -> None:
    """Register the alias finder once per interpreter (called by `import slipstream`)."""
    if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
        sys.meta_path.append(_AliasFinder())
