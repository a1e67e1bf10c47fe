"""`import slipstream` is silent, cheap and inert: no output, no torch import, no compile, no device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_import_prints_nothing_and_loads_nothing_heavy(tmp_path: Path) -> None:
    code = ("import sys, json, slipstream; "
            "print(json.dumps([slipstream.__version__, 'torch' in sys.modules, "
            "any(m.startswith('slipstream.ops') for m in sys.modules)]))")
    env = {**os.environ, "SLIPSTREAM_OPS_CACHE": str(tmp_path / "cache")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    version, torch_loaded, ops_loaded = json.loads(result.stdout)
    assert version and not torch_loaded and not ops_loaded
    assert not (tmp_path / "cache").exists()  # nothing compiled or probed


def test_lazy_attributes() -> None:
    import slipstream

    assert slipstream.get_accelerator().name == "cpu"
    assert slipstream.ops.__name__ == "slipstream.ops"
    try:
        slipstream.no_such_thing  # noqa: B018
    except AttributeError as exc:
        assert "no_such_thing" in str(exc)
    else:
        raise AssertionError("unknown attribute did not raise")
