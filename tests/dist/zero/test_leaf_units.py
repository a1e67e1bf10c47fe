"""ZeRO-3 leaf modules at world size 2: a model whose ranks run different submodules trains when it is marked
as one leaf (set_z3_leaf_modules or zero_optimization.leaf_module), with the single-process reference's values,
and its parameters say they belong to a leaf (z3_leaf_parameter)."""

from __future__ import annotations

import torch

from tests.dist.zero.stage3_models import Experts
from tests.harness import run_distributed
from tests.harness.reference import ReferenceRun, run_reference

ROUTES = (0, 2)  # the expert each rank runs
STEPS = 3


def _config(**zero: object) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}


def leaf_training(rank: int, world: int) -> dict:
    import slipstream
    from slipstream.utils import set_z3_leaf_modules, z3_leaf_parameter

    out: dict = {}
    for how in ("function", "config"):
        model = Experts()
        if how == "function":
            set_z3_leaf_modules(model, [Experts])
            config = _config()
        else:
            config = _config(leaf_module={"classes": [f"{Experts.__module__}.Experts"]})
        engine, *_ = slipstream.initialize(model=model, config=config)
        gen = torch.Generator().manual_seed(rank)
        losses = []
        for _ in range(STEPS):
            loss = engine(torch.randn(2, 10, generator=gen), ROUTES[rank]).pow(2).mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[how] = {"final": engine.zero_model.full_state(only_rank0=False), "losses": losses,
                    "units": len([u for u in engine.zero_model.units if u.params]),
                    "leaf_params": all(z3_leaf_parameter(p) for p in model.parameters())}
        engine.destroy()
    return out


def reference() -> ReferenceRun:
    gens = [torch.Generator().manual_seed(rank) for rank in range(2)]

    def micro_losses(model: torch.nn.Module, step: int) -> list[torch.Tensor]:
        return [model(torch.randn(2, 10, generator=gen), ROUTES[rank]).pow(2).mean() for rank, gen in enumerate(gens)]

    return run_reference(Experts, micro_losses, lr=1e-2, steps=STEPS, grad_clip=1.0)


def test_a_leaf_model_with_rank_dependent_branches_matches_the_reference(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = run_distributed(leaf_training, world_size=2, tmp_dir=tmp_path, timeout_s=120)
    expected = reference()
    for rank, out in enumerate(results):
        for how in ("function", "config"):
            got = out[how]
            assert got["units"] == 1 and got["leaf_params"], (how, got["units"])
            for name, value in expected.params.items():
                torch.testing.assert_close(got["final"][name], value, rtol=2e-5, atol=2e-6,
                                           msg=lambda m, rank=rank, how=how, name=name: f"{how} rank {rank} {name}: {m}")
