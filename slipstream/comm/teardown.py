"""How the process group ends: joined on an orderly exit, left to the OS when a peer may never answer.

[Note: process group teardown]
`init_distributed` (and the first collective, for a group someone else created) registers `at_exit`. It runs
from atexit, before the interpreter finalizes, whether the script returned, called sys.exit, raised, or
called destroy_process_group itself:
1. `inflight.drain()` waits until the backend's workers let go of every completed collective (see [Note:
   handing tensors to gloo] in inflight.py).
2. Nothing abandoned: destroy the group if Slipstream created it, then drop the references torch keeps to
   destroyed groups (`torch_shim.forget_destroyed_groups`). The group's C++ destructor then joins its worker
   threads, with the GIL released, while the interpreter is still whole.
3. Something abandoned (a timeout or a lost peer left a worker waiting on a peer that may never answer):
   joining would block until gloo gives up, and gloo cannot be aborted (ProcessGroupGloo's abort() and
   shutdown() do nothing in torch 2.13). So the process groups and the abandoned collectives' tensors are
   kept alive for good: no destructor joins a blocked thread, no worker frees a Python object, and the
   process exits with its own status as soon as the interpreter is done; the OS closes the sockets.
Other atexit work (logs, NVMe swap directories) runs as usual in every case.
"""

from __future__ import annotations

import atexit
import ctypes
import sys

import torch.distributed as dist

from slipstream.comm import inflight
from slipstream.utils import torch_shim

DRAIN_S = 10.0  # the workers need only CPU time to let go; this bounds a pathological wait, not a normal one
_state = {"installed": False, "created": False}
_kept: list[object] = []


def install(*, created: bool) -> None:
    """Register `at_exit` once; `created`: Slipstream started the default group, so it also destroys it."""
    _state["created"] = _state["created"] or created
    if not _state["installed"]:
        _state["installed"] = True
        atexit.register(at_exit)


def keep_forever(objects: list[object]) -> None:
    """Never free `objects`: one extra reference each that nothing releases, not even finalization."""
    for obj in objects:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    _kept.extend(objects)


def at_exit() -> None:
    abandoned = inflight.drain(DRAIN_S)
    if abandoned:
        keep_forever([*abandoned, *torch_shim.live_groups()])
        rank = dist.get_rank() if dist.is_initialized() else "?"
        names = ", ".join(entry.label for entry in abandoned[:3]) + (", ..." if len(abandoned) > 3 else "")
        sys.stderr.write(
            f"slipstream: rank {rank} exits without joining the process group's threads: "
            f"{len(abandoned)} collective(s) never completed ({names})\n"
        )
        sys.stderr.flush()
        return
    try:
        if _state["created"] and dist.is_initialized():
            dist.destroy_process_group()
        torch_shim.forget_destroyed_groups()
    except Exception as exc:
        sys.stderr.write(f"slipstream: destroying the process group at exit failed: {exc!r}\n")
