"""The training loader with the curriculum sampler (what DeepSpeed's `DeepSpeedDataLoader` is when
`data_efficiency.data_sampling.curriculum_learning` is on), and the sampler's place in checkpoints.

The loader is a torch DataLoader whose `batch_sampler` is the `CurriculumSampler`: each batch is this rank's
share of one micro-batch of the step's global batch. `loader.data_sampler` is the sampler (DeepSpeed's name);
`len(loader)` is the sampler's samples over the micro-batch size, as DeepSpeed's. A post-process function
(`engine.set_data_post_process_func`) gets each batch and the sampler's `state_dict()` (its
`current_difficulties` tell a model how hard the batch is) and returns the batch the engine sees.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, Dataset

from slipstream.config.data_plans import DataSamplingPlan
from slipstream.data.curriculum_sampler import CurriculumSampler

__all__ = ["CurriculumDataLoader", "load_sampler_state", "sampler_state"]

PostProcess = Callable[[Any, dict[str, Any]], Any]


class CurriculumDataLoader(DataLoader):  # type: ignore[type-arg]
    """A DataLoader over `dataset` reading the batches of a `CurriculumSampler` (see the module docstring)."""

    def __init__(
        self,
        dataset: Dataset[Any],
        plan: DataSamplingPlan,
        *,
        micro_batch_size: int,
        rank_and_size: tuple[int, int],
        gradient_accumulation_steps: int,
        drop_last: bool,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        rank, size = rank_and_size
        sampler = CurriculumSampler(
            plan,
            num_samples=len(dataset),  # type: ignore[arg-type]
            micro_batch_size=micro_batch_size,
            rank=rank,
            world_size=size,
            gradient_accumulation_steps=gradient_accumulation_steps,
            drop_last=drop_last,
        )
        super().__init__(dataset, batch_sampler=sampler, num_workers=plan.num_workers, collate_fn=collate_fn)
        self.micro_batch_size = micro_batch_size
        self.post_process_func: PostProcess | None = None

    @property
    def data_sampler(self) -> CurriculumSampler:
        sampler: CurriculumSampler = self.batch_sampler  # type: ignore[assignment]
        return sampler

    def __len__(self) -> int:
        return len(self.data_sampler) // self.micro_batch_size

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator over DataLoader's iterator
        for batch in super().__iter__():
            post = self.post_process_func
            yield batch if post is None else post(batch, self.data_sampler.state_dict())


def _sampler_of(loader: object) -> CurriculumSampler | None:
    sampler = getattr(loader, "data_sampler", None)
    return sampler if isinstance(sampler, CurriculumSampler) else None


def sampler_state(loader: object) -> dict[str, Any] | None:
    """The curriculum sampler's state for a checkpoint (None when `loader` has none)."""
    sampler = _sampler_of(loader)
    return None if sampler is None else sampler.state_dict()


def load_sampler_state(loader: object, state: dict[str, Any] | None) -> None:
    """Put a checkpoint's sampler state back (nothing when either side has no curriculum sampler)."""
    sampler = _sampler_of(loader)
    if sampler is not None and state:
        sampler.load_state_dict(state)
