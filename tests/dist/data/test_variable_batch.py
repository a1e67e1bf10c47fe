"""Dynamic batching at 2 data-parallel ranks: rank r reads token groups r, r + 2, ... (one group a micro-batch
here), each step's learning rate is scaled by its global batch's sample count, and the trained weight equals
SGD worked out in one process from the same groups and rates."""

from __future__ import annotations

import torch
import torch.distributed as dist

import slipstream
from slipstream.compat.variable_batch_size_and_lr import (
    get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed as variable_batches,
)
from tests.harness.dist import distributed

LENGTHS = [5, 3, 8, 2, 7, 4, 6, 1, 9, 3, 2, 5, 4, 8, 1, 6, 3, 7, 2, 4]  # tests/unit/data/test_dynamic_batching.py
GROUPS = [[0, 1], [2, 3], [4], [5, 6], [7, 8], [9, 10, 11], [12], [13, 14], [15, 16], [17, 18]]  # max_tokens 10
LR = 0.1


class _Mean(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))

    def forward(self, samples: list[torch.Tensor]) -> torch.Tensor:
        return (torch.cat(samples).mean() * self.weight).sum()


def _token_mean(group: list[int]) -> float:
    """The loss's gradient on a group: the mean over its tokens (sample i's tokens all hold the value i)."""
    return sum(i * LENGTHS[i] for i in group) / sum(LENGTHS[i] for i in group)


@distributed(world_size=2)
def test_ranks_read_interleaved_groups_at_scaled_rates(rank: int, world_size: int) -> None:
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": LR}},
              "data_efficiency": {"data_sampling": {"dynamic_batching": {"enabled": True, "max_tokens": 10}}}}
    engine, *_ = slipstream.initialize(model=_Mean(), config=config)
    dataset = [torch.full((length,), float(index)) for index, length in enumerate(LENGTHS)]
    loader, _, _ = variable_batches(dataset, engine, dataset_seqlens=LENGTHS, dataloader_collate_fn=list)
    mine, rates = [], []
    for samples in loader:
        mine.append([int(sample[0]) for sample in samples])
        rates.append(engine.get_lr()[0])
        engine.backward(engine(samples))
        engine.step()
    assert mine == GROUPS[rank::world_size]
    weight = 1.0
    for step in range(len(GROUPS) // world_size):
        pair = GROUPS[world_size * step : world_size * (step + 1)]
        rate = LR * sum(len(group) for group in pair) / world_size
        assert rates[step] == rate
        weight -= rate * sum(_token_mean(group) for group in pair) / world_size  # the ranks' mean gradient
    torch.testing.assert_close(engine.module.weight.detach(), torch.tensor([weight]), rtol=1e-6, atol=1e-6)
    dist.barrier()
