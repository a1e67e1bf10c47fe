"""Run in DeepSpeed's environment: build a metric index with DeepSpeed's DataAnalyzer, or read one with its
MMapIndexedDataset (written as JSON rows).

    python data_index_in_deepspeed.py build <lengths.json> <save_path>
    python data_index_in_deepspeed.py read <prefix> <out.json> [<prefix> <out.json> ...]
"""

from __future__ import annotations

import json
import sys

import torch


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([self.lengths[index], index % 3])


def build(lengths_file: str, save_path: str) -> None:
    from deepspeed.runtime.data_pipeline.data_sampling.data_analyzer import DataAnalyzer

    with open(lengths_file) as stream:
        lengths = json.load(stream)
    analyzer = DataAnalyzer(_Tokens(lengths), batch_size=3, metric_names=["seqlen"],
                            metric_functions=[lambda batch: batch[:, 0].to(torch.int64)],
                            metric_types=["single_value_per_sample"], metric_dtypes=[torch.int64],
                            save_path=save_path)
    analyzer.run_map()
    analyzer.run_reduce()


def read(pairs: list[str]) -> None:
    from deepspeed.runtime.data_pipeline.data_sampling.indexed_dataset import MMapIndexedDataset

    for prefix, out in zip(pairs[::2], pairs[1::2]):
        dataset = MMapIndexedDataset(prefix, skip_warmup=True)
        with open(out, "w") as stream:
            json.dump({"dtype": str(dataset.dtype.__name__), "rows": [dataset[i].tolist() for i in range(len(dataset))]},
                      stream)


if __name__ == "__main__":
    if sys.argv[1] == "build":
        build(sys.argv[2], sys.argv[3])
    else:
        read(sys.argv[2:])
