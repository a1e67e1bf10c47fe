"""Windows, as far as it can be checked on Linux (docs/support.md): the public modules import without the
POSIX-only standard modules, so nothing POSIX-only (or native: ops build only on use) runs at import time."""

from __future__ import annotations

import subprocess
import sys

POSIX_ONLY = ("fcntl", "resource", "pwd", "grp", "termios", "pty", "tty")
MODULES = (
    "slipstream",
    "slipstream.api",
    "slipstream.engine.engine",
    "slipstream.zero.init",
    "slipstream.checkpoint",
    "slipstream.config",
    "slipstream.accelerator",
    "slipstream.ops.adam",
    "slipstream.comm",
    "slipstream.planner",
    "slipstream.cli.main",
    "slipstream.launcher.runner",
)

PROBE = f"""
import importlib, sys
for name in {POSIX_ONLY!r}:
    sys.modules[name] = None  # `import name` now raises, as on Windows
failed = []
for module in {MODULES!r}:
    try:
        importlib.import_module(module)
    except ImportError as exc:
        failed.append(f"{{module}}: {{exc}}")
print("\\n".join(failed))
"""


def test_public_modules_import_without_posix_only_modules() -> None:
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "", f"imports that would fail on Windows:\n{result.stdout}"


def test_the_probe_sees_a_posix_only_import() -> None:
    probe = PROBE.replace(repr(MODULES), repr(("fcntl",)))
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert "fcntl" in result.stdout
