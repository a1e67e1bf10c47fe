"""The collectives whose tensors the backend may still hold, until its worker threads let go of them.

[Note: handing tensors to gloo]
A gloo worker thread marks a collective complete and only afterwards drops its own reference to the work,
and with it to the work's tensors. When that drop is the last reference to a tensor whose Python object
has already died (torch then keeps the object alive from C++), the worker takes the GIL to free it. If the
main thread has meanwhile returned from the script and the interpreter is finalizing, taking the GIL ends
the worker with pthread_exit inside a noexcept destructor, and libstdc++ calls std::terminate: "terminate
called without an active exception", SIGABRT, exit 134, after a run that trained to the end (seen in
1 run in 8 to 25 on a loaded 2-core machine; a core dump shows the worker in ~AsyncWork -> decref_pyobject
-> take_gil -> pthread_exit while the main thread is in Py_FinalizeEx).

So each collective gets fresh aliases of its tensors (`detach()`: the same storage, a TensorImpl no one else holds)
and Slipstream keeps them until the backend let go. The worker then never frees a Python object. Let go means two
counts: the TensorImpl's (`use_count`, 1: only the alias's Python object holds it) and the Python object's own.
While C++ holds a tensor, torch 2.13 keeps a reference to its Python object too, and the worker drops that one
*after* its C++ reference, taking the GIL to do it. A worker preempted between the two steps looks done by the
first count alone: Slipstream would drop its alias, and the worker, later, would free the Python object itself,
during finalization when the script ended at once (exit 134 after a script failed or kept its engine in a module
global, 1 run in 40 to 100 with the worker starved). So each alias's Python reference count is taken before the
launch, and the collective is released only once it is back to that. A wait on a collective of 1 MiB or more gives
the worker up to 2 ms to let go (`settle`), so large buffers go when their owner drops them, not at the next
collective. `drain()` waits for that at exit. An operation that never completed (timed out, or its peer was lost)
is *abandoned*: its worker may be blocked on a dead peer, so it is never joined and its aliases are kept for the
life of the process (see teardown.py).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from slipstream.utils.torch_shim import use_count

_POLL_S = 0.001
_SETTLE_BYTES = 1 << 20
_SETTLE_S = 0.002
_SETTLE_POLL_S = 50e-6


class Handed:
    """One launched collective: the backend's work until it completed, and the aliases given to it."""

    __slots__ = ("aliases", "error", "label", "python_refs", "work")

    def __init__(self, aliases: tuple[torch.Tensor, ...], label: str) -> None:
        self.aliases, self.label = aliases, label
        self.python_refs = _python_refs(aliases)  # before the backend holds them
        self.work: Any = None
        self.error: BaseException | None = None

    def poll(self) -> bool:
        """True once the backend finished it (successfully or not); then drops the work, so only the worker's
        own reference, briefly, keeps the aliases."""
        work = self.work
        if work is None:
            return True
        if not work.is_completed():
            return False
        try:
            work.wait()  # returns at once for a completed work; raises its error if it failed
        except RuntimeError as exc:
            self.error = exc.with_traceback(None)  # its frames would keep `work`, and so the aliases, alive
        self.work = None
        return True

    def released(self) -> bool:
        """The backend holds none of the aliases any more (ours is the only reference), and has handed each
        alias's Python object back (see the note)."""
        if self.work is not None or any(use_count(alias) > 1 for alias in self.aliases):
            return False
        return all(now <= before for now, before in zip(_python_refs(self.aliases), self.python_refs, strict=True))


def _python_refs(aliases: tuple[torch.Tensor, ...]) -> list[int]:
    """Each alias's Python reference count, always measured from the same frame (the tuple, this loop and the
    call each hold one)."""
    return [sys.getrefcount(alias) for alias in aliases]


_live: list[Handed] = []
_abandoned: list[Handed] = []


def hand(tensors: tuple[torch.Tensor, ...], label: str) -> Handed:
    """Aliases of `tensors` to give to the backend, registered until it lets go of them."""
    prune()
    entry = Handed(tuple(tensor.detach() for tensor in tensors), label)
    _live.append(entry)
    return entry


def settle(entry: Handed) -> None:
    """After a wait on a completed collective of at least 1 MiB: give the backend's worker up to 2 ms to drop
    its reference, so the caller's buffers are freed when the caller drops them rather than at the next
    collective, which may come much later (the last all-to-all of a Ulysses forward kept 16 MiB alive into
    the backward in some runs). The worker marks the work complete before it lets go; the gap is usually
    microseconds, longer when it waits for a core. Past 2 ms the next collective's prune finds it."""
    if entry.work is not None or sum(alias.nbytes for alias in entry.aliases) < _SETTLE_BYTES:
        return
    deadline = time.monotonic() + _SETTLE_S
    while not entry.released() and time.monotonic() < deadline:
        time.sleep(_SETTLE_POLL_S)  # a sleep, not a spin: on a busy machine the worker needs this core


def abandon(entry: Handed) -> None:
    """`entry` will never be waited on again (its deadline passed): keep it until the process ends."""
    if entry in _live:
        _live.remove(entry)
    _abandoned.append(entry)


def prune() -> None:
    """Forget the completed collectives whose tensors the backend no longer holds (so a caller's buffers are
    freed when the caller drops them, not at the next collective)."""
    _live[:] = [entry for entry in _live if not (entry.poll() and entry.released())]


def drain(timeout_s: float) -> list[Handed]:
    """Wait up to `timeout_s` for the backend to let go of every completed collective; return what it still
    holds: the abandoned ones, those never completed, and any it did not release in time."""
    unfinished = [entry for entry in _live if not entry.poll()]  # nobody waits for these now; a peer may never come
    _abandoned.extend(unfinished)
    _live[:] = [entry for entry in _live if entry not in unfinished]
    deadline = time.monotonic() + timeout_s
    prune()
    while _live and time.monotonic() < deadline:
        time.sleep(_POLL_S)  # the worker only needs a moment of CPU to drop its reference
        prune()
    _abandoned.extend(_live)
    _live.clear()
    return list(_abandoned)
