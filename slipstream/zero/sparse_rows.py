"""`sparse_gradients` at ZeRO stage 0: the gradients of embedding tables all-reduced as the rows they touch.

[Note: sparse rows]
An embedding table's gradient is zero outside the rows its batches looked up. With `sparse_gradients: true`
stage 0 reduces the weight of every nn.Embedding and nn.EmbeddingBag (built with sparse=False or not, as
DeepSpeed's engine does) apart from the rest of its bucket, at the step:
  Phase 1: each rank counts the rows of its accumulated gradient that hold a nonzero entry (k_r), and the ranks
           all-gather the counts (dense_parts, before the bucket's dense all-reduces are launched).
  Phase 2: a table whose rows are fewer in bytes than the table (world * max k_r rows and their indices against
           the dense numel) is all-gathered as (indices, rows), each rank padded to max k_r with index 0 and
           zero rows, and the rows are summed into its gradient by index (reduce, after the launches); a
           table they do not shrink is all-reduced dense with the rest of the bucket.
Either way every rank ends with the sum over ranks, in the bucket's reduce dtype, as a dense all-reduce gives;
the step's divisor is applied afterwards as for every gradient. The exchanged buffers are sized by this step's
rows (small when the point holds), so they are allocated per step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from slipstream.comm import collectives
from slipstream.zero.flat_group import FlatGroup
from slipstream.zero.layout import Bucket

__all__ = ["SparseRows", "dense_parts", "embedding_tables", "reduce_sparse_rows"]

INDEX_DTYPE = torch.int64


def embedding_tables(module: nn.Module) -> list[torch.Tensor]:
    """The weights whose gradients stage 0 reduces as rows: those of nn.Embedding and nn.EmbeddingBag."""
    return [m.weight for m in module.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]


class SparseRows:
    """Which parameters of which buckets are embedding tables, and this step's choice for each (phase 1)."""

    def __init__(self, groups: Sequence[FlatGroup], tables: Iterable[torch.Tensor]) -> None:
        wanted = {id(p) for p in tables}
        self._tables: dict[tuple[int, int], list[int]] = {}
        """(id of the flat group, the bucket's flat offset) -> its embedding tables' positions, in flat order."""
        for flat in groups:
            slots = flat.layout.slots
            found = [i for i, p in enumerate(flat.params) if id(p) in wanted and p.dim() == 2]
            for index in sorted(found, key=lambda i: slots[i].flat_offset):
                bucket = flat.layout.buckets[slots[index].bucket]
                self._tables.setdefault((id(flat), bucket.flat_offset), []).append(index)
        self._pending: dict[int, tuple[torch.Tensor, int]] = {}
        """Phase 1's result: position -> (this rank's nonzero rows, the largest count of any rank)."""
        self.num_tables = sum(len(v) for v in self._tables.values())

    def _tables_in(self, flat: FlatGroup, bucket: Bucket) -> list[int]:
        return self._tables.get((id(flat), bucket.flat_offset), [])

    def _choose(self, flat: FlatGroup, index: int) -> bool:
        """Phase 1 for one table: True (and its rows kept) when rows are smaller than the dense table."""
        param = flat.params[index]
        grad = flat.full_grad_view(index).view(param.shape)
        rows = grad.ne(0).any(dim=1).nonzero().flatten()
        counts = torch.zeros(flat.world_size, dtype=INDEX_DTYPE, device=grad.device)
        mine = torch.tensor([rows.numel()], dtype=INDEX_DTYPE, device=grad.device)
        collectives.all_gather(counts, mine, group=flat.process_group)
        largest = int(counts.max())
        row_bytes = param.shape[1] * grad.element_size() + INDEX_DTYPE.itemsize
        if flat.world_size * largest * row_bytes >= grad.numel() * grad.element_size():
            return False
        self._pending[index] = (rows, largest)
        return True

    def _reduce(self, flat: FlatGroup, index: int, dtype: torch.dtype) -> None:
        """Phase 2 for one table: all-gather indices and rows, sum them by index into the gradient."""
        param, (rows, largest) = flat.params[index], self._pending.pop(index)
        grad = flat.full_grad_view(index).view(param.shape)
        width, world, device = param.shape[1], flat.world_size, grad.device
        indices = torch.zeros(largest, dtype=INDEX_DTYPE, device=device)
        values = torch.zeros(largest, width, dtype=dtype, device=device)
        indices[: rows.numel()], values[: rows.numel()] = rows, grad[rows]
        all_indices = torch.empty(world * largest, dtype=INDEX_DTYPE, device=device)
        all_values = torch.empty(world * largest, width, dtype=dtype, device=device)
        collectives.all_gather(all_indices, indices, group=flat.process_group)
        collectives.all_gather(all_values, values, group=flat.process_group)
        summed = torch.zeros(param.shape, dtype=dtype, device=device).index_add_(0, all_indices, all_values)
        grad.copy_(summed)

    def dense_parts(self, flat: FlatGroup, bucket: Bucket) -> list[torch.Tensor]:
        parts, start = [], bucket.flat_offset
        for index in self._tables_in(flat, bucket):
            if self._choose(flat, index):
                slot = flat.layout.slots[index]
                parts.append(flat.grad_storage[start : slot.flat_offset])
                start = slot.flat_offset + slot.numel
        parts.append(flat.grad_storage[start : bucket.flat_offset + bucket.padded_numel])
        return [part for part in parts if part.numel()]

    def reduce_rows(self, flat: FlatGroup, bucket: Bucket, dtype: torch.dtype) -> None:
        for index in self._tables_in(flat, bucket):
            if index in self._pending:
                self._reduce(flat, index, dtype)


def dense_parts(rows: SparseRows | None, flat: FlatGroup, bucket: Bucket) -> list[torch.Tensor]:
    """The slices of `bucket`'s gradients to all-reduce dense: all of it but the tables reduced as rows (phase
    1 runs here; see [Note: sparse rows])."""
    return [flat.bucket_grads(bucket)] if rows is None else rows.dense_parts(flat, bucket)


def reduce_sparse_rows(rows: SparseRows | None, flat: FlatGroup, bucket: Bucket, dtype: torch.dtype) -> None:
    """Phase 2 for the tables of `bucket` that dense_parts left out (after the bucket's dense launches)."""
    if rows is not None:
        rows.reduce_rows(flat, bucket, dtype)
