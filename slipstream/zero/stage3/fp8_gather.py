"""The float8 all-gather of ZeRO-3: the weights of float8 linear layers travel in float8 (FSDP2's float8 all-gather).

[Note: float8 gather rows]
A unit that holds weights of tensorwise Float8Linear layers (precision/fp8.py `float8_gather_slots`) gathers
them, in the module hooks' gathers, as float8_e4m3fn bytes. Each weight's scale is taken from the whole
weight: every rank measures the largest magnitude of its slice, one small all-reduce (MAX) of those maxima
precedes the gather, and each rank casts its slice with the common scale, so the gathered bytes are the local
cast of the full weight, bit for bit. One rank's row of the gather buffer is raw bytes (int8: gloo has no
float8 collectives):
    [the other parameters' slices, in the unit's dtype] [float8 weights' slices, 1 byte each] [pad to 4] [tag, fp32]
so a float8 weight costs a quarter of its fp32 bytes on the wire (half of bf16). After the gather each float8
weight sits whole in the unit's float8 buffer and its layer's slot holds it with its scale: the forward and
the backward multiply it as it is. The parameter itself (a view of the unit's full buffer) holds the
dequantized values, what the float8 weight stands for. Starting a gather or releasing the unit empties the
slots and frees the float8 buffer; the other gathers (GatheredParameters, persistent units, checkpoints) stay
exact, and the layers then cast the exact weight themselves. The shards, and so the masters, stay exact.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slipstream.comm import collectives
from slipstream.precision.fp8 import E4M3, Float8WeightSlot, cast_scaled_fp8, fp8_scale_of_amax
from slipstream.zero.stage3.units import ShardLayout

_TAG_BYTES = 4


class Float8Rows:
    """The layout of one unit's float8 gather rows (see [Note: float8 gather rows]); `slots` maps the index of
    each float8 weight in the unit to its layer's slot."""

    def __init__(
        self,
        layout: ShardLayout,
        dtype: torch.dtype,
        slots: dict[int, Float8WeightSlot],
        *,
        shapes: list[torch.Size],
        group: dist.ProcessGroup | None,
        device: torch.device,
    ) -> None:
        self.layout, self.dtype, self.slots, self.shapes, self.group = layout, dtype, slots, shapes, group
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self.exact = [i for i in range(len(layout.numels)) if i not in slots]
        self.cast = sorted(slots)
        self.row_offsets: dict[int, int] = {}
        at = 0
        for index in self.exact:  # first, so that each slice's bytes start at a multiple of the dtype's size
            self.row_offsets[index] = at
            at += layout.shard_numels[index] * itemsize
        self.scratch_offsets: dict[int, int] = {}
        for index in self.cast:
            self.row_offsets[index], self.scratch_offsets[index] = at, at - self.row_offsets.get(self.cast[0], at)
            at += layout.shard_numels[index]
        at += -at % max(_TAG_BYTES, itemsize)
        self.row_bytes = at + _TAG_BYTES
        self.padded = sum(layout.shard_numels[index] for index in self.cast)
        """fp32 elements of the scratch buffer `encode` takes (the float8 weights' slices)."""
        self.full_offsets: dict[int, int] = {}
        total = 0
        for index in self.cast:
            self.full_offsets[index] = total
            total += layout.shard_numels[index] * layout.world_size
        self.full = torch.empty(total, dtype=torch.uint8, device=device)
        self.full_bytes = self.full.untyped_storage().nbytes()
        self.full.untyped_storage().resize_(0)
        self.amax = torch.zeros(len(self.cast), dtype=torch.float32, device=device)
        self.scales = torch.ones(len(self.cast), dtype=torch.float32, device=device)
        """The last gather's scale of each float8 weight (a new tensor per gather: the slots hold views of it)."""
        self.itemsize = itemsize

    def encode(self, shard: torch.Tensor, row: torch.Tensor, tag: float, scratch: torch.Tensor) -> None:
        """This rank's row (int8, row_bytes): the exact slices, the float8 slices cast with the whole weights'
        scales (one all-reduce of the slices' maxima first; a collective: every rank of the group calls it),
        then `tag`. `scratch` is fp32, `padded` elements (the caller's, reused)."""
        pieces = []
        for k, index in enumerate(self.cast):
            start, piece = self.layout.shard_offsets[index], self.layout.shard_numels[index]
            values = scratch[self.scratch_offsets[index] : self.scratch_offsets[index] + piece]
            values.copy_(shard[start : start + piece])
            self.amax[k] = torch.linalg.vector_norm(values, ord=float("inf"))
            pieces.append(values)
        collectives.all_reduce(self.amax, group=self.group, op=dist.ReduceOp.MAX)
        self.scales = fp8_scale_of_amax(self.amax, E4M3)
        for k, (index, values) in enumerate(zip(self.cast, pieces)):
            at = self.row_offsets[index]
            cast_scaled_fp8(values.mul_(self.scales[k]), E4M3, out=row[at : at + values.numel()].view(E4M3))
        for index in self.exact:
            start, piece, at = (
                self.layout.shard_offsets[index],
                self.layout.shard_numels[index],
                self.row_offsets[index],
            )
            row[at : at + piece * self.itemsize].view(self.dtype).copy_(shard[start : start + piece])
        row[-_TAG_BYTES:].view(torch.float32)[0] = tag

    def tags(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[:, -_TAG_BYTES:].view(torch.float32)[:, 0]

    def decode(self, rows: torch.Tensor, full: torch.Tensor) -> None:
        """Every rank's row (int8, [world, row_bytes]) into the unit's `full` buffer (the float8 weights
        dequantized) and the float8 buffer, whose weights the slots then hold."""
        world, layout = self.layout.world_size, self.layout
        storage = self.full.untyped_storage()
        if storage.nbytes() != self.full_bytes:
            storage.resize_(self.full_bytes)
        for index in self.exact:
            piece, at, offset = layout.shard_numels[index], self.row_offsets[index], layout.full_offsets[index]
            values = rows[:, at : at + piece * self.itemsize].view(self.dtype)
            full[offset : offset + piece * world].view(world, piece).copy_(values)
        for k, index in enumerate(self.cast):
            piece, at, numel = layout.shard_numels[index], self.row_offsets[index], layout.numels[index]
            whole = self.full[self.full_offsets[index] : self.full_offsets[index] + piece * world]
            whole.view(world, piece).copy_(rows[:, at : at + piece].view(torch.uint8))
            weight = whole[:numel].view(E4M3).view(self.shapes[index])
            offset = layout.full_offsets[index]
            full[offset : offset + numel].copy_(weight.reshape(-1)).div_(self.scales[k])
            self.slots[index].fill(weight, self.scales[k])

    def drop(self) -> None:
        """Empty the slots and free the float8 buffer (the unit's gathered values are gone or being replaced)."""
        for slot in self.slots.values():
            slot.empty()
        self.full.untyped_storage().resize_(0)
