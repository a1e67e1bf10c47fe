"""DeepSpeed's console-script names, each mapped to the `slipstream` subcommand that does its job.

Slipstream's own distribution installs only `slipstream`, so it never shadows a DeepSpeed install. The opt-in
DeepSpeed compatibility distribution lists these functions as its entry points (`deepspeed = ...:deepspeed`,
`ds_report = ...:ds_report`, ...). Each one runs `slipstream <subcommand> <the same arguments>`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["SCRIPTS", "deepspeed", "ds_bench", "ds_elastic", "ds_io", "ds_nvme_tune", "ds_report", "ds_ssh"]

SCRIPTS: dict[str, tuple[str, ...]] = {
    "deepspeed": ("run",),
    "ds_report": ("report",),
    "ds_ssh": ("ssh",),
    "ds_elastic": ("elastic",),
    "ds_bench": ("bench", "comm"),
    "ds_io": ("io",),
    "ds_nvme_tune": ("nvme", "tune"),
}
"""DeepSpeed script name -> the slipstream subcommand words it stands for."""


def _script(name: str) -> Callable[[], int]:
    def entry() -> int:
        from slipstream.cli.main import main

        args = sys.argv[1:]
        if name == "ds_ssh" and args[:1] != ["--"] and not any(a.startswith("-") for a in args[:1]):
            args = ["--", *args]  # `ds_ssh hostname`: DeepSpeed takes the command without a separator
        return main([*SCRIPTS[name], *args])

    entry.__name__ = name
    entry.__doc__ = f"DeepSpeed's `{name}`: `slipstream {' '.join(SCRIPTS[name])}` with the same arguments."
    return entry


deepspeed = _script("deepspeed")
ds_report = _script("ds_report")
ds_ssh = _script("ds_ssh")
ds_elastic = _script("ds_elastic")
ds_bench = _script("ds_bench")
ds_io = _script("ds_io")
ds_nvme_tune = _script("ds_nvme_tune")
