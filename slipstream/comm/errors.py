"""What a failed collective says: the operation, who arrived, who did not and why, and how long it waited.

`CollectiveError` is the base: a collective that did not complete. `CollectiveTimeout`: its deadline passed
(some rank never reached it, reached another operation, or stopped inside it). `PeerLost`: the connection to
a peer closed (a rank died or exited) before it completed. Both name the operation (kind, sequence number, the line that
issued it and the first line outside Slipstream that led there), the ranks that arrived at it and those
that did not with what each was last doing, the state of peer processes on this host (stopped, gone), and
the real elapsed time. When every rank arrived there is no missing rank to name: the message names the rank
that stopped or ended inside the operation instead, with its last collective.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from slipstream.comm import arrivals

# How a closed connection reads in gloo's and the socket layer's messages.
_LOST_PEER_SIGNS = (
    "connection closed",
    "connection reset",
    "broken pipe",
    "econnreset",
    "epipe",
    "connection refused",
    "no route to host",
)
_ADVICE = (
    "Every rank must run the same forward/backward/step and the same collective calls (save_checkpoint "
    "and load_checkpoint too)"
)
_INSIDE_ADVICE = (
    "The ranks issued the same collectives; the rank named stopped or ended during this one: its log and the "
    "launcher's report say why (a signal from outside the job, an out-of-memory kill, a debugger)"
)


def is_lost_peer(error: BaseException) -> bool:
    text = str(error).lower()
    return any(sign in text for sign in _LOST_PEER_SIGNS)


@dataclasses.dataclass(frozen=True)
class OpInfo:
    """One launched collective, as the error reports it."""

    kind: str
    seq: int
    identity: str  # "<kind> <numel> <site>", as recorded in the store
    shape: tuple[int, ...]
    dtype: str
    site: str  # the line that issued it (the first frame outside comm/)
    origin: str  # the first line outside Slipstream that led there ('' when that is `site`)
    timeout_s: float


class CollectiveError(RuntimeError):
    """A collective did not complete; the message says which, where, who arrived and why not.

    When every rank arrived, the operation did not complete because a rank stopped or ended inside it: the
    message then names that rank (when it runs on this host) and its last collective, instead of an empty
    list of missing ranks."""

    missing_advice = _ADVICE
    """What to do when some rank did not arrive."""

    def __init__(self, info: OpInfo, elapsed_s: float, cause: BaseException | None, what: str) -> None:
        world, me = dist.get_world_size(), dist.get_rank()
        standings = [arrivals.standing(rank, info.seq, info.identity) for rank in range(world) if rank != me]
        self.op, self.seq, self.site, self.elapsed_s = info.kind, info.seq, info.site, elapsed_s
        self.arrived = sorted([me] + [s.rank for s in standings if s.arrived])
        self.missing = sorted(s.rank for s in standings if not s.arrived)
        self.mismatched = sorted(s.rank for s in standings if s.at_seq is not None and not s.arrived)
        states = {rank: state for rank in range(world) if rank != me and (state := arrivals.process_state(rank))}
        if self.missing:
            notes = [_describe(s) for s in standings if not s.arrived] + list(states.values())
        else:
            notes = [_inside(rank, state) for rank, state in states.items()]
        self.detail = "; ".join(notes)
        origin = f", called from {info.origin}" if info.origin else ""
        super().__init__(
            f"collective {info.kind} #{info.seq} ({info.shape}, {info.dtype}) from {info.site}{origin} {what} on "
            f"rank {me} after {elapsed_s:.1f} s (collective timeout {info.timeout_s:g} s): {self._account()}. "
            f"{self._advice()}{f'. Underlying error: {cause}' if cause is not None else ''}"
        )

    @property
    def every_rank_arrived(self) -> bool:
        """Every rank reached this operation: one of them stopped or ended inside it."""
        return not self.missing

    def _account(self) -> str:
        if self.every_rank_arrived:
            return f"every rank arrived (ranks {self.arrived}), {self._who_stopped()}"
        detail = f" ({self.detail})" if self.detail else ""
        return f"arrived ranks {self.arrived}, missing ranks {self.missing}{detail}"

    def _who_stopped(self) -> str:
        if self.detail:
            return f"then {self.detail}"
        return "then a rank stopped or ended inside it (on another host: the launcher of its node names it)"

    def _advice(self) -> str:
        return _INSIDE_ADVICE if self.every_rank_arrived else self.missing_advice

    def summary(self) -> str:
        """Who arrived, who did not and why, and what ended the wait, for errors that wrap this one."""
        if self.every_rank_arrived:
            return f"{self._account()}; {self._ending()} after {self.elapsed_s:.1f} s"
        detail = f"; {self.detail}" if self.detail else ""
        return (
            f"ranks {self.missing} never arrived (arrived: {self.arrived}{detail}); {self._ending()} after "
            f"{self.elapsed_s:.1f} s"
        )

    def fix_for(self, call: str) -> str:
        """What to do, for an error of `call` (save_checkpoint, load_checkpoint) that wraps this one."""
        if self.every_rank_arrived:
            return _INSIDE_ADVICE
        return f"Every rank must call {call}, with the same arguments"

    def _ending(self) -> str:
        return f"{self.op} #{self.seq} from {self.site} failed"


class CollectiveTimeout(CollectiveError):
    """A collective did not complete within the collective timeout: some rank never reached it, or stopped in it."""

    def __init__(self, info: OpInfo, elapsed_s: float, cause: BaseException | None = None) -> None:
        super().__init__(info, elapsed_s, cause, f"did not complete within {info.timeout_s:g} s")

    def _ending(self) -> str:
        return f"{self.op} #{self.seq} from {self.site} timed out"


class PeerLost(CollectiveError):
    """The connection to a peer closed while a collective ran: a rank died or exited."""

    missing_advice = "The first error in the other ranks' logs says why that rank ended"

    def __init__(self, info: OpInfo, elapsed_s: float, cause: BaseException | None = None) -> None:
        super().__init__(info, elapsed_s, cause, "failed: the connection to a peer closed (a rank died or exited)")

    def _ending(self) -> str:
        return f"the connection to a peer closed during {self.op} #{self.seq} from {self.site}"


def _describe(standing: arrivals.Standing) -> str:
    rank = standing.rank
    if standing.at_seq is not None:
        return f"rank {rank} reached {standing.at_seq.describe()} instead: the ranks issued different collectives"
    if standing.last is None:
        return f"rank {rank} reached no collective that this rank can see"
    return f"rank {rank} last reached {standing.last.describe()}"


def _inside(rank: int, state: str) -> str:
    """`state` of a rank that arrived at the operation, with the last collective it recorded."""
    last = arrivals.newest(rank)
    return f"{state}, its last collective {last.describe()}" if last is not None else state
