"""The opt-in `deepspeed` compatibility distribution: DeepSpeed's import name, scripts and metadata, on Slipstream.

`slipstream compat install` writes a small wheel named `deepspeed` (version `DISTRIBUTION_VERSION`, e.g.
`0.19.8+slipstream.0.1.0`) and installs it with this interpreter's pip, offline (`--no-deps --no-index`). It
holds one file, `deepspeed/__init__.py`, which calls `activate()`; its entry points are DeepSpeed's script
names (compat/scripts.py). After it, `import deepspeed` works with DeepSpeed's module paths
(`deepspeed.runtime.zero.partition_parameters` is `slipstream.zero.init`, through compat/aliases.py),
`importlib.metadata.version("deepspeed")` reports the DeepSpeed API level we implement, and
`deepspeed --num_gpus 2 train.py` launches. `slipstream compat uninstall` (or `pip uninstall deepspeed`)
removes it.

It never shadows a real DeepSpeed silently: install refuses when a `deepspeed` distribution that is not ours
is installed (naming its version and place); pip replaces ours when a real DeepSpeed is installed over it
(same distribution name: pip uninstalls ours first and says so); and `activate()` warns when more than one
`deepspeed` distribution is visible. `slipstream report` shows which one `import deepspeed` gives.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Any

from slipstream.compat.scripts import SCRIPTS
from slipstream.git_version_info import version as slipstream_version

__all__ = ["DEEPSPEED_API_VERSION", "DISTRIBUTION_VERSION", "activate", "build_wheel", "install", "status"]

DEEPSPEED_API_VERSION = "0.19.8"
"""The DeepSpeed release whose public API this package follows (what version checks of client code see)."""
MARKER = "slipstream"
DISTRIBUTION_VERSION = f"{DEEPSPEED_API_VERSION}+{MARKER}.{slipstream_version.split('+')[0]}"
EXTRA_SCRIPTS = {"deepspeed.pt": "deepspeed", "ds": "deepspeed", "dsr": "ds_report"}
"""DeepSpeed's other script names -> the script whose job they do."""

_INIT = '''"""DeepSpeed's import name, provided by Slipstream (`slipstream compat install`; docs/deepspeed-compat.md)."""

from slipstream.compat.deepspeed_dist import activate as _activate

_activate(globals())
'''


def _version_tuple(text: str) -> tuple[int, int, int]:
    parts = [int("".join(c for c in p if c.isdigit()) or 0) for p in text.split("+")[0].split(".")[:3]]
    return (parts + [0, 0, 0])[0], (parts + [0, 0, 0])[1], (parts + [0, 0, 0])[2]


def activate(namespace: dict[str, Any]) -> None:
    """Make the module whose globals are `namespace` DeepSpeed's `deepspeed` package on top of Slipstream."""
    import slipstream
    from slipstream.compat import aliases

    aliases.add_prefix(namespace["__name__"], "slipstream")
    major, minor, patch = _version_tuple(DEEPSPEED_API_VERSION)
    namespace.update(
        __version__=DISTRIBUTION_VERSION,
        __version_major__=major,
        __version_minor__=minor,
        __version_patch__=patch,
        __slipstream__=True,
        __getattr__=lambda name: getattr(slipstream, name),
        __dir__=lambda: sorted(set(dir(slipstream)) | set(namespace)),
    )
    _warn_if_shadowed()


def _deepspeed_distributions() -> list[Any]:
    import importlib.metadata

    seen: dict[str, Any] = {}
    for dist in importlib.metadata.distributions(name="deepspeed"):
        seen.setdefault(str(getattr(dist, "_path", id(dist))), dist)
    return list(seen.values())


def _is_ours(dist: Any) -> bool:
    return f"+{MARKER}" in str(dist.version)


def _warn_if_shadowed() -> None:
    others = [d for d in _deepspeed_distributions() if not _is_ours(d)]
    if others:
        where = ", ".join(f"deepspeed {d.version} at {d.locate_file('')}" for d in others)
        warnings.warn(
            f"both Slipstream's deepspeed compatibility package and a real DeepSpeed ({where}) are installed; "
            "`import deepspeed` gives Slipstream's. Remove one: `slipstream compat uninstall` or "
            "`pip uninstall deepspeed`",
            stacklevel=3,
        )


def status() -> dict[str, Any]:
    """What `import deepspeed` gives here, without importing it: ours, a real DeepSpeed, or nothing."""
    dists = _deepspeed_distributions()
    spec = (
        importlib.util.find_spec("deepspeed") if "deepspeed" not in sys.modules else sys.modules["deepspeed"].__spec__
    )
    origin = None if spec is None else spec.origin
    ours = (
        origin is not None and Path(origin).is_file() and "deepspeed_dist import activate" in Path(origin).read_text()
    )
    if spec is None:
        state = "not installed (`slipstream compat install` provides `import deepspeed`)"
    elif ours:
        state = f"active: `import deepspeed` is Slipstream ({DISTRIBUTION_VERSION})"
    else:
        state = "a real DeepSpeed is installed: `import deepspeed` is not Slipstream"
    return {
        "state": state,
        "active": bool(ours),
        "origin": origin,
        "distributions": [f"deepspeed {d.version} ({d.locate_file('')})" for d in dists],
    }


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_wheel(directory: str | os.PathLike[str]) -> Path:
    """Write the compatibility wheel into `directory` (no build tools needed) and return its path."""
    info = f"deepspeed-{DISTRIBUTION_VERSION}.dist-info"
    scripts = {name: f"slipstream.compat.scripts:{name}" for name in SCRIPTS}
    scripts.update({alias: f"slipstream.compat.scripts:{target}" for alias, target in EXTRA_SCRIPTS.items()})
    files = {
        "deepspeed/__init__.py": _INIT,
        f"{info}/METADATA": (
            "Metadata-Version: 2.1\nName: deepspeed\n"
            f"Version: {DISTRIBUTION_VERSION}\n"
            "Summary: DeepSpeed's import name, scripts and metadata, provided by Slipstream (not DeepSpeed)\n"
            f"Requires-Dist: slipstream\n"
        ),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: slipstream\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/entry_points.txt": "[console_scripts]\n" + "".join(f"{k} = {v}\n" for k, v in sorted(scripts.items())),
        f"{info}/top_level.txt": "deepspeed\n",
    }
    path = Path(directory) / f"deepspeed-{DISTRIBUTION_VERSION}-py3-none-any.whl"
    records = []
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, text in files.items():
            data = text.encode()
            wheel.writestr(name, data)
            records.append(_record_line(name, data))
        records.append(f"{info}/RECORD,,")
        wheel.writestr(f"{info}/RECORD", "\n".join(records) + "\n")
    return path


def install(python: str | None = None, *, pip_args: tuple[str, ...] = ()) -> int:
    """Install the compatibility wheel into `python`'s environment (default: this one). Refuses, naming it,
    when a real DeepSpeed is installed there."""
    python = python or sys.executable
    probe = (
        "import importlib.metadata as m, json; "
        "print(json.dumps([[d.version, str(d.locate_file(''))] for d in m.distributions(name='deepspeed')]))"
    )
    import json

    if subprocess.run([python, "-c", "import slipstream.compat.deepspeed_dist"], capture_output=True).returncode:
        print(
            f"slipstream compat install: error: {python} cannot import slipstream; install Slipstream into that "
            "environment first (the compatibility package maps `deepspeed` onto it)",
            file=sys.stderr,
        )
        return 1
    found = json.loads(subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True).stdout)
    real = [(v, where) for v, where in found if f"+{MARKER}" not in v]
    if real:
        version, where = real[0]
        print(
            f"slipstream compat install: error: DeepSpeed {version} is installed at {where}; installing the "
            "compatibility package would replace it. Use another virtual environment, or `pip uninstall deepspeed` "
            "first if you mean to switch",
            file=sys.stderr,
        )
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        wheel = build_wheel(tmp)
        argv = [python, "-m", "pip", "install", "--no-deps", "--no-index", "--force-reinstall", *pip_args, str(wheel)]
        result = subprocess.run(argv)
    if result.returncode == 0:
        print(f"installed deepspeed {DISTRIBUTION_VERSION} (Slipstream's compatibility package) for {python}")
    return result.returncode


def uninstall(python: str | None = None) -> int:
    python = python or sys.executable
    import json

    probe = "import importlib.metadata as m, json; print(json.dumps([d.version for d in m.distributions(name='deepspeed')]))"
    versions = json.loads(subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True).stdout)
    if any(f"+{MARKER}" not in v for v in versions):
        print(
            f"slipstream compat uninstall: error: the installed deepspeed {versions} is not Slipstream's; "
            "use `pip uninstall deepspeed` if you mean it",
            file=sys.stderr,
        )
        return 1
    if not versions:
        print("slipstream compat uninstall: the compatibility package is not installed")
        return 0
    return subprocess.run([python, "-m", "pip", "uninstall", "--yes", "deepspeed"]).returncode
