"""The `fp8` section at ZeRO-3 on 2 gloo ranks: the engine converts the model's linear layers to emulated
rowwise Float8Linear before partitioning it, and after 3 AdamW steps its parameters equal a single-process
reference that runs the same emulated float8 layers on the two halves of each batch (gradients summed, then
halved) within fp32 rounding; the reference with one step left out is not within that bound."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.harness import run_distributed
from tests.harness.models import TinyMLP

STEPS = 3
BATCH = 8
LR = 1e-2
BOUND = 1e-5  # fp32 reduction order through 3 steps of float8 rounding (measured: equal); one step moves ~LR
MODEL = {"in_dim": 32, "hidden": 64, "out_dim": 16}
FP8 = {"enabled": True, "recipe": "rowwise", "emulate": True}


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [TinyMLP(**MODEL).make_batch(seed=300 + s, batch_size=BATCH) for s in range(STEPS)]


def train(rank: int, world: int) -> tuple[dict[str, torch.Tensor], list[str]]:
    import slipstream
    from slipstream.fp8 import Float8Linear
    from slipstream.zero import GatheredParameters

    config = {
        "train_micro_batch_size_per_gpu": BATCH // world,
        "gradient_clipping": 0.0,
        "fp8": FP8,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 700},
    }
    engine, _, _, _ = slipstream.initialize(model=TinyMLP(**MODEL), config=config)
    converted = [n for n, m in engine.module.named_modules() if isinstance(m, Float8Linear)]
    half = BATCH // world
    for inputs, targets in batches():
        mine = slice(rank * half, (rank + 1) * half)
        engine.backward(TinyMLP.loss(engine(inputs[mine]), targets[mine]))
        engine.step()
    with GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    dist.barrier()
    return params, converted


def reference(steps: int) -> dict[str, torch.Tensor]:
    from slipstream.fp8 import convert_to_float8_training
    from slipstream.ops.adam import FusedAdam

    model = convert_to_float8_training(TinyMLP(**MODEL), recipe="rowwise", emulate=True)
    opt = FusedAdam(model.parameters(), lr=LR, weight_decay=0.01, adam_w_mode=True)
    for inputs, targets in batches()[:steps]:
        for x, y in zip(inputs.chunk(2), targets.chunk(2)):
            TinyMLP.loss(model(x), y).backward()
        for p in model.parameters():
            p.grad /= 2
        opt.step()
        opt.zero_grad()
    return {n: p.detach().float() for n, p in model.named_parameters()}


def worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_fp8_at_zero3_matches_the_single_process_reference(tmp_path) -> None:  # type: ignore[no-untyped-def]
    per_rank = run_distributed(train, world_size=2, tmp_dir=tmp_path)
    full, short = reference(STEPS), reference(STEPS - 1)
    for rank, (params, converted) in enumerate(per_rank):
        assert converted == ["layers.0", "layers.1", "layers.2"], (rank, converted)
        assert worst(params, full) <= BOUND, (rank, worst(params, full))
        assert worst(params, short) > 2 * BOUND, (rank, "one step left out is within the bound")
