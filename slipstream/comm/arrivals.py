"""Which rank reached which collective: per-rank records of each operation's identity in the group's store.

[Note: collective sequence numbers]
Every collective Slipstream issues gets the next number of a per-process counter and an identity: its kind,
its element count and the line that issued it (the first frame outside comm/). Before issuing it the rank
writes `"<seq>|<identity>"` under `slipstream/arrive/<rank>/<seq % WINDOW>` in the default process group's
store: one small store write per collective, as before, but the last WINDOW operations of every rank stay
readable. All ranks issue the same collectives in the same order, so when one fails, rank r arrived at
operation #seq only if its record for #seq has the same identity. A record with another identity means the
ranks diverged (one rank saves a checkpoint while the other trains); a missing record means rank r never got
there, and its newest record says what it was doing. Keying by the sequence number alone counted a rank
that had run ahead with other collectives as arrived ("ranks [] never arrived (arrived: [0, 1])").
Each rank also records `"<host> <pid>"` once, so a failure can say that a peer on this host is stopped
(SIGSTOP) or has ended. The store is torch's default store, reached through `_get_default_store`; without it the
error still names the operation, only not the other ranks.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import socket
from typing import Any

import torch.distributed as dist

WINDOW = 64
_KEY = "slipstream/arrive/{rank}/{slot}"
_PROC_KEY = "slipstream/proc/{rank}"
_counter = itertools.count(1)
_announced: list[bool] = []


@dataclasses.dataclass(frozen=True, slots=True)
class Arrival:
    seq: int
    identity: str  # "<kind> <numel> <site>"

    @property
    def op(self) -> str:
        return self.identity.split(" ", 1)[0]

    def describe(self) -> str:
        kind, numel, site = (self.identity.split(" ", 2) + ["", ""])[:3]
        return f"#{self.seq} {kind} of {numel} elements from {site}"


@dataclasses.dataclass(frozen=True, slots=True)
class Standing:
    """Where one rank stands relative to operation #seq of this rank."""

    rank: int
    arrived: bool
    at_seq: Arrival | None  # its record for #seq (None: none, or overwritten)
    last: Arrival | None  # its newest record at or before #seq (None: none readable)


def _store() -> Any:
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        return None
    try:
        return getter()
    except (RuntimeError, ValueError):
        return None


def record(identity: str) -> int:
    """Take the next sequence number for the operation `identity` and record this rank's arrival at it."""
    seq = next(_counter)
    if dist.get_world_size() > 1:
        store = _store()
        if store is not None:
            rank = dist.get_rank()
            if not _announced:
                _announced.append(True)
                store.set(_PROC_KEY.format(rank=rank), f"{socket.gethostname()} {os.getpid()}")
            store.set(_KEY.format(rank=rank, slot=seq % WINDOW), f"{seq}|{identity}")
    return seq


def _read(store: dist.Store, key: str) -> str | None:
    try:
        return store.get(key).decode() if store.check([key]) else None
    except RuntimeError:  # the store's host is gone: nothing more to learn from it
        return None


def _record_at(store: dist.Store, rank: int, seq: int) -> Arrival | None:
    value = _read(store, _KEY.format(rank=rank, slot=seq % WINDOW))
    if not value:
        return None
    number, identity = value.split("|", 1)
    return Arrival(int(number), identity)


def standing(rank: int, seq: int, identity: str) -> Standing:
    """Whether `rank` recorded operation #seq with `identity`, and its newest record up to #seq."""
    store = _store()
    if store is None:
        return Standing(rank, False, None, None)
    here = _record_at(store, rank, seq)
    if here is not None and here.seq == seq:
        return Standing(rank, here.identity == identity, here, here)
    if here is not None and here.seq > seq:  # it went WINDOW operations past us: it got here long ago
        return Standing(rank, True, None, here)
    for earlier in range(seq - 1, max(0, seq - WINDOW), -1):
        found = _record_at(store, rank, earlier)
        if found is not None and found.seq == earlier:
            return Standing(rank, False, None, found)
    return Standing(rank, False, None, None)


def newest(rank: int) -> Arrival | None:
    """`rank`'s newest readable record (where it was last, when it stopped or ended inside an operation)."""
    store = _store()
    if store is None:
        return None
    found = [record for slot in range(WINDOW) if (record := _record_at(store, rank, slot)) is not None]
    return max(found, key=lambda record: record.seq, default=None)


def process_of(rank: int) -> tuple[str, int] | None:
    """(host, pid) that `rank` recorded, or None."""
    store = _store()
    value = _read(store, _PROC_KEY.format(rank=rank)) if store is not None else None
    if not value:
        return None
    host, pid = value.rsplit(" ", 1)
    return host, int(pid)


def process_state(rank: int) -> str:
    """'' or a phrase about `rank`'s process when it runs on this host: stopped, or ended."""
    found = process_of(rank)
    if found is None or found[0] != socket.gethostname():
        return ""
    pid = found[1]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"rank {rank} (pid {pid} on this host) has ended"
    except PermissionError:
        return ""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):  # no /proc here: alive is all we know
        return ""
    if state in ("T", "t"):
        return f"rank {rank} (pid {pid} on this host) is stopped (SIGSTOP or a debugger)"
    if state in ("Z", "X"):  # not reaped yet
        return f"rank {rank} (pid {pid} on this host) has ended"
    return ""
