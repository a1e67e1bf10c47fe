"""Dynamic batching (`data_efficiency.data_sampling.dynamic_batching`, DeepSpeed's variable batch size and LR):
samples packed into groups by their token counts, and the learning rate of each global batch scaled by its size.

[Note: token groups] The samples are taken in the picking order ("dataloader": dataset order; "seqlen": by
length, then index; "random": shuffled by Python's `random.Random(seed)`, as DeepSpeed shuffles). A sample
longer than max_tokens is left out. Each group takes the following samples while its token total stays <=
max_tokens and its size <= max_batch_size; a group that cannot reach min_batch_size ends the packing (the
samples after it are left out, as in DeepSpeed). A group is one entry of a training micro-batch: a micro-batch
holds micro_batch_size groups, and global batch i is groups [i * G, (i + 1) * G) with G the train batch size
(micro-batch size x gradient accumulation x data-parallel size); the groups past the last whole global batch
are dropped. Rank r reads groups r, r + dp, r + 2 dp, ... (DeepSpeed's un-shuffled DistributedSampler), so its
k-th micro-batch is its groups [k * micro, (k + 1) * micro).

The size of global batch i is its number of samples; the learning rate of step i is the base schedule's times
the scaling of that size against the reference size G: linear (size / G), sqrt (sqrt(size / G)) or none.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator, Sequence

__all__ = ["TokenGroups", "group_by_tokens", "scale_lr", "rank_micro_batches"]

PICKING_ORDERS = ("dataloader", "seqlen", "random")
LR_SCALING_METHODS = ("linear", "sqrt", "none")


@dataclasses.dataclass(frozen=True)
class TokenGroups:
    """The packing of a dataset, see [Note: token groups]."""

    groups: list[list[int]]
    """The sample indices of each group, in order (a whole number of global batches)."""
    batch_sizes: list[int]
    """The number of samples of each global batch."""
    batch_max_seqlens: list[int]
    """The longest sample of each global batch."""
    left_out: list[int]
    """Samples in no group: longer than max_tokens, or after the packing ended, or past the last global batch."""


def _picking_order(seqlens: Sequence[int], samples: Sequence[int], order: str, seed: int | None) -> list[int]:
    if order not in PICKING_ORDERS:
        raise ValueError(
            f"data_efficiency.data_sampling.dynamic_batching.sequence_picking_order: {order!r} is not one of "
            f"{PICKING_ORDERS}"
        )
    picked = list(samples)
    if order == "seqlen":
        picked.sort(key=lambda sample: (seqlens[sample], sample))
    elif order == "random":
        random.Random(seed).shuffle(picked)  # the permutation DeepSpeed's shuffle of (length, sample) pairs makes
    return picked


def group_by_tokens(
    seqlens: Sequence[int],
    *,
    max_tokens: int,
    groups_per_batch: int,
    samples: Sequence[int] | None = None,
    min_batch_size: int = 1,
    max_batch_size: int | None = None,
    order: str = "dataloader",
    seed: int | None = None,
) -> TokenGroups:
    """Pack `samples` (default: all) into groups of at most `max_tokens` tokens, see [Note: token groups]."""
    picked = _picking_order(seqlens, range(len(seqlens)) if samples is None else samples, order, seed)
    left_out = [sample for sample in picked if seqlens[sample] > max_tokens]
    picked = [sample for sample in picked if seqlens[sample] <= max_tokens]
    groups: list[list[int]] = []
    start = 0
    while start < len(picked):
        end, tokens = start, 0
        while end < len(picked) and (max_batch_size is None or end - start < max_batch_size):
            if tokens + seqlens[picked[end]] > max_tokens:
                break
            tokens += seqlens[picked[end]]
            end += 1
        if end - start < max(min_batch_size, 1):
            break
        groups.append(picked[start:end])
        start = end
    left_out += picked[start:]
    if len(groups) < groups_per_batch:
        raise ValueError(
            f"dynamic batching: {len(picked)} samples of at most max_tokens={max_tokens} tokens make {len(groups)} "
            f"groups, fewer than one global batch needs ({groups_per_batch}: the train batch size); raise max_tokens "
            "or give more samples"
        )
    whole = len(groups) - len(groups) % groups_per_batch
    left_out += [sample for group in groups[whole:] for sample in group]
    groups = groups[:whole]
    batches = [groups[i : i + groups_per_batch] for i in range(0, whole, groups_per_batch)]
    return TokenGroups(
        groups=groups,
        batch_sizes=[sum(len(group) for group in batch) for batch in batches],
        batch_max_seqlens=[max(seqlens[sample] for group in batch for sample in group) for batch in batches],
        left_out=left_out,
    )


def scale_lr(base_batch_size: int, batch_size: int, base_lr: float = 1.0, method: str | None = "linear") -> float:
    """The learning rate for `batch_size` samples when `base_lr` is the one for `base_batch_size` samples."""
    if method == "linear":
        return base_lr * batch_size / base_batch_size
    if method == "sqrt":
        return base_lr * math.sqrt(batch_size / base_batch_size)
    if method is None or method.lower() == "none":
        return base_lr
    raise ValueError(
        f"data_efficiency.data_sampling.dynamic_batching.lr_scaling_method: {method!r} is not one of "
        f"{LR_SCALING_METHODS}"
    )


def rank_micro_batches(
    groups: Sequence[list[int]], *, micro_batch_size: int, rank: int, world_size: int
) -> Iterator[list[int]]:
    """This rank's micro-batches (the samples of its groups r, r + dp, ..., micro_batch_size groups at a time)."""
    mine = list(groups[rank::world_size])
    for begin in range(0, len(mine), micro_batch_size):
        yield [sample for group in mine[begin : begin + micro_batch_size] for sample in group]
