"""ZeRO-3: a parameter of one module used in another module's forward (`F.linear(x, self.linear1.weight)` in the
parent's forward) is gathered on use and from then on with the module that uses it, as DeepSpeed fetches it,
without `register_external_parameter`. Two ranks against a single-process run of the same model and batches."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.harness import run_distributed

STEPS = 3


class ExtLinear(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.linear1 = nn.Linear(dim, dim)
            self.linear2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.linear2(torch.tanh(self.linear1(x)))
        return F.linear(b, self.linear1.weight).pow(2).mean()  # linear1's weight, outside linear1


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + rank))


def train(rank: int, world: int) -> dict:
    import slipstream
    from slipstream.zero import GatheredParameters

    model = ExtLinear()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = slipstream.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config
    )
    losses = []
    for step in range(STEPS):
        loss = engine(_batch(rank, step))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    params = list(engine.module.parameters())
    with GatheredParameters(params):
        final = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    return {"losses": losses, "final": final}


def test_a_parameter_used_outside_its_module_is_gathered_on_use(tmp_path) -> None:  # type: ignore[no-untyped-def]
    world = 2
    results = run_distributed(train, world_size=world, tmp_dir=tmp_path)
    reference = ExtLinear()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(STEPS):
        optimizer.zero_grad()
        losses = [reference(_batch(rank, step)) for rank in range(world)]
        (sum(losses) / world).backward()
        optimizer.step()
        for rank, out in enumerate(results):
            assert abs(out["losses"][step] - float(losses[rank].detach())) < 1e-5, (step, rank, out["losses"])
    for out in results:
        for name, value in reference.named_parameters():
            torch.testing.assert_close(out["final"][name], value.detach(), rtol=2e-5, atol=1e-6, msg=name)
