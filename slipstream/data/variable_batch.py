"""The training side of dynamic batching (data/dynamic_batching.py packs the samples): a batch sampler that
reads this rank's micro-batches of a packing and can resume, and the learning-rate schedule that scales each
step's learning rate by the size of its global batch (see [Note: token groups] there)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from slipstream.config.data_plans import DynamicBatchingPlan
from slipstream.data.dynamic_batching import TokenGroups, group_by_tokens, rank_micro_batches, scale_lr
from slipstream.data.indexed_dataset import IndexedDataset
from slipstream.utils.logging import log_rank0

__all__ = ["VariableBatchSampler", "VariableBatchSizeLR", "seqlens_from_metrics", "variable_batch_loader"]


class VariableBatchSampler:
    """A DataLoader `batch_sampler` over this rank's micro-batches; `state_dict()` holds how many were read in
    the current pass, so a loader built again after `load_state_dict` goes on with the next one."""

    def __init__(self, packing: TokenGroups, *, micro_batch_size: int, rank: int, world_size: int) -> None:
        self.packing = packing
        self.micro_batches = list(
            rank_micro_batches(packing.groups, micro_batch_size=micro_batch_size, rank=rank, world_size=world_size)
        )
        self.position = 0

    def __len__(self) -> int:
        return len(self.micro_batches)

    def __iter__(self) -> Iterator[list[int]]:
        while self.position < len(self.micro_batches):
            self.position += 1  # before the yield: a checkpoint taken after this batch counts it
            yield self.micro_batches[self.position - 1]
        self.position = 0  # the pass is over; the next iteration starts again

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.position = int(state["position"])


class _Schedule(Protocol):
    def step(self, *args: Any) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class VariableBatchSizeLR:
    """The learning rate of step i: the base schedule's (or the optimizer's own, without one) scaled by
    `scale_lr(base_batch_size, batch_sizes[i % len(batch_sizes)], lr, method)`. `step()` moves to the next
    step; `step(0)` goes back to the first (the start of a pass over the loader)."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        base_schedule: _Schedule | None,
        base_batch_size: int,
        batch_sizes: Sequence[int],
        method: str,
    ) -> None:
        self.optimizer, self.base_schedule = optimizer, base_schedule
        self.base_batch_size, self.batch_sizes, self.method = base_batch_size, list(batch_sizes), method
        self.base_lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self.unscaled_lrs = list(self.base_lrs)
        self.last_epoch = 0  # the base schedule is at its first step already: scale for the first batch
        self._scale()

    def step(self, epoch: int | None = None) -> None:
        """Move the base schedule (from the unscaled rates), then scale for the next step's batch."""
        self._set_lrs(self.base_lrs if epoch == 0 else self.unscaled_lrs)
        if self.base_schedule is not None and epoch is None:
            self.base_schedule.step()
        elif self.base_schedule is not None:
            self.base_schedule.step(epoch)
        self.unscaled_lrs = self.get_lr()
        self.last_epoch = self.last_epoch + 1 if epoch is None else epoch
        self._scale()

    def _set_lrs(self, lrs: Sequence[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr

    def _scale(self) -> None:
        size = self.batch_sizes[self.last_epoch % len(self.batch_sizes)]
        self._set_lrs([scale_lr(self.base_batch_size, size, lr, self.method) for lr in self.unscaled_lrs])

    def get_lr(self) -> list[float]:
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def get_last_lr(self) -> list[float]:
        return self.get_lr()

    def state_dict(self) -> dict[str, Any]:
        base = None if self.base_schedule is None else self.base_schedule.state_dict()
        return {"base_schedule": base, "unscaled_lrs": self.unscaled_lrs, "last_epoch": self.last_epoch}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.base_schedule is not None and state.get("base_schedule") is not None:
            self.base_schedule.load_state_dict(state["base_schedule"])
        self.unscaled_lrs = [float(lr) for lr in state["unscaled_lrs"]]
        self.last_epoch = int(state["last_epoch"])
        self._scale()


def seqlens_from_metrics(plan: DynamicBatchingPlan, num_samples: int) -> list[int]:
    """The length of each sample from the data analyzer's `<metrics_path>/seqlen/seqlen_sample_to_metric`."""
    where = "data_efficiency.data_sampling.dynamic_batching.metrics_path"
    if plan.metrics_path is None:
        raise ValueError(f"dynamic batching needs the sample lengths: pass dataset_seqlens, or set {where}")
    prefix = os.path.join(plan.metrics_path, "seqlen", "seqlen_sample_to_metric")
    if not os.path.isfile(prefix + ".idx"):
        raise FileNotFoundError(
            f"{where}: {prefix}.idx/.bin not found; run the data analyzer with a metric named 'seqlen' "
            "(single_value_per_sample) and save_path there, or pass dataset_seqlens"
        )
    rows = IndexedDataset(prefix)
    if len(rows) != num_samples:
        raise ValueError(
            f"{prefix} holds {len(rows)} lengths but the dataset has {num_samples} samples; rerun the analyzer"
        )
    return [int(value) for value in np.concatenate(list(rows))]


def variable_batch_loader(
    dataset: Dataset[Any],
    seqlens: Sequence[int],
    plan: DynamicBatchingPlan,
    *,
    batch_shape: tuple[int, int],
    rank_and_size: tuple[int, int],
    samples: Sequence[int] | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> tuple[DataLoader[Any], TokenGroups]:
    """A loader of this rank's micro-batches of the dataset packed by `plan`. `batch_shape`: (micro-batch size,
    train batch size); without `collate_fn` a batch is the list of its samples (their lengths differ)."""
    micro_batch_size, train_batch_size = batch_shape
    packing = group_by_tokens(
        seqlens,
        max_tokens=plan.max_tokens,
        groups_per_batch=train_batch_size,
        samples=samples,
        min_batch_size=plan.min_batch_size,
        max_batch_size=plan.max_batch_size,
        order=plan.order,
        seed=plan.seed,
    )
    rank, size = rank_and_size
    if plan.verbose:
        _log_packing(packing, seqlens, train_batch_size, rank=rank)
    sampler = VariableBatchSampler(packing, micro_batch_size=micro_batch_size, rank=rank, world_size=size)
    collate = collate_fn if collate_fn is not None else list
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=plan.num_workers)
    return loader, packing


def _log_packing(packing: TokenGroups, seqlens: Sequence[int], groups_per_batch: int, *, rank: int) -> None:
    """One line per global batch: its size, and each group's samples and token count."""
    for index, size in enumerate(packing.batch_sizes):
        groups = packing.groups[index * groups_per_batch : (index + 1) * groups_per_batch]
        described = ", ".join(f"{group} ({sum(seqlens[s] for s in group)} tokens)" for group in groups)
        log_rank0(f"dynamic batching: global batch {index}: {size} samples in groups {described}", rank=rank)
    if packing.left_out:
        log_rank0(f"dynamic batching: samples in no batch: {packing.left_out}", rank=rank)
