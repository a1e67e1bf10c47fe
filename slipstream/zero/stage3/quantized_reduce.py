"""ZeRO++'s quantized gradient reduce-scatter (qgZ) of one ZeRO-3 unit: int4 inside a node, int8 across nodes.

[Note: qgZ schedule]
The unit's group of n = a x b ranks is a nodes' blocks of a consecutive members (a: ranks per node, from
comm/nodes.py) and b nodes; member (m, l) is the l-th rank of node m. The staging buffer is rank-major, [n, W]:
row (m, l) holds what the sum must leave on member (m, l), and the exact reduce-scatter leaves row r's sum on
member r. qgZ leaves the same rows, in two all-to-alls of block-quantized pieces (zero/quantized.py):
    Phase 1, inside the node: the b rows bound for node-mate l' ([b, W]: rows (m, l') of every node m) are one
        int4 piece; one all-to-all over the node's group hands each node-mate its piece from every member; each
        rank dequantizes the a pieces it received and sums them in fp32, in member order: [b, W], row m the
        node's sum of row (m, l).
    Phase 2, across nodes: row m of that sum is one int8 piece for member (m, l); one all-to-all over the
        members at position l of every node (the outer group) exchanges them; each rank dequantizes the b pieces
        and sums them in fp32, in node order: the group's sum of its own row, written into `receive`.
A rank's piece for itself (its own slot in each all-to-all) never leaves it, so it is not quantized: the sum
takes its exact values in that slot's place (the slot still travels, unread, so the buffers keep one layout and
the bytes counted are unchanged). Only what goes to another rank is rounded: at 2 ranks one of each sum's two
contributions instead of both (DeepSpeed quantizes the whole tensor, its own part too).
With one node (no LOCAL_WORLD_SIZE, or the group within one node) phase 1 alone runs and its sum is the result;
with one rank per node phase 2 alone runs, on the rows as they are. The shard layout is the exact
reduce-scatter's, so the optimizer, checkpoints and everything after the reduction are unchanged. Each rank
sends (a - 1) / a of an int4 copy of the unit's gradient inside its node and (b - 1) / b of an int8 copy of a
1 / a of it across nodes (plus an fp32 scale per block of 256): a quarter of fp32's cross-node bytes.

With zeropp_loco_param every quantization is error-compensated (stage3/loco.py, [Note: LoCo error feedback]).

Phase 1's all-to-all is launched by `launch`; `wait()` of the returned work does the rest (so with
overlap_comm the first exchange overlaps the backward). The buffers come from the stage's BufferPool, which
keeps them for the next unit and the next step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist

from slipstream.comm import collectives
from slipstream.comm.collectives import TimedWork
from slipstream.comm.nodes import ranks_per_node, two_level_groups
from slipstream.zero.quantized import QuantizedRows
from slipstream.zero.stage3.loco import KeptErrors, LocoReduction
from slipstream.zero.stage3.pool import BufferPool

INNER_BITS = 4
OUTER_BITS = 8


@dataclasses.dataclass(frozen=True)
class Levels:
    """The two levels of a unit's group: `size` members per node (inner group `inner`), `count` nodes (outer
    group `outer`); a group is None where its level has one member."""

    size: int
    count: int
    inner: dist.ProcessGroup | None
    outer: dist.ProcessGroup | None


def node_levels(group: dist.ProcessGroup | None) -> Levels:
    """Cut `group` (None: the world) at node boundaries. Every member calls this at the same point (the group
    constructors are collective). A group whose members do not come in whole blocks per node is treated as one
    rank per node (every exchange counts as crossing nodes, at int8). A group other than the world (a MiCS shard
    group spanning nodes, an expert or data-parallel sub-group) is cut by its own members alone (comm/nodes.py
    builds a sub-group's blocks and columns with local synchronisation)."""
    members = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    local = ranks_per_node(dist.get_world_size())
    node = dist.get_rank() // local
    size = sum(1 for m in members if m // local == node)
    blocks = [members[i : i + size] for i in range(0, len(members), size)]
    if len(members) % size or any(len({m // local for m in block}) != 1 for block in blocks):
        size = 1
    if size == len(members):
        return Levels(size, 1, group, None)
    if size == 1:  # one member per node: the group itself is the exchange across nodes
        return Levels(1, len(members), None, group)
    cut = two_level_groups(group, size, what="LOCAL_WORLD_SIZE (ranks per node)")
    return Levels(size, cut.count, cut.inner, cut.outer)


class QuantizedReduceWork:
    """The in-flight qgZ reduction of one unit: `wait()` completes it (see [Note: qgZ schedule])."""

    def __init__(self, finish: Callable[[], None]) -> None:
        self._finish: Callable[[], None] | None = finish

    def wait(self) -> None:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


class QuantizedReduceScatter:
    """qgZ over a unit's group cut at node boundaries (`levels`), buffers from `pool` (see [Note: qgZ schedule])."""

    def __init__(self, levels: Levels, pool: BufferPool, loco: KeptErrors | None = None) -> None:
        """`loco`: the unit's LoCo state (its quantizations error-compensated), or None: plain qgZ."""
        self.levels, self.pool, self.loco = levels, pool, loco

    @property
    def kept_bytes(self) -> int:
        """Bytes of LoCo's kept errors (0 without LoCo, and before the first reduction)."""
        return 0 if self.loco is None else self.loco.nbytes

    def codecs(self, width: int) -> tuple[QuantizedRows | None, QuantizedRows | None]:
        """The pieces of phase 1 (None with one rank per node) and of phase 2 (None with one node)."""
        a, b = self.levels.size, self.levels.count
        inner = QuantizedRows(b * width, bits=INNER_BITS, tagged=False) if a > 1 else None
        outer = QuantizedRows(width, bits=OUTER_BITS, tagged=False) if b > 1 else None
        return inner, outer

    def launch(self, receive: torch.Tensor, staging: torch.Tensor) -> QuantizedReduceWork:
        """Start reducing `staging` ([n x width], rank-major) into `receive` (this rank's `width` elements)."""
        width, b = receive.numel(), self.levels.count
        inner, outer = self.codecs(width)
        scratch = self.pool.take(max(c.padded for c in (inner, outer) if c is not None), torch.float32)
        total = self.pool.take(b * width, torch.float32)
        loco = None if self.loco is None else self.loco.start(width, staging.dtype)
        if inner is None:  # one rank per node: the rows go across as they are
            assert outer is not None
            return QuantizedReduceWork(
                lambda: self._across_nodes(outer, staging.view(b, width), receive, scratch, total, loco)
            )
        rows = staging.view(b, self.levels.size, width)
        mate = dist.get_rank(self.levels.inner)
        sent, received, work = self._within_node(inner, rows, mate, scratch, loco)

        def finish() -> None:
            work.wait()
            self._sum(inner, received, (mate, rows[:, mate]), scratch, total)
            self.pool.give(sent)
            self.pool.give(received)
            if outer is None:
                receive.copy_(total)
                self._done(scratch, total)
            else:
                self._across_nodes(outer, total.view(b, width), receive, scratch, total, loco)

        return QuantizedReduceWork(finish)

    @staticmethod
    def _encode_all(
        codec: QuantizedRows,
        values: list[torch.Tensor],
        own: int,
        pieces: torch.Tensor,
        scratch: torch.Tensor,
        phase: str,
        loco: LocoReduction | None,
    ) -> None:
        """Quantize each of `values` but the `own` one (this rank's, kept exact) into its row of `pieces`; with
        LoCo error-compensated, each with the error kept for `phase`'s piece at its index."""
        kept = None if loco is None else loco.kept(phase, len(values), codec.numel, pieces.device)
        for index, value in enumerate(values):
            if index == own:
                continue
            if loco is None or kept is None:
                codec.encode(value, pieces[index], None, scratch)
            else:
                loco.encode(codec, value, pieces[index], kept[index], scratch)

    def _within_node(
        self, codec: QuantizedRows, rows: torch.Tensor, own: int, scratch: torch.Tensor, loco: LocoReduction | None
    ) -> tuple[torch.Tensor, torch.Tensor, TimedWork]:
        """Phase 1: quantize node-mate l's rows (`rows[:, l]`, every node's row at position l; this rank's own,
        position `own`, stays exact) and launch the all-to-all inside the node."""
        a = self.levels.size
        sent = self.pool.take(a * codec.row_bytes, torch.int8)
        received = self.pool.take(a * codec.row_bytes, torch.int8)
        pieces = [rows[:, mate] for mate in range(a)]
        self._encode_all(codec, pieces, own, sent.view(a, codec.row_bytes), scratch, "within", loco)
        work = collectives.all_to_all(received, sent, group=self.levels.inner, async_op=True)
        return sent, received, work

    def _across_nodes(
        self,
        codec: QuantizedRows,
        rows: torch.Tensor,
        receive: torch.Tensor,
        scratch: torch.Tensor,
        total: torch.Tensor,
        loco: LocoReduction | None = None,
    ) -> None:
        """Phase 2: quantize row m for node m's member at this rank's position, exchange, dequantize and sum."""
        b, node = self.levels.count, dist.get_rank(self.levels.outer)
        sent = self.pool.take(b * codec.row_bytes, torch.int8)
        received = self.pool.take(b * codec.row_bytes, torch.int8)
        self._encode_all(codec, list(rows), node, sent.view(b, codec.row_bytes), scratch, "across", loco)
        collectives.all_to_all(received, sent, group=self.levels.outer)
        self._sum(codec, received, (node, rows[node]), scratch, total)
        receive.copy_(total[: codec.numel])
        self.pool.give(sent)
        self.pool.give(received)
        self._done(scratch, total)

    @staticmethod
    def _sum(
        codec: QuantizedRows,
        received: torch.Tensor,
        own: tuple[int, torch.Tensor],
        scratch: torch.Tensor,
        total: torch.Tensor,
    ) -> None:
        """`total[:numel]` := the sum, in fp32 and in sender order, of the dequantized pieces in `received`, the
        exact values `own[1]` standing for this rank's own slot `own[0]` (it may be `total`'s first row itself)."""
        pieces = received.view(-1, codec.row_bytes)
        out = total[: codec.numel]
        for sender in range(pieces.shape[0]):
            if sender == own[0]:
                target, values = out.view(own[1].shape), own[1]
            else:
                target, values = out, codec.decode(pieces[sender : sender + 1], scratch)[0]
            if sender == 0:
                target.copy_(values)
            else:
                target.add_(values)

    def _done(self, scratch: torch.Tensor, total: torch.Tensor) -> None:
        self.pool.give(scratch)
        self.pool.give(total)
