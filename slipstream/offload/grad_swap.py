"""`GradientSwap`: ZeRO-Infinity's gradient shards in files, one buffer per sub-group, a bounded few in memory.

[Note: swapped gradients]
With NVMe optimizer offload at stage 3 the fp32 gradient shard of each sub-group (the same sub-groups whose
masters and Adam states `NVMeOffload` swaps) has its own buffer. A buffer is in one of three states:
- *zero*: no gradient since the last step; no memory, and its file (if any) is stale. Opening it for a sum
  allocates zeros: nothing is read.
- *saved*: its values are in its file (a partial sum between micro-batches, or a complete one waiting for the
  step); no memory.
- *resident*: in memory, `dirty` when it changed since its file was written.
During backward the reduce-scatter ring opens a buffer to add a unit's gradients into it (`open`): at most
`limit` buffers are resident, the least recently opened one is written out to make room (units complete in
roughly reverse order, so the sub-groups being filled are few, except the ones holding the root and persistent
units, which complete last). A complete buffer stays among those `limit` until it is the least recent: so the
last ones completed in a backward are still in memory for the next micro-batch or the step
(they are the first sub-groups stepped: the first units complete last), and a model of one or two sub-groups
does no gradient I/O at all. The step reads each sub-group's buffer in with its masters (`fetch`, the next
one's read started early, `prefetch`) and drops it after the update (`discard`): gradients are never written
back after a step. At most `limit` + 2 buffers are in memory at once (the kept ones, the one stepped and the
next, being read). Counts of what is resident are kept here, so tests count buffers, not RSS.
"""

from __future__ import annotations

import enum

import torch

from slipstream.offload.swapper import Swapper


class GradState(enum.Enum):
    ZERO = "zero"
    SAVED = "saved"
    RESIDENT = "resident"


class GradientSwap:
    """The sub-groups' gradient buffers (`buffers[i]` for sub-group i, in stepping order) and their states."""

    def __init__(self, swapper: Swapper, buffers: list[tuple[torch.Tensor, str]], *, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"GradientSwap: limit={limit} resident gradient buffers; it needs at least 1")
        self.swapper, self.buffers, self.limit = swapper, buffers, limit
        self.states = [GradState.ZERO] * len(buffers)
        self._dirty: set[int] = set()
        self._recent: list[int] = []  # resident buffers opened for sums, least recently opened first
        self.peak_open = 0
        """The most buffers resident at once while gradients were added (reset it to measure a window)."""
        for tensor, _ in buffers:
            tensor.untyped_storage().resize_(0)

    def __len__(self) -> int:
        return len(self.buffers)

    def resident_count(self) -> int:
        return sum(state is GradState.RESIDENT for state in self.states)

    def _grow(self, index: int) -> torch.Tensor:
        tensor = self.buffers[index][0]
        tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())
        return tensor

    def _bring_in(self, index: int) -> None:
        state = self.states[index]
        if state is GradState.ZERO:
            self._grow(index).zero_()
        elif state is GradState.SAVED:
            self.swapper.finish_swap_in([self.buffers[index][0]])
        self.states[index] = GradState.RESIDENT

    def open(self, index: int) -> torch.Tensor:
        """Buffer `index` in memory to add gradients into (marked dirty); may write out the least recent other."""
        if index in self._recent:
            self._recent.remove(index)
        self._bring_in(index)
        self._dirty.add(index)
        self._recent.append(index)
        while len(self._recent) > self.limit:
            self._write_out(self._recent[0])
        self.peak_open = max(self.peak_open, self.resident_count())
        return self.buffers[index][0]

    def _write_out(self, index: int) -> None:
        if index in self._recent:
            self._recent.remove(index)
        if self.states[index] is not GradState.RESIDENT:
            return
        if index in self._dirty:
            self.swapper.swap_out([self.buffers[index]])
            self._dirty.discard(index)
        else:
            self.swapper.drop([self.buffers[index]])
        self.states[index] = GradState.SAVED

    def prefetch(self, index: int) -> None:
        """Start reading buffer `index` (a saved one) for the step; `fetch` waits."""
        if self.states[index] is GradState.SAVED:
            self.swapper.start_swap_in([self.buffers[index][0]])

    def fetch(self, index: int) -> torch.Tensor:
        """Buffer `index` in memory to read (clean: releasing it again costs no write)."""
        self._bring_in(index)
        return self.buffers[index][0]

    def release(self, index: int, *, changed: bool = False) -> None:
        """Done reading buffer `index` (`changed`: it was written): one of the kept buffers stays resident, any
        other is written out (when changed) and released."""
        if changed:
            self._dirty.add(index)
        if index not in self._recent:
            self._write_out(index)

    def discard(self, index: int) -> None:
        """Buffer `index`'s values are used up (the step took them): release it without writing; it is zero now."""
        if index in self._recent:
            self._recent.remove(index)
        self._dirty.discard(index)
        if self.states[index] is GradState.RESIDENT:
            self.buffers[index][0].untyped_storage().resize_(0)
        self.states[index] = GradState.ZERO

    def zero_all(self) -> None:
        for index in range(len(self.buffers)):
            self.discard(index)

    def file_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t, _ in self.buffers)
