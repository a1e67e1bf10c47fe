"""In-tree PEP 517 backend: setuptools, plus torch in the build environment when ops are built ahead of time.

A plain `pip install .` needs nothing but setuptools and yields a pure-Python wheel. When the environment
asks for ahead-of-time ops (`DS_BUILD_OPS=1` or any `DS_BUILD_<OP>=1`), the C++ sources must be compiled
against the same torch the package will run with. pip builds in an isolated environment that does not
see the target's torch, so this backend looks up the torch version installed in the target environment
(without importing it) and asks pip for exactly that version; `DS_ENABLE_NINJA=1` also adds ninja.
When the target has no torch, nothing is added and `setup.py` stops with a message that says to install
torch first.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
from pathlib import Path

from setuptools import build_meta as _setuptools_backend
from setuptools.build_meta import *  # noqa: F401,F403  (re-export the full PEP 517 surface)

_BUILD_VAR = re.compile(r"^DS_BUILD_[A-Z0-9_]+$")
_NOT_OP_VARS = {"DS_BUILD_STRING"}
# Set while setuptools runs setup.py only to list build requirements (torch is not installed yet then).
REQUIRES_PHASE_VAR = "SLIPSTREAM_BUILD_LISTING_REQUIRES"


def aot_requested(environ: dict[str, str] | None = None) -> bool:
    """True when DS_BUILD_OPS or any DS_BUILD_<OP> asks for an ahead-of-time op build."""
    env = os.environ if environ is None else environ
    for key, value in env.items():
        if _BUILD_VAR.match(key) and key not in _NOT_OP_VARS and value.strip() not in ("", "0"):
            return True
    # DeepSpeed builds every op by default on Windows.
    return sys.platform == "win32" and "DS_BUILD_OPS" not in env


def target_torch_version() -> str | None:
    """The torch version installed in the environment pip installs into, read from its metadata."""
    candidates = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    for site in candidates:
        for dist_info in sorted(Path(site).glob("torch-*.dist-info")):
            match = re.match(r"torch-([^-]+)\.dist-info$", dist_info.name)
            if match:
                return match.group(1)
    return None


def _extra_requires() -> list[str]:
    if not aot_requested():
        return []
    extra = []
    version = target_torch_version()
    if version is not None:
        extra.append(f"torch=={version}")
    if os.environ.get("DS_ENABLE_NINJA", "").strip() not in ("", "0"):
        extra.append("ninja")
    return extra


def _setuptools_requires(hook_name: str, config_settings: object) -> list[str]:
    """setuptools' own answer; it runs setup.py, which must not check for torch before pip installed it."""
    os.environ[REQUIRES_PHASE_VAR] = "1"
    try:
        return getattr(_setuptools_backend, hook_name)(config_settings)
    finally:
        os.environ.pop(REQUIRES_PHASE_VAR, None)


def get_requires_for_build_wheel(config_settings=None):  # type: ignore[no-untyped-def]
    return _setuptools_requires("get_requires_for_build_wheel", config_settings) + _extra_requires()


def get_requires_for_build_editable(config_settings=None):  # type: ignore[no-untyped-def]
    return _setuptools_requires("get_requires_for_build_editable", config_settings) + _extra_requires()
