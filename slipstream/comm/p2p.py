"""Point-to-point sends and receives with the collective timeout, for pipeline stages (docs/design.md D13, P2).

A receive waits at most the collective timeout (`collectives.collective_timeout()`), on the backend's own
wait: gloo cannot poll a pending receive (its work never reports completion, and a wait that times out
closes the pair), so the receive is given the whole remaining deadline at once. It raises
`PointToPointError` naming the peer, the message and what ended the wait: the deadline, or the peer's
connection closing (a rank that raised and exited). A rank that fails writes a line about it into the
store first (`note_failure`), so the error a waiting peer raises can say which rank failed and why
(`failure_notes`), several hops away from it. Tensors are handed to the backend as aliases kept until it let
go of them, as for collectives ([Note: handing tensors to gloo] in inflight.py).
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from slipstream.comm import arrivals, counting, inflight, teardown
from slipstream.comm.collectives import collective_timeout
from slipstream.comm.errors import is_lost_peer

__all__ = ["PendingSend", "PointToPointError", "failure_notes", "note_failure", "recv", "send"]

_NOTE_KEY = "slipstream/p2p/failed/{rank}"


class PointToPointError(RuntimeError):
    """A send or receive did not complete: its peer failed, ended, or never reached the matching call."""

    def __init__(self, message: str, *, peer: int, lost: bool) -> None:
        super().__init__(message)
        self.peer, self.lost = peer, lost


def note_failure(text: str) -> None:
    """Record in the store that this rank failed (read by the peers' errors)."""
    store = arrivals._store()
    if store is not None and dist.is_initialized():
        try:
            store.set(_NOTE_KEY.format(rank=dist.get_rank()), text)
        except RuntimeError:  # the store's host is gone: the peers will see the connection close instead
            pass


def failure_notes() -> dict[int, str]:
    """rank -> what it recorded with `note_failure` (empty when no rank failed or the store is gone)."""
    store = arrivals._store()
    if store is None or not dist.is_initialized():
        return {}
    notes = {}
    for rank in range(dist.get_world_size()):
        key = _NOTE_KEY.format(rank=rank)
        try:
            if store.check([key]):
                notes[rank] = store.get(key).decode()
        except RuntimeError:
            break
    return notes


def _error(what: str, peer: int, started: float, cause: BaseException | None) -> PointToPointError:
    elapsed = time.monotonic() - started
    lost = cause is not None and is_lost_peer(cause)
    notes = failure_notes()
    failed = "; ".join(f"rank {r}: {text}" for r, text in sorted(notes.items()))
    ending = (
        "the connection to it closed" if lost else f"nothing arrived within {collective_timeout().total_seconds():g} s"
    )
    state = arrivals.process_state(peer)
    return PointToPointError(
        f"{what} with rank {peer} failed on rank {dist.get_rank()} after {elapsed:.1f} s: {ending}"
        f"{' (' + state + ')' if state else ''}. "
        + (
            f"Failed first: {failed}"
            if failed
            else "No rank recorded a failure: check that every rank runs the "
            "same schedule (train_batch/eval_batch on all of them)"
        )
        + (f". Underlying error: {cause}" if cause is not None else ""),
        peer=peer,
        lost=lost,
    )


class PendingSend:
    """An asynchronous send; `wait()` raises PointToPointError instead of blocking past the deadline."""

    def __init__(self, entry: inflight.Handed, dst: int, what: str) -> None:
        self._entry, self._dst, self._what = entry, dst, what
        self._started = time.monotonic()

    def wait(self) -> None:
        work = self._entry.work
        if work is None:
            if self._entry.error is not None:
                raise _error(self._what, self._dst, self._started, self._entry.error)
            return
        left = self._started + collective_timeout().total_seconds() - time.monotonic()
        try:
            work.wait(timeout=datetime.timedelta(seconds=max(left, 0.001)))
        except RuntimeError as exc:
            inflight.abandon(self._entry)
            self._entry.work = None
            raise _error(self._what, self._dst, self._started, exc) from None
        self._entry.work = None


def send(tensor: torch.Tensor, dst: int, *, tag: int, what: str) -> PendingSend:
    """Start sending `tensor` to global rank `dst`; the caller keeps `tensor` unchanged until wait()."""
    teardown.install(created=False)
    counting.record("send", tensor)
    entry = inflight.hand((tensor,), f"send to {dst} tag {tag}")
    try:
        entry.work = dist.isend(entry.aliases[0], dst=dst, tag=tag)
    except RuntimeError as exc:
        entry.error = exc.with_traceback(None)
    return PendingSend(entry, dst, what)


def recv(tensor: torch.Tensor, src: int, *, tag: int, what: str) -> None:
    """Receive into `tensor` from global rank `src`, waiting at most the collective timeout."""
    teardown.install(created=False)
    counting.record("recv", tensor)
    started = time.monotonic()
    entry = inflight.hand((tensor,), f"recv from {src} tag {tag}")
    try:
        entry.work = dist.irecv(entry.aliases[0], src=src, tag=tag)
        entry.work.wait(timeout=collective_timeout())
    except RuntimeError as exc:
        inflight.abandon(entry)
        entry.work = None
        raise _error(what, src, started, exc) from None
    entry.work = None
