"""Tiled MLPs (`TiledMLP`, `sequence_tiled_compute`) and `TiledFusedLogitsLoss` inside the engine at ZeRO 2 and
3 (2 ranks, the same batch on both): the averaged gradients the step will use equal the untiled model's in one
process. At ZeRO-3 the parameters are gathered again for the recompute in backward, and each must deliver one
gradient per backward ([Note: tiled parameter gradients] in slipstream/sequence/tiled.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.harness import run_distributed
from tests.unit.test_sequence_tiled import HIDDEN, VOCAB, Model

MODES = ("tiled_mlp", "sequence_tiled", "fused_loss")


class FusedLossModel(Model):
    """The untiled MLPs, then the LM head and loss through TiledFusedLogitsLoss (mean of 3 slices' means)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from slipstream.sequence.tiled import TiledFusedLogitsLoss

        h = self.mlp2(self.mlp1(x))

        def loss_fn(module: nn.Module, hs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(module.lm_head(hs), ys)

        return TiledFusedLogitsLoss.apply(loss_fn, self, h, y, None, 3, [self.lm_head.weight], "mean")


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(8)
    return torch.rand(2, 30, HIDDEN, generator=gen), torch.randint(0, VOCAB, (2, 30), generator=gen)


def _model(mode: str) -> nn.Module:
    return FusedLossModel("plain") if mode == "fused_loss" else Model(mode, shards=3)


def engine_grads(rank: int, world: int) -> dict[str, Any]:
    from slipstream.compat.param_access import safe_get_full_grad
    from tests.harness.engine_step import zero_sgd_step

    out: dict[str, Any] = {}
    x, y = _data()
    for stage in (2, 3):
        for mode in MODES:
            model = _model(mode)
            engine, loss = zero_sgd_step(model, x, y, stage=stage)
            grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
            out[f"{stage}/{mode}"] = (loss.item(), grads)
            engine.destroy()
    return out


def test_tiled_compute_under_zero_2_and_3() -> None:
    x, y = _data()
    model = Model("plain")
    loss = model(x, y)
    loss.backward()
    # the fused loss is the mean of 3 slices' means: slices of 20 tokens each (60 rows / 3), so equal to the mean
    expected = {n: p.grad for n, p in model.named_parameters()}
    for out in run_distributed(engine_grads, world_size=2, timeout_s=300):
        assert set(out) == {f"{s}/{m}" for s in (2, 3) for m in MODES}
        for key, (got_loss, grads) in out.items():
            assert abs(got_loss - loss.item()) < 1e-6 * abs(loss.item()), (key, got_loss, loss.item())
            assert set(grads) == set(expected), key
            for name, want in expected.items():
                torch.testing.assert_close(
                    grads[name], want, rtol=1e-5, atol=1e-7, msg=lambda m, k=key, n=name: f"{k} {n}: {m}"
                )
