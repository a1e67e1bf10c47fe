"""The engine at stages 0-2 against single-process AdamW: same parameters and logged loss for any split
of the global batch into ranks x micro-batches x accumulation steps, with either backward style."""

from __future__ import annotations

import torch

from tests.harness import run_distributed
from tests.harness.models import TinyMLP
from tests.harness.reference import train_reference

STEPS = 5
GLOBAL_BATCH = 8
LR = 1e-2


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    model = TinyMLP()
    return [model.make_batch(seed=100 + s, batch_size=GLOBAL_BATCH) for s in range(STEPS)]


def config(stage: int, micro: int, gas: int, **extra: object) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 700}, **extra}


def train(rank: int, world: int, *, stage: int, micro: int, gas: int, torch_style: bool) -> dict:
    import slipstream

    engine, _, _, _ = slipstream.initialize(model=TinyMLP(), config=config(stage, micro, gas))
    losses = []
    for inputs, targets in global_batches():
        for m in range(gas):
            start = (m * world + rank) * micro
            x, y = inputs[start:start + micro], targets[start:start + micro]
            loss = TinyMLP.loss(engine(x), y)
            if torch_style:
                loss.backward()
            else:
                engine.backward(loss)
            engine.step()
        losses.append(engine.last_loss)
    result = {"params": {n: p.detach().clone() for n, p in engine.module.named_parameters()}, "losses": losses,
              "grad_norm": engine.get_global_grad_norm(), "steps": engine.global_steps}
    engine.destroy()
    return result


def run_grid(rank: int, world: int, *, cases: list[dict]) -> list[dict]:
    out = []
    for case in cases:
        out.append(train(rank, world, **case))
        import torch.distributed as dist

        dist.barrier()
    return out


def test_batch_splits_and_backward_styles_match_reference(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ref_losses, ref_params = train_reference(TinyMLP, global_batches(), lr=LR, steps=STEPS, optimizer="adamw",
                                             weight_decay=0.01, grad_clip=1.0)
    single = [dict(stage=s, micro=m, gas=g, torch_style=t) for s in (0, 1, 2) for m, g in ((8, 1), (2, 4))
              for t in (False, True)]
    double = [dict(stage=s, micro=2, gas=2, torch_style=t) for s in (0, 1, 2) for t in (False, True)]
    results = [(c, r) for c, r in zip(single, run_distributed(run_grid, world_size=1, tmp_dir=tmp_path / "w1",
                                                              cases=single)[0])]
    world2 = run_distributed(run_grid, world_size=2, tmp_dir=tmp_path / "w2", cases=double)
    results += [(c, r) for rank_results in world2 for c, r in zip(double, rank_results)]
    assert len(results) == len(single) + 2 * len(double)
    norms = []
    for case, result in results:
        assert result["steps"] == STEPS, case
        for name, value in result["params"].items():
            torch.testing.assert_close(value, ref_params[name], rtol=2e-5, atol=2e-6,
                                       msg=lambda m, case=case, name=name: f"{case} {name}: {m}")
        if not case["torch_style"]:
            torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
        norms.append(result["grad_norm"])
    assert max(norms) / min(norms) < 1 + 1e-5, norms  # same pre-clip global norm everywhere
