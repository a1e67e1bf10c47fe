"""Activation offload (`activation_checkpointing.cpu_checkpointing`) under ZeRO-3 on 2 gloo ranks: a model
checkpointing every block through slipstream.checkpointing trains to the same losses and parameters with the
offload as without it, and the offload really moved and prefetched the checkpointed inputs."""

from __future__ import annotations

from tests.harness import run_distributed


def offload_at_zero3(rank: int, world: int) -> dict:
    import torch

    import slipstream
    from slipstream.activation import recompute
    from tests.harness.models import TinyTransformer

    class Checkpointed(TinyTransformer):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            x = self.tok_emb(tokens) + self.pos_emb(torch.arange(tokens.shape[1]))
            for block in self.layers:
                x = recompute.checkpoint(block, x)
            return self.head(self.norm(x))

    def train(offload: bool) -> tuple[list[float], list[torch.Tensor]]:
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "activation_checkpointing": {"cpu_checkpointing": offload},
        }
        model = Checkpointed(seq=11, layers=3)
        engine, *_ = slipstream.initialize(model=model, config=config)
        losses = []
        for step in range(2):
            inputs, targets = model.make_batch(seed=10 * step + rank, batch_size=2)
            loss = TinyTransformer.loss(engine(inputs), targets)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
            params = [p.detach().clone() for p in engine.module.parameters()]
        return losses, params

    expected_losses, expected_params = train(offload=False)
    losses, params = train(offload=True)
    stats = recompute.store().stats
    return {
        "losses": losses,
        "expected_losses": expected_losses,
        "params": all(torch.allclose(a, b, rtol=2e-5, atol=2e-5) for a, b in zip(params, expected_params)),
        "offloaded": stats.offloaded,
        "prefetched": stats.prefetched,
    }


def test_offload_at_zero3_trains_like_no_offload() -> None:
    for result in run_distributed(offload_at_zero3, world_size=2, timeout_s=180):
        assert result["params"], result
        for got, want in zip(result["losses"], result["expected_losses"], strict=True):
            assert abs(got - want) <= 2e-5 * max(1.0, abs(want)), result
        assert result["offloaded"] == 2 * 3 and result["prefetched"] == 2 * 2, result  # 3 blocks, 2 steps
