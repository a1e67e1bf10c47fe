"""A model with nn.Embedding(sparse=True) / nn.EmbeddingBag(sparse=True) trains at every ZeRO stage: its sparse
gradient (the rows looked up) is taken into the dense gradient storage, so training equals the same model built
with sparse=False (it raised "reshape is not implemented for sparse tensors" before)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import slipstream


class Lookup(nn.Module):
    def __init__(self, *, sparse: bool, bag: bool) -> None:
        super().__init__()
        self.bag = bag
        self.table = nn.EmbeddingBag(40, 6, sparse=sparse) if bag else nn.Embedding(40, 6, sparse=sparse)
        self.head = nn.Linear(6, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.table(ids) if self.bag else self.table(ids).mean(1)
        return self.head(rows).square().mean()


def _train(stage: int, *, sparse: bool, bag: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Lookup(sparse=sparse, bag=bag)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 0.05}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = slipstream.initialize(model=model, config=config)
    try:
        generator = torch.Generator().manual_seed(1)
        for _ in range(6):  # 3 optimizer steps of 2 micro-batches
            engine.backward(engine(torch.randint(0, 40, (2, 5), generator=generator)))
            engine.step()
        with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
            return {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    finally:
        engine.destroy()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_sparse_embedding_gradients_train_as_their_dense_twin(stage: int) -> None:
    for bag in (False, True):
        dense, sparse = _train(stage, sparse=False, bag=bag), _train(stage, sparse=True, bag=bag)
        assert not torch.equal(dense["table.weight"], _initial(bag)), "the table did not train"
        for name, value in dense.items():
            torch.testing.assert_close(sparse[name], value, rtol=0, atol=1e-6, msg=f"stage {stage} {name}")


def _initial(bag: bool) -> torch.Tensor:
    torch.manual_seed(0)
    return Lookup(sparse=False, bag=bag).table.weight.detach()
