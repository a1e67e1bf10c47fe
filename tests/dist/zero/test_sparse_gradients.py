"""sparse_gradients at ZeRO stage 0 (zero/sparse_rows.py): at 2 ranks the parameters after three steps (two
micro-batches each, overlapping rows across ranks) equal those of the same run with dense all-reduces, an
nn.Embedding and an nn.EmbeddingBag (both sparse=False) reduced as rows; the bytes exchanged are fewer when few
rows are touched, and a batch that touches every row is all-reduced dense (same bytes as the dense run)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from tests.harness import run_distributed

ROWS, WIDTH = 64, 8


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.bag = nn.Embedding(ROWS, WIDTH), nn.EmbeddingBag(ROWS, WIDTH, mode="sum")
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(dim=1) + self.bag(tokens)).pow(2).mean()


def _batches(rank: int, spread: int) -> list[torch.Tensor]:
    """Rank 0 looks up rows 0..spread-1, rank 1 rows spread/2..; `spread` = ROWS looks up every row."""
    if spread == ROWS:
        return [torch.arange(ROWS).roll(step + rank).view(2, -1) for step in range(6)]
    gen = torch.Generator().manual_seed(rank)
    low = rank * spread // 2
    return [torch.randint(low, low + spread, (2, 5), generator=gen) for _ in range(6)]


def _train(rank: int, sparse: bool, spread: int) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
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
    with count_collectives() as counter:
        for tokens in _batches(rank, spread):
            engine.backward(engine(tokens))
            engine.step()
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine.destroy()
    return params, dict(counter.bytes)


def sparse_case(rank: int, world: int) -> dict[int, tuple]:
    out = {}
    for spread in (6, ROWS):
        dense_params, dense_bytes = _train(rank, False, spread)
        sparse_params, sparse_bytes = _train(rank, True, spread)
        for name, value in dense_params.items():
            torch.testing.assert_close(sparse_params[name], value, rtol=0, atol=1e-7, msg=name)
        out[spread] = (dense_bytes, sparse_bytes)
    return out


def test_sparse_rows_equal_the_dense_reduce_with_fewer_bytes(tmp_path: object) -> None:
    results = run_distributed(sparse_case, world_size=2)
    for dense, sparse in (r[6] for r in results):
        print("bytes per rank, 6 rows looked up: dense", dense, "sparse", sparse)
        assert sparse.get("all_gather", 0) > 0  # the tables went as rows
        assert sum(sparse.values()) < 0.6 * sum(dense.values()), (dense, sparse)
    for dense, sparse in (r[ROWS] for r in results):  # every row touched: rows are no smaller, all-reduced dense
        assert sparse.get("all_reduce") == dense.get("all_reduce")


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
