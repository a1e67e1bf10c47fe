"""`deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr`: DeepSpeed's entry points of
dynamic batching over Slipstream's packing (data/dynamic_batching.py) and loader and LR schedule
(data/variable_batch.py). `get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(dataset, engine)`
reads the engine's `data_efficiency.data_sampling.dynamic_batching` plan; unlike DeepSpeed it also makes the
returned schedule the engine's `lr_scheduler`, so `engine.step()` moves it once per optimizer step and
checkpoints carry it. The pipeline engine's equal-size micro-batches are not built (an error says so).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from slipstream.data.dynamic_batching import group_by_tokens, scale_lr
from slipstream.data.variable_batch import VariableBatchSizeLR, seqlens_from_metrics, variable_batch_loader

__all__ = [
    "VariableBatchSizeLR",
    "batch_by_seqlens",
    "get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed",
    "scale_lr",
]


def batch_by_seqlens(
    seqlens: Sequence[int],
    max_tokens: int,
    sequence_ids_per_mb: Sequence[int] | None = None,
    min_batch_size: int = 1,
    max_batch_size: int | None = None,
    sequence_picking_order: str = "dataloader",
    effective_batch_size: int = 1,
    required_microbatches_of_same_size: bool = False,
    verbose: bool = False,
    seed: int | None = None,
) -> tuple[list[tuple[int, list[int]]], list[int], list[int]]:
    """DeepSpeed's return: ((batch id, sample ids) per group, samples per global batch, longest per batch)."""
    del verbose
    if required_microbatches_of_same_size:
        raise ValueError("batch_by_seqlens: required_microbatches_of_same_size (the pipeline engine's) is not built")
    packing = group_by_tokens(
        seqlens,
        max_tokens=max_tokens,
        groups_per_batch=effective_batch_size,
        samples=sequence_ids_per_mb,
        min_batch_size=min_batch_size,
        max_batch_size=max_batch_size,
        order=sequence_picking_order,
        seed=seed,
    )
    ids = [(index // effective_batch_size, group) for index, group in enumerate(packing.groups)]
    return ids, packing.batch_sizes, packing.batch_max_seqlens


def get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
    dataset: Any,
    engine: Any,
    dataset_seqlens: Sequence[int] | None = None,
    dataset_filter_ids: Sequence[int] | None = None,
    dataloader_collate_fn: Callable[[list[Any]], Any] | None = None,
    sample_padding_fn: Callable[[Any, int], Any] | None = None,
    batch_seqlens_fn: Callable[[Any], Any] | None = None,
) -> tuple[Any, VariableBatchSizeLR, dict[str, Any]]:
    """(loader, LR schedule, the loader's keyword arguments) for `engine`, see the module docstring."""
    del sample_padding_fn, batch_seqlens_fn  # padding: the pipeline engine's; the analyzer is run beforehand here
    plan = engine.plan.schedules.dynamic_batching
    if plan is None:
        raise ValueError(
            "dynamic batching is not enabled; set data_efficiency.data_sampling.dynamic_batching.enabled true "
            "and its max_tokens in the config"
        )
    if type(engine).__name__ == "PipelineEngine":
        raise ValueError("dynamic batching: the pipeline engine's equal-size micro-batches are not built")
    seqlens = dataset_seqlens if dataset_seqlens is not None else seqlens_from_metrics(plan, len(dataset))
    loader, packing = variable_batch_loader(
        dataset,
        seqlens,
        plan,
        batch_shape=(engine.train_micro_batch_size_per_gpu(), engine.train_batch_size()),
        rank_and_size=(engine.get_data_parallel_rank(), engine.get_data_parallel_world_size()),
        samples=dataset_filter_ids,
        collate_fn=dataloader_collate_fn,
    )
    base = engine.lr_scheduler
    optimizer = base.optimizer if base is not None else engine.basic_optimizer
    schedule = VariableBatchSizeLR(
        optimizer,
        base_schedule=base,
        base_batch_size=engine.train_batch_size(),
        batch_sizes=packing.batch_sizes,
        method=plan.lr_scaling_method,
    )
    engine.lr_scheduler = schedule
    kwargs = {"dataset": dataset, "batch_sampler": loader.batch_sampler, "collate_fn": loader.collate_fn}
    return loader, schedule, kwargs
