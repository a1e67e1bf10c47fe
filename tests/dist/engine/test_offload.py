"""ZeRO-Offload (offload_optimizer.device cpu) at stages 1 and 2: master weights and optimizer state on the host,
the native CPU Adam step, and the same parameters as the single-process reference."""

from __future__ import annotations

import torch

from tests.harness import run_distributed
from tests.harness.models import TinyMLP
from tests.harness.reference import train_reference

LR = 1e-2
CASES = [(1, "fp32"), (2, "fp32"), (2, "bf16")]


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [TinyMLP().make_batch(seed=300 + s, batch_size=8) for s in range(5)]


def offload_run(rank: int, world: int, *, stage: int, precision: str) -> dict:
    import slipstream
    from slipstream.ops.adam import DeepSpeedCPUAdam

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 700,
                                    "offload_optimizer": {"device": "cpu", "pin_memory": True}},
              "bf16": {"enabled": precision == "bf16"}}
    engine, *_ = slipstream.initialize(model=TinyMLP(), config=config)
    assert isinstance(engine.basic_optimizer, DeepSpeedCPUAdam)
    zero = engine.optimizer
    assert zero is not None and zero.offload.on_host
    flat = zero.groups[0]
    assert not flat.aliased_master and flat.master_flat is not None and flat.master_flat.device.type == "cpu"
    if precision == "bf16":
        assert flat.low_precision_pieces and flat.low_precision_pieces[0].dtype == torch.bfloat16
    for inputs, targets in batches():
        for micro in range(2):
            start = (micro * world + rank) * 2
            engine.backward(TinyMLP.loss(engine(inputs[start:start + 2]).float(), targets[start:start + 2]))
            engine.step()
    if precision == "bf16":  # the device copy came from the op's low-precision output, equal to the cast master
        torch.testing.assert_close(flat.low_precision_pieces[0], flat.master_pieces[0].to(torch.bfloat16))
    return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def grid(rank: int, world: int) -> list[dict]:
    return [offload_run(rank, world, stage=stage, precision=precision) for stage, precision in CASES]


def test_offload_matches_reference(tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, reference = train_reference(TinyMLP, batches(), lr=LR, steps=5, weight_decay=0.01, grad_clip=1.0)
    first, second = run_distributed(grid, world_size=2, tmp_dir=tmp_path, timeout_s=180)
    for (stage, precision), params, other in zip(CASES, first, second):
        tolerance = {"fp32": (2e-5, 2e-6), "bf16": (2e-2, 2e-2)}[precision]
        for name, value in params.items():
            torch.testing.assert_close(value, reference[name], rtol=tolerance[0], atol=tolerance[1],
                                       msg=lambda m, n=name, c=(stage, precision): f"{c} {n}: {m}")
        torch.testing.assert_close(params, other, rtol=0, atol=0)
