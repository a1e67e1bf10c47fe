"""The rank side of a tuning session: `python -m slipstream.autotuning.session SCRIPT ARGS` under the launcher
runs the training script once per order, in the same processes and process group (no relaunch per trial).

The tuner (launches.py) writes orders into the folder named by `SESSION_ENV`, numbered `000.json`, `001.json`,
...: `{"argv": [script, args...], "profile": request path or ""}` runs the script with that argv (the launcher's
`--local_rank=N` kept after the script, where the launcher put it), `{"stop": true}` ends the session. Each rank
waits for the next order, runs it with `runpy` as `__main__`, and when the script ends (the trial recorder's
SystemExit 0 after the profiled steps, or its own return) writes `NNN.rank<R>.done`. A script that raises, or
exits with another status, ends the whole process with that failure (its traceback in the output): the launcher
then stops the other ranks, and the tuner records the cause and starts a new session for the trials left.
"""

from __future__ import annotations

import gc
import os
import runpy
import sys
import time
import traceback
from pathlib import Path

from slipstream.autotuning.files import PROFILE_ENV, read_json, write_json

__all__ = ["SESSION_ENV", "done_marker", "order_path"]

SESSION_ENV = "SLIPSTREAM_AUTOTUNING_SESSION"
"""The folder of the session's orders and done markers."""
POLL_S = 0.05


def order_path(folder: Path, index: int) -> Path:
    return folder / f"{index:03d}.json"


def done_marker(folder: Path, index: int, rank: int) -> Path:
    return folder / f"{index:03d}.rank{rank}.done"


def _next_order(folder: Path, index: int) -> dict[str, object]:
    path = order_path(folder, index)
    while not path.exists():
        time.sleep(POLL_S)
    order = read_json(path)
    if not isinstance(order, dict):
        raise ValueError(f"autotuning session: {path} holds {order!r}, not an order object")
    return order


def _run_script(argv: list[str], *, profile: str) -> None:
    """Run the script as `__main__` with `argv`; returns when it ends well, ends the process otherwise."""
    if profile:
        os.environ[PROFILE_ENV] = profile
    else:
        os.environ.pop(PROFILE_ENV, None)
    sys.argv = list(argv)
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as ended:
        if ended.code not in (None, 0):
            sys.stdout.flush()
            os._exit(ended.code if isinstance(ended.code, int) else 1)
    except BaseException:  # any failure of the script ends this rank; the launcher stops the others
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _release() -> None:
    """Free what the run left: its engine and model are garbage once its namespace is gone."""
    gc.collect()
    if "torch" in sys.modules:  # a script that never imported torch leaves no device cache
        from slipstream.accelerator import get_accelerator

        get_accelerator().empty_cache()


def _leave() -> None:
    """End the rank at once: the trials' engines and process group need no orderly teardown, and the
    interpreter's (torch's modules, the process group's threads) takes seconds the tuner would wait for."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    folder = Path(os.environ[SESSION_ENV])
    rank = int(os.environ.get("RANK", "0"))
    local_rank = [item for item in sys.argv[1:] if item.startswith("--local_rank=")]
    index = 0
    while True:
        order = _next_order(folder, index)
        if order.get("stop"):
            _leave()
        script, *args = (str(item) for item in order["argv"])  # type: ignore[attr-defined]
        _run_script([script, *local_rank, *args], profile=str(order.get("profile", "")))
        _release()
        write_json(done_marker(folder, index, rank), {"rank": rank})
        index += 1


if __name__ == "__main__":
    main()
