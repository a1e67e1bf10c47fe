"""sparse_gradients at ZeRO stage 0 (zero/sparse_rows.py): at 2 ranks the parameters after three steps (two
micro-batches each, overlapping rows across ranks) equal those of the same run with dense all-reduces. An
nn.Embedding (sparse=True) and an nn.EmbeddingBag (sparse=False) of 64 rows, 6 of them looked up per rank, go as rows
(fewer bytes); a 4-row table whose every row is looked up would not shrink and is all-reduced dense."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from tests.harness import run_distributed

ROWS, WIDTH, STEPS = 64, 8, 3


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.bag = nn.Embedding(ROWS, WIDTH, sparse=True), nn.EmbeddingBag(ROWS, WIDTH, mode="sum")
        self.small, self.head = nn.Embedding(4, WIDTH), nn.Linear(WIDTH, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens).mean(dim=1) + self.bag(tokens) + self.small(torch.arange(4)).sum(dim=0)
        return self.head(hidden).pow(2).mean()


def _train(rank: int, sparse: bool) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    import slipstream
    from slipstream.comm import count_collectives

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
        "zero_optimization": {"stage": 0},
        "sparse_gradients": sparse,
    }
    model = _Tokens()
    engine, *_ = slipstream.initialize(model=model, model_parameters=model.parameters(), config=config)
    gen = torch.Generator().manual_seed(rank)
    with count_collectives() as counter:
        for _ in range(2 * STEPS):  # rank 0 looks up rows 0-5, rank 1 rows 3-8
            engine.backward(engine(torch.randint(3 * rank, 3 * rank + 6, (2, 5), generator=gen)))
            engine.step()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine.destroy()
    return params, dict(counter.bytes)


def sparse_case(rank: int, world: int) -> tuple[dict[str, int], dict[str, int]]:
    dense_params, dense_bytes = _train(rank, False)
    sparse_params, sparse_bytes = _train(rank, True)
    for name, value in dense_params.items():
        torch.testing.assert_close(sparse_params[name], value, rtol=0, atol=1e-7, msg=name)
    return dense_bytes, sparse_bytes


def test_sparse_rows_equal_the_dense_reduce_with_fewer_bytes(tmp_path: object) -> None:
    for dense, sparse in run_distributed(sparse_case, world_size=2):
        print("bytes per rank: dense", dense, "sparse", sparse)
        assert sparse.get("all_gather", 0) > 0  # the 64-row tables went as rows
        # the dense all-reduces lost exactly the two 64-row tables: the 4-row one stayed in them
        assert sparse["all_reduce"] == dense["all_reduce"] - STEPS * 2 * ROWS * WIDTH * 4
        assert sum(sparse.values()) < 0.6 * sum(dense.values()), (dense, sparse)


def test_sparse_gradients_is_reported_above_stage_0() -> None:
    from slipstream.config.resolve import resolve

    base = {"train_batch_size": 2, "sparse_gradients": True}
    assert resolve({**base, "zero_optimization": {"stage": 0}}, world_size=1).zero.sparse_gradients
    with pytest.warns(UserWarning, match="sparse_gradients has no effect at zero_optimization.stage 2"):
        plan = resolve({**base, "zero_optimization": {"stage": 2}}, world_size=1)
    assert not plan.zero.sparse_gradients
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not resolve({"train_batch_size": 2}, world_size=1).zero.sparse_gradients
