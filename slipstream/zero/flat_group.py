"""`FlatGroup`: one optimizer param group's trainable parameters moved into flat, bucketed buffers.

[Note: ZeRO tensors] (the vocabulary of stages 0-2)
- *flat params*: one buffer per group in the model dtype; every parameter's `.data` is a view into it,
  laid out as in [Note: bucket-major layout] (`layout.py`). Model code sees ordinary parameters.
- *pieces*: the parts of the flat buffer a rank owns: piece r of every bucket (stages 1, 2), or whole
  buckets (stage 0).
- *master pieces*: the fp32 tensors the optimizer updates, one per owned piece. When the model dtype is
  the master dtype they are views of the flat params (no copy, updated in place); otherwise they live in
  one fp32 buffer and are copied (cast) into the flat params after each step.
- *grad storage*: where gradients accumulate, in the grad-accumulation dtype; full-size at stages 0 and 1,
  shard-size at stage 2. Each master piece's `.grad` is a view of it.
Buffers are allocated once, here, and reused every step.

[Note: gathering the pieces]
After the step every rank's flat params take every rank's updated pieces, span by span of buckets as each
span's update is done ([Note: overlapped gather of the updated pieces] in span_step.py), or all buckets at once
(`gather_params`). On a device that is one in-place all-gather per bucket (`all_gather_into_tensor(bucket,
piece)`). On the host (gloo) it is one point-to-point exchange per span (`collectives.all_gather_by_exchange`):
each rank sends its pieces to every other rank and receives theirs in place. gloo's all-gather copies through a
temporary as large as its output (a whole bucket: the whole model at the default `reduce_bucket_size`); an
all-reduce over -0.0 written in the pieces a rank does not own works in place but sends twice the bytes and
sums them. Measured on 2 ranks, 50.4M fp32 parameters in 25 buckets, loaded machine: the exchange 121 ms, the
all-reduce 488 ms, the per-bucket all-gathers 536 ms.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from slipstream.comm import collectives
from slipstream.comm.collectives import TimedWork
from slipstream.offload.policy import OffloadPolicy
from slipstream.zero.comm_stream import CommStream
from slipstream.zero.layout import Bucket, GroupLayout
from slipstream.zero.master_group import MasterGroup


class FlatGroup(MasterGroup):
    """Flat buffers of one param group; `owns_all` means stage 0 (every rank owns every bucket)."""

    def __init__(
        self,
        params: list[nn.Parameter],
        *,
        layout: GroupLayout,
        rank: int,
        owns_all: bool,
        master_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        full_grad_storage: bool,
        offload: OffloadPolicy,
    ) -> None:
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise ValueError(
                f"a param group mixes dtypes {sorted(map(str, dtypes))} or devices "
                f"{sorted(map(str, devices))}; cast the model to one dtype and device first"
            )
        self.params = params
        self.layout = layout
        self.rank = rank
        self.process_group: Any = None
        """The process group this group's gradients are reduced and its pieces gathered over (None: default)."""
        self.world_size = layout.world_size
        self.owns_all = owns_all
        self.dtype = next(iter(dtypes))
        self.device = next(iter(devices))
        self.flat_params = torch.zeros(layout.flat_numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for param, slot in zip(params, layout.slots):
                view = self.flat_params[slot.flat_offset : slot.flat_offset + slot.numel]
                view.copy_(param.data.reshape(-1))
                param.data = view.view_as(param)

        self.piece_ranges = [self._owned_range(b) for b in layout.buckets]
        owned_numel = sum(end - start for start, end in self.piece_ranges)
        self.offload = offload
        self.aliased_master = master_dtype == self.dtype and not offload.on_host
        if self.aliased_master:
            self.master_flat = None
            self.master_pieces = [self.flat_params[s:e] for s, e in self.piece_ranges]
        else:
            self.master_flat = offload.allocate(owned_numel, master_dtype, offload.master_device(self.device))
            self.master_pieces = self._split(self.master_flat)
            for piece, (start, end) in zip(self.master_pieces, self.piece_ranges):
                piece.copy_(self.flat_params[start:end])

        size = layout.flat_numel if full_grad_storage else owned_numel
        self.grad_storage = torch.zeros(size, dtype=grad_dtype, device=self.device)
        self.full_grad_storage = full_grad_storage
        self.owned_grads = (
            [self.grad_storage[s:e] for s, e in self.piece_ranges]
            if full_grad_storage
            else self._split(self.grad_storage)
        )
        self._allocate_host_buffers(owned_numel, master_dtype)
        for piece, grad in zip(self.master_pieces, self.host_grad_pieces or self.owned_grads):
            piece.grad = grad if grad.dtype == piece.dtype else None

    def _owned_range(self, bucket: Bucket) -> tuple[int, int]:
        if self.owns_all:
            return bucket.flat_offset, bucket.flat_offset + bucket.padded_numel
        return self.layout.piece_range(bucket, self.rank)

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        pieces, offset = [], 0
        for start, end in self.piece_ranges:
            pieces.append(flat[offset : offset + end - start])
            offset += end - start
        return pieces

    def full_grad_view(self, index: int) -> torch.Tensor:
        """The slice of full-size grad storage that holds parameter `index` (stages 0 and 1)."""
        slot = self.layout.slots[index]
        return self.grad_storage[slot.flat_offset : slot.flat_offset + slot.numel]

    def bucket_grads(self, bucket: Bucket) -> torch.Tensor:
        """The full-size grad storage of one bucket, padding included (stages 0 and 1)."""
        return self.grad_storage[bucket.flat_offset : bucket.flat_offset + bucket.padded_numel]

    def bucket_params(self, bucket: Bucket) -> torch.Tensor:
        return self.flat_params[bucket.flat_offset : bucket.flat_offset + bucket.padded_numel]

    def gather_params(self) -> None:
        """Phase 4's collective: every rank's updated pieces into every rank's flat params (see [Note: gathering
        the pieces])."""
        for work in self.start_gather(0, len(self.layout.buckets)):
            work.wait()

    def start_gather(self, first: int, end: int, comm: CommStream | None = None) -> list[TimedWork]:
        """Launch the gather of buckets [first, end) (their updated pieces already in the flat params) and
        return its works; on a device with streams on `comm`'s stream, which the caller joins after the waits."""
        comm = comm if comm is not None else CommStream(enabled=False)
        buckets = self.layout.buckets[first:end]
        with comm.launching():
            if not self.flat_params.is_cpu:
                return [
                    collectives.all_gather(
                        self.bucket_params(bucket),
                        self.flat_params[start:stop],
                        group=self.process_group,
                        async_op=True,
                    )
                    for bucket, (start, stop) in zip(buckets, self.piece_ranges[first:end])
                ]
            parts = [
                [self.flat_params.narrow(0, *self._start_numel(bucket, r)) for bucket in buckets if bucket.piece_numel]
                for r in range(self.world_size)
            ]
            span = self.flat_params[buckets[0].flat_offset : buckets[-1].flat_offset + buckets[-1].padded_numel]
            return [collectives.all_gather_by_exchange(span, parts, group=self.process_group, async_op=True)]

    def _start_numel(self, bucket: Bucket, rank: int) -> tuple[int, int]:
        start, stop = self.layout.piece_range(bucket, rank)
        return start, stop - start

    def copy_master_to_params(self, *, from_low_precision: bool, span: tuple[int, int] | None = None) -> None:
        """After a step: the updated master pieces [span) (or the optimizer's low-precision copy) into the flat
        params."""
        if self.aliased_master:
            return
        source = self.low_precision_pieces if from_low_precision else self.master_pieces
        first, last = span if span is not None else (0, len(source))
        for piece, (start, end) in zip(source[first:last], self.piece_ranges[first:last]):
            self.flat_params[start:end].copy_(piece, non_blocking=self.offload.on_host)

    def _param_bytes(self) -> int:
        return self.flat_params.numel() * self.flat_params.element_size()
