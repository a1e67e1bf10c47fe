"""Small shared utilities (logging, the torch shim).

`slipstream.utils` is also DeepSpeed's `deepspeed.utils` path: names such as `logger`, `RepeatingLoader` and
`safe_get_full_fp32_param` are declared in compat/aliases.py (COMPOSITES) and load on first access; this
package imports none of them.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    import importlib

    return importlib.import_module("slipstream.compat.aliases").composite_attribute(__name__, name)
