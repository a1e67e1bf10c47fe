"""The data analyzer (DeepSpeed's `DataAnalyzer`): runs metric functions over a dataset and writes the metric
indexes the curriculum sampler reads, in DeepSpeed's files (indexed_dataset.py), so either side reads the
other's.

Map: the dataset is cut into `num_workers` contiguous parts, each part into `num_threads` (the threads run one
after another here, writing the same files). A worker-thread feeds its samples in batches of `batch_size` to
each metric function, which returns one integer per sample (`single_value_per_sample`) or a tensor to sum
(`accumulate_value_over_samples`), and writes under `<save_path>/<metric>/worker<w>_thread<t>/`:
`<metric>_sample_to_metric` (one row per sample, its value) and `<metric>_metric_to_sample_<value>.csv` (the
samples of each value), or `<metric>_metric_value` (the sum).
Reduce (worker 0, after every map): under `<save_path>/<metric>/`, `<metric>_sample_to_metric` (every sample's
value, in dataset order), `<metric>_index_to_sample` (row i: the samples of the i-th smallest value),
`<metric>_index_to_metric` (row i: that value), `<metric>_index_to_sample_percentile_merged` (the rows in
about 100 groups), or the summed `<metric>_metric_value`. Values are stored in the narrowest integer dtype
that holds them, sample indices in the narrowest that holds the dataset's length.
A sample's index is its position in the dataset, or `sample_indices[position]`, or, for a dict batch with an
`index` field (Megatron's), `batch["index"][row][0]`.
"""

from __future__ import annotations

import csv
import dataclasses
import os
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, Dataset, default_collate

from slipstream.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter, smallest_int_dtype, write_rows

__all__ = ["MetricAnalyzer"]

MetricFunction = Callable[[Any], Any]
_PER_SAMPLE, _SUM = "single_value_per_sample", "accumulate_value_over_samples"


@dataclasses.dataclass
class _Partial:
    """One metric's map output of one worker-thread while it is being written."""

    folder: str
    name: str
    dtype: Any
    kind: str
    values: IndexedDatasetWriter | None = None
    samples_of: dict[int, list[int]] = dataclasses.field(default_factory=lambda: defaultdict(list))
    total: torch.Tensor | None = None

    def flush(self, limit: int) -> None:
        """Append the sample lists longer than `limit` to their value's CSV file."""
        for value, samples in self.samples_of.items():
            if len(samples) > limit:
                with open(f"{self.folder}/{self.name}_metric_to_sample_{value}.csv", "a", newline="") as stream:
                    csv.writer(stream).writerow(samples)
                self.samples_of[value] = []


class MetricAnalyzer:
    """Map metric functions over a dataset and reduce their results into metric indexes (module docstring)."""

    def __init__(  # DeepSpeed's DataAnalyzer signature (the hooks replace the map/reduce steps, as there)
        self,
        dataset: Dataset[Any],
        num_workers: int = 1,
        worker_id: int = 0,
        num_threads: int = 1,
        num_threads_reduce: int = 1,
        specific_threads: Sequence[int] = (),
        batch_size: int = 1,
        metric_names: Sequence[str] = (),
        metric_functions: Sequence[MetricFunction] = (),
        metric_types: Sequence[str] = (),
        metric_dtypes: Sequence[Any] = (),
        save_path: str = "./",
        collate_fn: Callable[[list[Any]], Any] | None = None,
        custom_map_init: Callable[..., Any] | None = None,
        custom_map_update: Callable[..., Any] | None = None,
        custom_map_finalize: Callable[..., Any] | None = None,
        custom_reduce: Callable[..., Any] | None = None,
        sample_indices: Sequence[int] | None = None,
    ) -> None:
        lengths = {len(metric_names), len(metric_functions), len(metric_types), len(metric_dtypes)}
        if len(lengths) != 1 or any(kind not in (_PER_SAMPLE, _SUM) for kind in metric_types):
            raise ValueError(
                f"data analyzer: metric_names {list(metric_names)}, metric_functions, metric_types "
                f"{list(metric_types)} and metric_dtypes need one entry per metric, each type {_PER_SAMPLE!r} or "
                f"{_SUM!r}"
            )
        self.dataset, self.num_workers, self.worker_id = dataset, num_workers, worker_id
        self.num_threads, self.specific_threads, self.batch_size = num_threads, list(specific_threads), batch_size
        self.num_threads_reduce = num_threads_reduce  # the reduce runs in one process; its files are the same
        self.metric_names, self.metric_functions = list(metric_names), list(metric_functions)
        self.metric_types, self.metric_dtypes = list(metric_types), list(metric_dtypes)
        self.save_path, self.collate_fn, self.sample_indices = save_path, collate_fn, sample_indices
        self.custom_map_init, self.custom_map_update = custom_map_init, custom_map_update
        self.custom_map_finalize, self.custom_reduce = custom_map_finalize, custom_reduce

    # ---- map ----
    def thread_range(self, thread_id: int) -> tuple[int, int]:
        """The samples [begin, end) of this worker's thread `thread_id`."""
        size = len(self.dataset)  # type: ignore[arg-type]
        workers = np.linspace(0, size, num=self.num_workers + 1).astype(np.int64)  # cut down, as DeepSpeed's
        begin, end = workers[self.worker_id], workers[self.worker_id + 1]
        threads = np.linspace(begin, end, num=self.num_threads + 1).astype(np.int64)
        return int(threads[thread_id]), int(threads[thread_id + 1])

    def run_map(self) -> None:
        for thread_id in self.specific_threads or range(self.num_threads):
            self._map_thread(thread_id)

    def _map_thread(self, thread_id: int) -> None:
        begin, end = self.thread_range(thread_id)
        args = (thread_id, self.metric_names, self.metric_types, self.metric_dtypes, self.save_path, self.worker_id)
        results = (self.custom_map_init or self._partials)(*args)
        collate = self.collate_fn or default_collate
        for indices in BatchSampler(range(begin, end), batch_size=self.batch_size, drop_last=False):
            data = collate([self.dataset[index] for index in indices])
            if self.custom_map_update is not None:
                self.custom_map_update(
                    data, self.metric_types, self.metric_dtypes, self.metric_functions, results, indices[0]
                )
            else:
                self._update(data, results, indices)
        if self.custom_map_finalize is not None:
            self.custom_map_finalize(self.metric_types, self.metric_dtypes, results)
        else:
            self._finalize(results)

    def _partials(
        self, thread_id: int, names: list[str], kinds: list[str], dtypes: list[Any], save_path: str, worker: int
    ) -> list[_Partial]:
        partials = []
        for name, kind, dtype in zip(names, kinds, dtypes):
            folder = f"{save_path}/{name}/worker{worker}_thread{thread_id}"
            os.makedirs(folder, exist_ok=True)
            for stale in os.listdir(folder):
                if stale.startswith(f"{name}_metric_to_sample_"):
                    os.remove(os.path.join(folder, stale))
            partial = _Partial(folder, name, dtype, kind)
            if kind == _PER_SAMPLE:
                partial.values = IndexedDatasetWriter(f"{folder}/{name}_sample_to_metric", _numpy_dtype(dtype))
            partials.append(partial)
        return partials

    def _update(self, data: Any, partials: list[_Partial], indices: list[int]) -> None:
        for function, partial in zip(self.metric_functions, partials):
            values = _checked(function(data), partial)
            if partial.kind == _SUM:
                partial.total = values.clone() if partial.total is None else partial.total.add_(values)
                continue
            assert partial.values is not None
            for row in range(values.shape[0]):
                partial.values.add(values[row].reshape(-1).numpy())
                partial.samples_of[int(values[row].item())].append(self._sample_index(data, indices, row))
            partial.flush(100)

    def _sample_index(self, data: Any, indices: list[int], row: int) -> int:
        if isinstance(data, dict) and "index" in data:
            return int(data["index"][row][0])
        if self.sample_indices is not None:
            return int(self.sample_indices[indices[row]])
        return int(indices[row])

    def _finalize(self, partials: list[_Partial]) -> None:
        for partial in partials:
            if partial.values is not None:
                partial.values.finish()
                partial.flush(0)
            elif partial.total is not None:
                write_rows(
                    f"{partial.folder}/{partial.name}_metric_value",
                    [partial.total.numpy()],
                    _numpy_dtype(partial.dtype),
                )

    # ---- reduce ----
    def run_reduce(self) -> None:
        if self.custom_reduce is not None:
            self.custom_reduce(
                self.dataset,
                self.metric_names,
                self.metric_types,
                self.save_path,
                self.num_workers,
                self.num_threads,
                self.num_threads_reduce,
            )
            return
        for name, kind in zip(self.metric_names, self.metric_types):
            folder = f"{self.save_path}/{name}"
            if kind == _PER_SAMPLE:
                self._reduce_per_sample(folder, name)
            else:
                self._reduce_sum(folder, name)

    def _map_folders(self, folder: str) -> list[str]:
        return [
            f"{folder}/worker{worker}_thread{thread}"
            for worker in range(self.num_workers)
            for thread in range(self.num_threads)
        ]

    def _reduce_per_sample(self, folder: str, name: str) -> None:
        parts = [IndexedDataset(f"{part}/{name}_sample_to_metric") for part in self._map_folders(folder)]
        count = sum(len(part) for part in parts)
        if count != len(self.dataset):  # type: ignore[arg-type]
            raise RuntimeError(
                f"data analyzer reduce of metric {name!r}: the map files under {folder} hold {count} samples, the "
                f"dataset {len(self.dataset)}; a map worker did not finish: run its run_map() again"  # type: ignore[arg-type]
            )
        every = [row for part in parts for row in part]
        values = np.concatenate(every).astype(np.int64) if every else np.zeros(0, dtype=np.int64)
        value_dtype = smallest_int_dtype(int(values.min()), int(values.max()))
        write_rows(f"{folder}/{name}_sample_to_metric", every, value_dtype)
        sample_dtype = smallest_int_dtype(0, len(self.dataset) - 1)  # type: ignore[arg-type]
        rows = [self._samples_of(folder, name, int(value)) for value in np.unique(values)]
        write_rows(f"{folder}/{name}_index_to_sample", rows, sample_dtype)
        write_rows(f"{folder}/{name}_index_to_metric", [[value] for value in np.unique(values)], value_dtype)
        step = max(1, len(rows) // 100)
        merged = [np.concatenate(rows[first : first + step]) for first in range(0, len(rows), step)]
        write_rows(f"{folder}/{name}_index_to_sample_percentile_merged", merged, sample_dtype)

    def _samples_of(self, folder: str, name: str, value: int) -> list[int]:
        samples: list[int] = []
        for part in self._map_folders(folder):
            path = f"{part}/{name}_metric_to_sample_{value}.csv"
            if os.path.isfile(path):
                with open(path, newline="") as stream:
                    samples += [int(cell) for line in csv.reader(stream) for cell in line]
        return samples

    def _reduce_sum(self, folder: str, name: str) -> None:
        total = None
        for part in self._map_folders(folder):
            value = IndexedDataset(f"{part}/{name}_metric_value")[0].astype(np.int64)
            total = value if total is None else total + value
        assert total is not None
        write_rows(f"{folder}/{name}_metric_value", [total], smallest_int_dtype(int(total.min()), int(total.max())))

    def run_map_reduce(self, comm_group: dist.ProcessGroup | None = None) -> None:
        """Map this worker's part, wait for every worker, reduce on worker 0, wait again (the barriers only
        when torch.distributed is initialized: the workers are its ranks)."""
        self.run_map()
        if dist.is_initialized():
            dist.barrier(group=comm_group)
        if self.worker_id == 0:
            self.run_reduce()
        if dist.is_initialized():
            dist.barrier(group=comm_group)


def _numpy_dtype(dtype: Any) -> np.dtype[Any]:
    """A metric dtype given as a numpy or a torch integer type, as numpy's."""
    if isinstance(dtype, torch.dtype):
        return np.dtype(torch.empty(0, dtype=dtype).numpy().dtype)
    return np.dtype(dtype)


def _checked(values: Any, partial: _Partial) -> torch.Tensor:
    """The metric function's result as a CPU tensor, after checking its type and dtype as DeepSpeed does."""
    if isinstance(values, np.ndarray):
        values_dtype: Any = values.dtype
        values = torch.from_numpy(values)
    elif isinstance(values, torch.Tensor):
        values_dtype = values.dtype
    else:
        raise TypeError(
            f"data analyzer metric {partial.name!r}: its function returned {type(values).__name__}; return a tensor "
            "or a numpy array (one value per sample for single_value_per_sample)"
        )
    if values_dtype != partial.dtype:
        raise TypeError(
            f"data analyzer metric {partial.name!r}: its function returned dtype {values_dtype}, its metric_dtype "
            f"is {partial.dtype}; return that dtype or change metric_dtypes"
        )
    return values.cpu()
