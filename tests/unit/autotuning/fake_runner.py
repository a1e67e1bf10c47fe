"""A stand-in for `python -m slipstream.launcher.runner` in the tuner's tests: one rank, no torch.distributed.
`fake_runner.py --module NAME ARGS` runs `python -m NAME ARGS` (the tuner's session), `fake_runner.py SCRIPT ARGS`
runs the script (one launch per run)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    args = sys.argv[1:]
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[3]), os.environ.get("PYTHONPATH", "")]
    )
    python = [sys.executable, "-m", *args[1:]] if args[:1] == ["--module"] else [sys.executable, *args]
    os.execv(sys.executable, python)
