"""The curriculum sampler of `data_efficiency.data_sampling` (DeepSpeed's `DeepSpeedDataSampler`): a batch
sampler whose global batches come from the samples eligible at the step's difficulties.

[Note: clusters] Each global batch advances the curriculum step (the first batch is step 1) and every metric's
schedule. When a difficulty moves, the samples it newly makes eligible form a new cluster (metric_index.py
says which; with several restricting metrics: the samples eligible under all of them, less those already in
a cluster), shuffled with the sampler's generator. A global batch draws, for each of its samples, a cluster
with probability proportional to the clusters' sizes, takes that many samples from each cluster in order
(a cluster that runs out is shuffled again and read from its start), and shuffles the batch. Micro-batch k
of the global batch is its k-th slice of micro_batch_size * data-parallel-size samples; rank r reads its
r-th share of that slice. The draws follow DeepSpeed's order of calls on one `numpy.random.default_rng(seed)`.

Every rank computes the same batches from the same seed and index (no collective; the index files must be
readable on every rank, as the dataset is). Clusters live in memory, not in `data_cluster_path`; a checkpoint
carries for each cluster the difficulties that made it and the generator states of its shuffles, from which
`load_state_dict` rebuilds it exactly (the state is small JSON data).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from slipstream.config.data_plans import DataSamplingPlan
from slipstream.data.curriculum import CurriculumScheduler
from slipstream.data.metric_index import MetricIndex, Samples

__all__ = ["CurriculumSampler"]


@dataclasses.dataclass
class _Cluster:
    """See [Note: clusters]. `samples` is rebuilt from the other fields on load."""

    previous: dict[str, int | None]
    current: dict[str, int]
    shuffles: list[dict[str, Any]]
    """The generator state before each shuffle of this cluster, in order."""
    samples: Samples
    position: int = 0


class CurriculumSampler:
    """Yields this rank's sample indices, one micro-batch at a time (a DataLoader `batch_sampler`)."""

    def __init__(
        self,
        plan: DataSamplingPlan,
        *,
        num_samples: int,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        gradient_accumulation_steps: int,
        drop_last: bool = True,
    ) -> None:
        if num_samples < 1 or micro_batch_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"curriculum sampler: num_samples {num_samples} and micro_batch_size {micro_batch_size} must be "
                f">= 1 and rank {rank} in [0, {world_size}); pass the dataset's length and this data-parallel rank"
            )
        self.plan = plan
        self.num_samples = num_samples
        self.total_samples = num_samples * plan.num_epochs
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.micro_batch_times_data_parallel_size = micro_batch_size * world_size
        self.global_batch_size = self.micro_batch_times_data_parallel_size * gradient_accumulation_steps
        self.metrics = {metric.name: MetricIndex(metric) for metric in plan.metrics}
        self.curriculum_schedulers = {metric.name: CurriculumScheduler(metric.schedule) for metric in plan.metrics}
        self.rng = np.random.default_rng(plan.seed)
        self.batch: list[int] = []
        self.consumed_samples = 0
        self.curriculum_step = 0
        self.current_difficulties: dict[str, int] = {}
        self.clusters: list[_Cluster] = []
        self.custom_schedules: dict[str, Callable[[int], int]] = {}

    def set_custom_curriculum_learning_schedule(self, schedule_func_dict: Mapping[str, Callable[[int], int]]) -> None:
        """The difficulty functions (curriculum step -> difficulty) of the metrics whose schedule_type is custom."""
        for name, function in schedule_func_dict.items():
            if name in self.curriculum_schedulers:
                self.custom_schedules[name] = function
                self.curriculum_schedulers[name].set_custom_get_difficulty(function)

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        width = self.micro_batch_times_data_parallel_size
        while self.consumed_samples <= self.total_samples:
            if not self.batch:
                self.next_global_batch()
            current, self.batch = self.batch[:width], self.batch[width:]
            if len(current) == width or (current and not self.drop_last):
                self.consumed_samples += len(current)  # before the yield: a checkpoint sees it counted
                begin, end = (round(r * len(current) / self.world_size) for r in (self.rank, self.rank + 1))
                yield current[begin:end]

    def next_global_batch(self) -> list[int]:
        """Advance the curriculum one step and draw its global batch (all ranks' samples) into `self.batch`."""
        unset = [
            n
            for n, s in self.curriculum_schedulers.items()
            if s.plan.schedule_type == "custom" and n not in self.custom_schedules
        ]
        if unset:
            raise RuntimeError(
                f"curriculum metrics {unset} have schedule_type custom but no function; call "
                "engine.set_custom_curriculum_learning_schedule({name: step -> difficulty}) before training"
            )
        self.curriculum_step += 1
        previous: dict[str, int | None] = {}
        moved = False
        for name, scheduler in self.curriculum_schedulers.items():
            difficulty = scheduler.update_difficulty(self.curriculum_step)  # stops moving at max_difficulty
            moved = moved or self.current_difficulties.get(name) != difficulty
            previous[name] = self.current_difficulties.get(name, self.metrics[name].start())
            self.current_difficulties[name] = difficulty
        if moved:
            self._add_cluster(previous, dict(self.current_difficulties))
        if not self.clusters:
            raise RuntimeError(
                f"curriculum sampler: no sample is eligible at difficulties {self.current_difficulties} (step "
                f"{self.curriculum_step}); raise the metrics' min_difficulty or check the metric index"
            )
        sizes = [len(cluster.samples) for cluster in self.clusters]
        weights = [size / sum(sizes) for size in sizes]
        picks = self.rng.choice(len(self.clusters), self.global_batch_size, replace=True, p=weights)
        batch: list[int] = []
        for index, count in enumerate(np.bincount(picks, minlength=len(self.clusters))):
            batch += self._take(self.clusters[index], int(count))
        self.rng.shuffle(batch)  # a list, as DeepSpeed's (its shuffle draws as for an array)
        self.batch = [int(sample) for sample in batch]
        return self.batch

    def _add_cluster(self, previous: dict[str, int | None], current: dict[str, int]) -> None:
        samples = self._cluster_samples(previous, current)
        if samples is None or len(samples) == 0:
            return
        cluster = _Cluster(previous=previous, current=current, shuffles=[], samples=samples)
        self._shuffle(cluster)
        self.clusters.append(cluster)

    def _cluster_samples(self, previous: Mapping[str, int | None], current: Mapping[str, int]) -> Samples | None:
        """The samples a move from `previous` to `current` adds (None: none), see [Note: clusters]."""
        restricting = [name for name, index in self.metrics.items() if index.restricts]
        if len(restricting) > 1:
            samples = np.arange(self.num_samples, dtype=np.int64)
            for name in restricting:  # a single-cluster metric's whole range changes no intersection
                eligible = self.metrics[name].eligible(self.metrics[name].start(), current[name])
                samples = np.intersect1d(samples, eligible, assume_unique=True)
            for cluster in self.clusters:
                samples = np.setdiff1d(samples, cluster.samples, assume_unique=True)
            return samples
        if restricting:
            name = restricting[0]
            return self.metrics[name].eligible(previous[name], current[name])
        return None if self.clusters else np.arange(self.num_samples, dtype=np.int64)

    def _shuffle(self, cluster: _Cluster) -> None:
        cluster.shuffles.append(dict(self.rng.bit_generator.state))
        self.rng.shuffle(cluster.samples)

    def _take(self, cluster: _Cluster, count: int) -> list[int]:
        """`count` samples from the cluster's position on; past its end, shuffle it and go on from its start."""
        taken = list(cluster.samples[cluster.position : cluster.position + count])
        cluster.position += count
        if len(taken) < count:
            missing = count - len(taken)
            self._shuffle(cluster)
            taken += list(cluster.samples[:missing])
            cluster.position = missing
        return taken

    # ---- checkpoints ----
    def state_dict(self) -> dict[str, Any]:
        """JSON data: where the sampler is and how to rebuild its clusters (see [Note: clusters])."""
        return {
            "batch": list(self.batch),
            "consumed_samples": self.consumed_samples,
            "curriculum_step": self.curriculum_step,
            "current_difficulties": dict(self.current_difficulties),
            "np_rng_state": self.rng.bit_generator.state,
            "clusters": [
                {"previous": c.previous, "current": c.current, "shuffles": c.shuffles, "position": c.position}
                for c in self.clusters
            ],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue exactly where `state_dict()` was taken (same index and plan)."""
        self.batch = [int(sample) for sample in state["batch"]]
        self.consumed_samples = int(state["consumed_samples"])
        self.curriculum_step = int(state["curriculum_step"])
        self.current_difficulties = {name: int(value) for name, value in state["current_difficulties"].items()}
        for name, difficulty in self.current_difficulties.items():
            self.curriculum_schedulers[name].set_current_difficulty(difficulty)
        self.clusters = []
        for record in state["clusters"]:
            samples = self._cluster_samples(record["previous"], record["current"])
            assert samples is not None  # a saved cluster had samples
            for generator_state in record["shuffles"]:
                replay = np.random.default_rng()
                replay.bit_generator.state = generator_state
                replay.shuffle(samples)
            cluster = _Cluster(dict(record["previous"]), dict(record["current"]), list(record["shuffles"]), samples)
            cluster.position = int(record["position"])
            self.clusters.append(cluster)
        self.rng.bit_generator.state = state["np_rng_state"]
