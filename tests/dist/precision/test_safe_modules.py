"""`torch_autocast.lower_precision_safe_modules` on 2 ranks at ZeRO 0-3 and with CPU offload: the gradients of
the safe modules' parameters (Linear by default) are reduced in bf16 and the others' (embeddings, LayerNorm) in
fp32, each accumulated back in fp32. Against a single-process reference computed the same way (each rank's
gradients under a bf16 autocast forward, summed in the dtype each parameter's module says), the parameters after
SGD steps agree to fp32 rounding, and references that reduce everything in fp32 or everything in bf16 do not.
The bytes each rank reduces, counted per dtype, are the safe parameters' in bf16 and the rest in fp32 (plus the
padding of the layout). One spawn runs every case."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tests.harness import run_distributed, run_subtests
from tests.harness.models import TinyTransformer

STEPS = 2
BATCH = 4
LR = 1.0  # SGD: the update is the gradient itself, so a bf16 rounding of it shows in the parameters
BOUND = 2e-6
CPU = {"offload_optimizer": {"device": "cpu"}}  # SGD on the host: zero_force_ds_cpu_optimizer false
CASES = [
    *({"name": f"z{s}", "zero": {"stage": s}} for s in (0, 1, 2, 3)),
    {"name": "z2 offload", "zero": {"stage": 2, **CPU}},
    {"name": "z3 offload", "zero": {"stage": 3, **CPU}},
]


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [TinyTransformer().make_batch(seed=300 + s, batch_size=BATCH) for s in range(STEPS)]


def config(zero: dict) -> dict:
    bucket = {"reduce_bucket_size": 3000} if zero["stage"] < 3 else {"stage3_param_persistence_threshold": 0}
    return {
        "train_micro_batch_size_per_gpu": BATCH // 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
        "zero_optimization": {**bucket, **zero},
        "zero_force_ds_cpu_optimizer": False,
    }


def full_params(engine) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    from slipstream.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def train(rank: int, world: int, *, name: str, zero: dict) -> dict:
    import slipstream
    from slipstream.comm.counting import count_collectives

    engine, _, _, _ = slipstream.initialize(model=TinyTransformer(), config=config(zero))
    op = "all_reduce" if zero["stage"] == 0 else "reduce_scatter"
    reduced: dict[str, int] = {}
    for inputs, targets in batches():
        half = BATCH // world
        mine = slice(rank * half, (rank + 1) * half)
        with count_collectives() as counter:
            engine.backward(TinyTransformer.loss(engine(inputs[mine]), targets[mine]))
            engine.step()
        for (kind, dtype), size in counter.dtype_bytes.items():
            if kind == op:
                reduced[dtype] = reduced.get(dtype, 0) + size
    result = {"params": full_params(engine), "reduced": reduced}
    engine.destroy()
    dist.barrier()
    return result


def grid(rank: int, world: int) -> list[dict]:
    return run_subtests(CASES, lambda **case: train(rank, world, **case))


def safe_names(model: nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if type(m) is nn.Linear for n in (f"{n}.weight", f"{n}.bias")}


def reference(rule: str) -> dict[str, torch.Tensor]:
    """One process: each rank's half under a bf16 autocast forward, the two gradients summed in bf16 (rounded
    first, as the staging rows are) for the safe parameters and in fp32 for the others (`rule` "safe"), or all in
    fp32 ("fp32") or all in bf16 ("bf16"); halved; an SGD step."""
    model = TinyTransformer()
    safe = safe_names(model)
    for inputs, targets in batches():
        grads: list[dict[str, torch.Tensor]] = []
        for x, y in zip(inputs.chunk(2), targets.chunk(2)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
            TinyTransformer.loss(out, y).backward()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            model.zero_grad()
        with torch.no_grad():
            for n, p in model.named_parameters():
                low = rule == "bf16" or (rule == "safe" and n in safe)
                total = (grads[0][n].bfloat16() + grads[1][n].bfloat16()).float() if low else grads[0][n] + grads[1][n]
                p -= LR * (total / 2)
    return {n: p.detach().float() for n, p in model.named_parameters()}


def worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def check_bytes(case: dict, reduced: dict[str, int]) -> None:
    """bf16 bytes: the safe parameters' elements (2 bytes each) per step; fp32: the others' (4 bytes); each up to
    the layout's padding (at most world - 1 elements per parameter) and, at stage 0, a few statistics."""
    model = TinyTransformer()
    safe = safe_names(model)
    low = sum(p.numel() for n, p in model.named_parameters() if n in safe)
    high = sum(p.numel() for n, p in model.named_parameters() if n not in safe)
    slack = len(list(model.parameters())) + 8
    for dtype, numel, size in (("bfloat16", low, 2), ("float32", high, 4)):
        elements = reduced.get(dtype, 0) / size / STEPS
        assert numel <= elements <= numel + slack, (case["name"], dtype, elements, numel, reduced)


def test_safe_modules_reduce_in_bf16_and_the_rest_in_fp32(tmp_path) -> None:  # type: ignore[no-untyped-def]
    per_rank = run_distributed(grid, world_size=2, tmp_dir=tmp_path, timeout_s=240.0)
    want, all_fp32, all_bf16 = reference("safe"), reference("fp32"), reference("bf16")
    assert worst(want, all_fp32) > 4 * BOUND and worst(want, all_bf16) > 4 * BOUND  # the bound sees the dtype
    for case, *results in zip(CASES, *per_rank):
        for rank, result in enumerate(results):
            assert worst(result["params"], want) <= BOUND, (case["name"], rank, worst(result["params"], want))
            check_bytes(case, result["reduced"])
