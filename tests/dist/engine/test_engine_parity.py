"""The engine at stages 0-2 against single-process AdamW: same parameters, logged loss and per-step global
gradient norm for any split of the global batch into ranks x micro-batches x accumulation steps, with either
backward style. At world 1 the norms stay under the default clip (1.0); at world 2 `gradient_clipping` is CLIP,
well under every step's norm, so each step is clipped by the global norm (a shard-local norm differs)."""

from __future__ import annotations

import torch

from tests.harness import run_distributed
from tests.harness.models import TinyMLP
from tests.harness.reference import reference_run

STEPS = 5
GLOBAL_BATCH = 8
LR = 1e-2
CLIP = 0.1  # the global norms of these batches are 0.38-0.75


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    model = TinyMLP()
    return [model.make_batch(seed=100 + s, batch_size=GLOBAL_BATCH) for s in range(STEPS)]


def config(stage: int, micro: int, gas: int, **extra: object) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 700}, **extra}


def train(rank: int, world: int, *, stage: int, micro: int, gas: int, torch_style: bool, clip: float = 1.0) -> dict:
    import slipstream

    engine, _, _, _ = slipstream.initialize(model=TinyMLP(), config=config(stage, micro, gas, gradient_clipping=clip))
    losses, norms = [], []
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
        norms.append(engine.get_global_grad_norm())
    result = {"params": {n: p.detach().clone() for n, p in engine.module.named_parameters()}, "losses": losses,
              "grad_norms": norms, "steps": engine.global_steps}
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
    references = {clip: reference_run(TinyMLP, global_batches(), lr=LR, steps=STEPS, optimizer="adamw",
                                      weight_decay=0.01, grad_clip=clip) for clip in (1.0, CLIP)}
    assert max(references[1.0].grad_norms) < 1.0  # world 1: the default clip leaves these gradients alone
    assert min(references[CLIP].grad_norms) > 3 * CLIP  # world 2: every step is clipped, by a factor of 3 or more
    single = [dict(stage=s, micro=m, gas=g, torch_style=t) for s in (0, 1, 2) for m, g in ((8, 1), (2, 4))
              for t in (False, True)]
    double = [dict(stage=s, micro=2, gas=2, torch_style=t, clip=CLIP) for s in (0, 1, 2) for t in (False, True)]
    results = [(c, r) for c, r in zip(single, run_distributed(run_grid, world_size=1, tmp_dir=tmp_path / "w1",
                                                              cases=single)[0])]
    world2 = run_distributed(run_grid, world_size=2, tmp_dir=tmp_path / "w2", cases=double)
    results += [(c, r) for rank_results in world2 for c, r in zip(double, rank_results)]
    assert len(results) == len(single) + 2 * len(double)
    for case, result in results:
        reference = references[case.get("clip", 1.0)]
        assert result["steps"] == STEPS, case
        for name, value in result["params"].items():
            torch.testing.assert_close(value, reference.params[name], rtol=2e-5, atol=2e-6,
                                       msg=lambda m, case=case, name=name: f"{case} {name}: {m}")
        if not case["torch_style"]:
            torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference.losses), rtol=1e-5,
                                       atol=0)
        # the pre-clip global norm of every step, as clip_grad_norm_ returns it
        torch.testing.assert_close(torch.tensor(result["grad_norms"]), torch.tensor(reference.grad_norms),
                                   rtol=1e-5, atol=0, msg=lambda m, case=case: f"{case} grad norms: {m}")
