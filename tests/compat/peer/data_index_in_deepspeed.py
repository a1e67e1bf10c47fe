"""Run in DeepSpeed's environment, on the jobs in a JSON file (one process: DeepSpeed imports once):
- "build": {"lengths": [...], "save_path": ...}: a metric index ("seqlen") by DeepSpeed's DataAnalyzer;
- "read": [[prefix, out.json], ...]: each index file as DeepSpeed's MMapIndexedDataset reads it;
- "sample": [[config.json, count, out.json], ...]: `count` global batches of DeepSpeed's DeepSpeedDataSampler
  (20 samples, micro-batch 2, one rank, 2 accumulation steps) for the data_efficiency section in config.json.
- "pack": {"lengths": [...], "packings": [{batch_by_seqlens keyword arguments}, ...], "scalings": [[base batch
  size, batch size, base lr, method], ...], "out": out.json}: dynamic batching's packing and LR scaling.

    python data_index_in_deepspeed.py jobs.json
"""

from __future__ import annotations

import json
import os
import sys

import torch


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([self.lengths[index], index % 3])


def build(lengths: list[int], save_path: str) -> None:
    from deepspeed.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer

    analyzer = DataAnalyzer(_Tokens(lengths), batch_size=3, metric_names=["seqlen"],
                            metric_functions=[lambda batch: batch[:, 0].to(torch.int64)],
                            metric_types=["single_value_per_sample"], metric_dtypes=[torch.int64],
                            save_path=save_path)
    analyzer.run_map()
    analyzer.run_reduce()


def read(prefix: str, out: str) -> None:
    from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset

    dataset = MMapIndexedDataset(prefix, skip_warmup=True)
    with open(out, "w") as stream:
        json.dump({"dtype": dataset.dtype.__name__, "rows": [dataset[i].tolist() for i in range(len(dataset))]}, stream)


def sample(config: str, count: int, out: str) -> None:
    import torch.distributed as tdist

    import deepspeed.comm as dist
    from deepspeed.runtime.data_pipeline.data_sampling.data_sampler import DeepSpeedDataSampler

    if not tdist.is_initialized():  # a world of one on a file store (no port)
        tdist.init_process_group("gloo", init_method=f"file://{os.path.abspath('store')}", rank=0, world_size=1)
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    with open(config) as stream:
        section = json.load(stream)
    sampler = DeepSpeedDataSampler(section, 20, 2, 0, 1, tdist.group.WORLD, 2, 0)
    batches = []
    for _ in range(count):
        sampler.get_next_global_batch()
        batches.append([int(x) for x in sampler.batch])
    with open(out, "w") as stream:
        json.dump(batches, stream)


def pack(lengths: list[int], packings: list[dict], scalings: list[list], out: str) -> None:
    from deepspeed.runtime.data_pipeline.data_sampling.variable_batch_size_and_lr import batch_by_seqlens, scale_lr

    packed = [list(batch_by_seqlens(lengths, **kwargs)) for kwargs in packings]
    with open(out, "w") as stream:  # default=int: the ids of a filtered packing are numpy integers
        json.dump({"packings": packed, "scalings": [scale_lr(*args) for args in scalings]}, stream, default=int)


if __name__ == "__main__":
    with open(sys.argv[1]) as jobs_file:
        jobs = json.load(jobs_file)
    if "build" in jobs:
        build(jobs["build"]["lengths"], jobs["build"]["save_path"])
    for prefix, out in jobs.get("read", []):
        read(prefix, out)
    for config, count, out in jobs.get("sample", []):
        sample(config, count, out)
    if "pack" in jobs:
        pack(**jobs["pack"])
