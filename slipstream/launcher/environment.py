"""The environment a multi-node launch exports to the other nodes: an explicit, printed allow-list.

Owns which variables travel. A variable is exported when

- its name starts with one of `EXPORT_PREFIXES` (`NCCL_`, `PYTHON`, `SLIPSTREAM_`, `DS_`) and it is set
  in the launcher's environment, or
- it is listed in an env file. As in DeepSpeed, the files are `~/.deepspeed_env` and then
  `./.deepspeed_env` (the one in the current directory wins), and `DS_ENV_FILE` (or
  `SLIPSTREAM_ENV_FILE`) changes the file name. A `KEY=VALUE` line exports that value (DeepSpeed's
  format); a bare `KEY` line exports the launcher's current value of `KEY` (a Slipstream addition,
  for secrets you would rather not write into a file). `#` comments and blank lines are ignored.

Nothing else is sent: not `PATH`, `HOME` or `LD_LIBRARY_PATH` (the remote login shell provides its own),
and not credentials that happen to sit in the launcher's environment. `describe_exports` prints the
names (never the values) at start. Values are never put into a shell string: see multinode.py for
how each launcher carries them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

EXPORT_PREFIXES: tuple[str, ...] = ("NCCL_", "PYTHON", "SLIPSTREAM_", "DS_")
"""Name prefixes forwarded from the launcher's environment to every node."""

DEFAULT_ENV_FILE_NAME = ".deepspeed_env"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class EnvFileError(ValueError):
    """A line of a `.deepspeed_env`-style file that is not `KEY=VALUE` or `KEY`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Export:
    """One exported variable and where its value came from (for the start-up listing)."""

    name: str
    value: str
    source: str


def env_file_paths(environ: Mapping[str, str], *, cwd: Path, home: Path) -> list[Path]:
    """The env files to read, lowest priority first: the home one, then the one in `cwd`."""
    name = environ.get("SLIPSTREAM_ENV_FILE") or environ.get("DS_ENV_FILE") or DEFAULT_ENV_FILE_NAME
    paths = [home / name, cwd / name]
    unique: list[Path] = []
    for path in paths:
        if path.is_file() and all(path.resolve() != seen.resolve() for seen in unique):
            unique.append(path)
    return unique


def read_env_file(path: Path, environ: Mapping[str, str]) -> list[Export]:
    """Parse one env file; errors name the file, the line number and the bad text."""
    exports: list[Export] = []
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        name = name.strip()
        if not _NAME.match(name):
            raise EnvFileError(
                f"{path}, line {number}: {raw.strip()!r} is not `KEY=VALUE` or `KEY`; variable names are "
                f"letters, digits and underscores, not starting with a digit"
            )
        if sep:
            exports.append(Export(name=name, value=value, source=str(path)))
        elif name in environ:
            exports.append(Export(name=name, value=environ[name], source=f"{path} (value from environment)"))
    return exports


def collect_exports(environ: Mapping[str, str], *, cwd: Path | None = None, home: Path | None = None) -> list[Export]:
    """Every variable to export, sorted by name; env-file entries override prefix matches."""
    by_name: dict[str, Export] = {
        name: Export(name=name, value=value, source="environment")
        for name, value in environ.items()
        if name.startswith(EXPORT_PREFIXES)
    }
    cwd = Path.cwd() if cwd is None else cwd
    home = Path.home() if home is None else home
    for path in env_file_paths(environ, cwd=cwd, home=home):
        for export in read_env_file(path, environ):
            by_name[export.name] = export
    return [by_name[name] for name in sorted(by_name)]


def as_mapping(exports: list[Export]) -> dict[str, str]:
    """name -> value, for an environment dict or `env K=V` argv items."""
    return {export.name: export.value for export in exports}


def describe_exports(exports: list[Export]) -> str:
    """The start-up listing: names and sources, never values (they may be secrets)."""
    if not exports:
        return (
            "slipstream: exporting no environment variables to the nodes (allow-list: "
            + ", ".join(f"{prefix}*" for prefix in EXPORT_PREFIXES)
            + f", and names in {DEFAULT_ENV_FILE_NAME})"
        )
    lines = [f"slipstream: exporting {len(exports)} environment variable(s) to the nodes (values not shown):"]
    lines += [f"  {export.name}  ({export.source})" for export in exports]
    return "\n".join(lines)


def current_environ() -> dict[str, str]:
    """A copy of this process's environment (one place to read it, so tests can pass their own)."""
    return dict(os.environ)
