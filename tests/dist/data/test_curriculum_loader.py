"""The curriculum loader at 2 data-parallel ranks: each micro-batch of the step's global batch is split
between the ranks (rank 0 the first half, rank 1 the second), and training on it equals a single process
training on the whole micro-batches (the reference of tests/harness/reference.py)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

import slipstream
from slipstream.data.curriculum_sampler import CurriculumSampler
from slipstream.data.indexed_dataset import write_rows
from tests.harness.dist import distributed
from tests.harness.reference import run_reference

ROWS = {1: [1, 3], 2: [6, 16], 3: [0, 9, 15, 17], 4: [2, 19], 5: [4, 8, 10], 6: [7], 7: [13], 8: [11, 18],
        9: [5, 12, 14]}  # value -> samples (tests/unit/data/test_curriculum_sampler.py's index)
STEPS, MICRO, ACCUMULATION, LR = 3, 2, 2, 0.05


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(1, 1)


def _config(index: Path) -> dict:
    metric = {"index_to_sample_path": str(index / "m_index_to_sample"),
              "index_to_metric_path": str(index / "m_index_to_metric"), "difficulty_type": "value",
              "clustering_type": "schedule_based", "min_difficulty": 2, "max_difficulty": 9,
              "schedule_type": "fixed_discrete", "schedule_config": {"difficulty": [2, 4, 9], "max_step": [1, 2]}}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUMULATION,
            "gradient_clipping": 1.0, "optimizer": {"type": "SGD", "params": {"lr": LR}},
            "data_efficiency": {"enabled": True, "data_sampling": {"enabled": True, "curriculum_learning": {
                "enabled": True, "curriculum_metrics": {"m": metric}}}}}


@distributed(world_size=2)
def test_ranks_share_each_micro_batch_and_train_as_one_process(rank: int, world_size: int, tmp_path: Path) -> None:
    index = tmp_path / f"rank{rank}"  # each rank its own copy of the index: no race on the files
    index.mkdir()
    write_rows(str(index / "m_index_to_sample"), list(ROWS.values()), "uint8")
    write_rows(str(index / "m_index_to_metric"), [[value] for value in ROWS], "uint8")
    data = torch.utils.data.TensorDataset(torch.arange(20, dtype=torch.float32).unsqueeze(1))
    engine, _, loader, _ = slipstream.initialize(model=_model(), config=_config(index), training_data=data)
    stream, mine = iter(loader), []
    for _ in range(STEPS * ACCUMULATION):
        (inputs,) = next(stream)
        engine.backward((engine(inputs) ** 2).mean())
        engine.step()
        mine.append([int(v) for v in inputs[:, 0]])
    shares: list[list[list[int]]] = [[] for _ in range(world_size)]
    dist.all_gather_object(shares, mine)

    whole = CurriculumSampler(engine.plan.schedules.sampling, num_samples=20, micro_batch_size=MICRO * world_size,
                              rank=0, world_size=1, gradient_accumulation_steps=ACCUMULATION)
    expected = [batch for batch, _ in zip(whole, range(STEPS * ACCUMULATION))]
    assert [shares[0][k] + shares[1][k] for k in range(len(expected))] == expected

    def micro_losses(model: torch.nn.Module, step: int) -> list[torch.Tensor]:
        losses = []
        for micro in expected[step * ACCUMULATION:(step + 1) * ACCUMULATION]:
            for share in (micro[:MICRO], micro[MICRO:]):
                losses.append((model(torch.tensor(share, dtype=torch.float32).unsqueeze(1)) ** 2).mean())
        return losses

    reference = run_reference(_model, micro_losses, lr=LR, steps=STEPS, optimizer="sgd", grad_clip=1.0)
    for name, param in engine.module.named_parameters():
        torch.testing.assert_close(param.detach(), reference.params[name], rtol=1e-6, atol=1e-6)
        assert not torch.equal(param.detach(), _model().state_dict()[name])  # it trained
