"""The training DataLoader of `initialize(training_data=...)`: one shard of the data per data-parallel rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


def make_training_dataloader(
    dataset: Dataset,
    *,
    micro_batch_size: int,
    rank: int,
    world_size: int,
    drop_last: bool,
    collate_fn: Callable[[list[object]], object] | None,
    seed: int = 0,
) -> DataLoader:
    """A DataLoader over `dataset` with a DistributedSampler (shuffled, seeded) for this rank."""
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=drop_last
    )
    return DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn, drop_last=drop_last)


class RepeatingLoader:
    """Iterate `loader` forever: when it is exhausted, start it again (DeepSpeed's `RepeatingLoader`)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.data_iter = iter(self.loader)

    def __iter__(self) -> RepeatingLoader:
        return self

    def __next__(self) -> Any:
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
