"""Partition math for ZeRO stages 0-2: where each parameter lives in the flat buffers, and who owns what.

[Note: bucket-major layout]
The trainable parameters of one optimizer param group are laid out, in reverse registration order (the
order backward produces their gradients), into *buckets* of at most `bucket_numel` elements; a
parameter larger than that gets a bucket of its own, and a parameter never straddles two buckets. Each
bucket is padded at its end to a multiple of the world size and split into `world_size` equal *pieces*:
rank r owns piece r of every bucket. So
- a bucket's gradient reduce-scatter is one `reduce_scatter_tensor(piece, bucket)` with no packing copy;
- the post-step all-gather is one `all_gather_into_tensor(bucket, piece)`, in place;
- a rank's shard (its master weights, optimizer state and, at stage 2, its gradients) is the
  concatenation of its pieces, one contiguous tensor per param group, 1/world of the group (plus at most
  world-1 padding elements per bucket).
Stage 0 uses the same layout with each rank owning whole buckets.
Everything here is pure arithmetic on shapes: no tensors, no process group.

[Note: buckets by reduce dtype]
Under `torch_autocast` some parameters' gradients are reduced in the autocast dtype and the rest in the ZeRO
reduce dtype (precision/reduce_dtypes.py). A bucket then holds parameters of one reduce dtype only, so that it
is reduced in one collective of one dtype: each dtype fills buckets of its own (as if the parameters of each
dtype were laid out alone), and the buckets are ordered by the position of their last parameter in the
reverse registration order, which is when backward completes them. With one reduce dtype this is the layout
above, bucket for bucket.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True, slots=True)
class ParamSlot:
    """Where one parameter lives: its bucket, and its offset in the flat buffer of its group."""

    index: int
    """Position of the parameter in the group's parameter list (registration order)."""
    numel: int
    bucket: int
    flat_offset: int


@dataclasses.dataclass(frozen=True, slots=True)
class Bucket:
    """A contiguous range of the flat buffer, padded to a multiple of the world size."""

    flat_offset: int
    numel: int
    """Elements used by parameters."""
    padded_numel: int
    piece_numel: int
    """padded_numel / world_size: the slice each rank owns."""
    shard_offset: int
    """Where this bucket's piece starts inside a rank's shard."""
    param_indices: tuple[int, ...]
    reduce_dtype: str | None = None
    """The dtype its gradients are reduced in ("bf16", "fp16"), or None: the ZeRO reduce dtype."""


@dataclasses.dataclass(frozen=True, slots=True)
class GroupLayout:
    """The flat layout of one param group for a given world size (see [Note: bucket-major layout])."""

    world_size: int
    slots: tuple[ParamSlot, ...]
    """Indexed by parameter position in the group."""
    buckets: tuple[Bucket, ...]
    flat_numel: int
    shard_numel: int

    def piece_range(self, bucket: Bucket, rank: int) -> tuple[int, int]:
        """[start, end) in the flat buffer of `rank`'s piece of `bucket`."""
        start = bucket.flat_offset + rank * bucket.piece_numel
        return start, start + bucket.piece_numel


def _bucket_members(
    numels: Sequence[int], reduce_dtypes: Sequence[str | None], bucket_numel: int
) -> list[tuple[str | None, list[int]]]:
    """Parameter indices per bucket, with the bucket's reduce dtype (see [Note: buckets by reduce dtype])."""
    order = list(reversed(range(len(numels))))
    closed: list[tuple[str | None, list[int]]] = []
    filling: dict[str | None, tuple[list[int], int]] = {}
    for index in order:
        dtype, n = reduce_dtypes[index], numels[index]
        current, used = filling.get(dtype, ([], 0))
        if current and used + n > bucket_numel:
            closed.append((dtype, current))
            current, used = [], 0
        filling[dtype] = ([*current, index], used + n)
    closed += [(dtype, current) for dtype, (current, _) in filling.items()]
    position = {index: p for p, index in enumerate(order)}
    return sorted(closed, key=lambda bucket: position[bucket[1][-1]])


def build_layout(
    numels: Sequence[int],
    *,
    world_size: int,
    bucket_numel: int,
    reduce_dtypes: Sequence[str | None] | None = None,
) -> GroupLayout:
    """Lay out parameters with these element counts (registration order) for `world_size` ranks;
    `reduce_dtypes` (per parameter, None: the ZeRO reduce dtype) keeps each bucket to one of them."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if bucket_numel < 1:
        raise ValueError(f"bucket size must be >= 1 element, got {bucket_numel}")
    groups = _bucket_members(numels, reduce_dtypes or [None] * len(numels), bucket_numel)
    slots: dict[int, ParamSlot] = {}
    buckets: list[Bucket] = []
    flat = shard = 0
    for bucket_id, (reduce_dtype, members) in enumerate(groups):
        numel = sum(numels[i] for i in members)
        padded = max(world_size, math.ceil(numel / world_size) * world_size)
        offset = flat
        for i in members:
            slots[i] = ParamSlot(index=i, numel=numels[i], bucket=bucket_id, flat_offset=offset)
            offset += numels[i]
        piece = padded // world_size
        buckets.append(
            Bucket(
                flat_offset=flat,
                numel=numel,
                padded_numel=padded,
                piece_numel=piece,
                shard_offset=shard,
                param_indices=tuple(members),
                reduce_dtype=reduce_dtype,
            )
        )
        flat += padded
        shard += piece
    return GroupLayout(
        world_size=world_size,
        slots=tuple(slots[i] for i in range(len(numels))),
        buckets=tuple(buckets),
        flat_numel=flat,
        shard_numel=shard,
    )


STAGE2_STAGING_BYTES = 8 * 2**20
"""Bytes of gradients one stage-2 reduce-scatter stages at most (see [Note: stage-2 staging bound])."""


def stage2_bucket_numel(reduce_bucket_size: int, grad_bytes: int) -> int:
    """The bucket size stage 2 lays out with: `reduce_bucket_size`, capped at `STAGE2_STAGING_BYTES` of
    gradients.

    [Note: stage-2 staging bound]
    Stage 2 has no full-size gradient storage: a bucket's gradients wait (as autograd produced them) until
    the bucket is complete, are packed into a staging buffer and reduce-scattered, and two staging buffers
    are in use in turn. With DeepSpeed's default `reduce_bucket_size` (5e8 elements) a model of up to 500M
    parameters is a single bucket, so that memory would be up to three times the model's gradients, more
    than stage 1's full-size storage. So stage 2 never reduces more than `STAGE2_STAGING_BYTES` of
    gradients at a time (`reduce_bucket_size` is the most that is reduced at a time, as DeepSpeed
    documents it; smaller values are honoured), and a parameter larger than that is reduce-scattered in
    chunks of that size (`stage2_chunk_numel`). The staging memory is then a few times that bound,
    independent of the model size. Stages 0 and 1 reduce in place and keep `reduce_bucket_size`; a bucket of
    theirs that travels in another dtype than its storage goes through staging buffers within the same bound,
    in chunks (zero/staging.py `StepReducer`).
    """
    return max(1, min(int(reduce_bucket_size), STAGE2_STAGING_BYTES // max(grad_bytes, 1)))


def stage2_chunk_numel(layout: GroupLayout, grad_bytes: int) -> int:
    """Elements per rank of one stage-2 reduce-scatter in this layout: a whole bucket's piece, or for a bucket
    larger than the staging bound (one large parameter) the bound's share per rank."""
    largest_piece = max((b.piece_numel for b in layout.buckets), default=0)
    bound = math.ceil(stage2_bucket_numel(STAGE2_STAGING_BYTES, grad_bytes) / layout.world_size)
    return min(largest_piece, bound)


def bounded_pieces(layouts: Sequence[GroupLayout], default: str, grad_bytes: int) -> dict[str, int]:
    """dtype name -> the elements per rank of the largest reduction in it: the largest piece among the layouts'
    buckets reduced in that dtype (`default` for a bucket without one of its own), capped at the largest chunk
    (`stage2_chunk_numel`), so a staging ring of world x that stays within the staging bound. What the staging
    rings are sized by (zero/staging.py) and the planner counts (planner/reduce_buffers.py)."""
    chunk = max((stage2_chunk_numel(layout, grad_bytes) for layout in layouts), default=0)
    pieces: dict[str, int] = {}
    for bucket in (bucket for layout in layouts for bucket in layout.buckets):
        dtype = bucket.reduce_dtype or default
        pieces[dtype] = max(pieces.get(dtype, 0), min(bucket.piece_numel, chunk))
    return pieces
