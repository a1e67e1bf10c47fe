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
    # two micro-batches a step: stage 1 sums them locally in fp32 and reduces once, stage 3 reduces each and adds
    # it into the fp32 gradient shard
    *({"name": f"z{s} gas2", "zero": {"stage": s}, "gas": 2} for s in (1, 3)),
]


def batches(gas: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Per step, per micro-batch, the batch both ranks split."""
    model = TinyTransformer()
    return [[model.make_batch(seed=300 + 10 * s + m, batch_size=BATCH) for m in range(gas)] for s in range(STEPS)]


def config(zero: dict, gas: int) -> dict:
    bucket = {"reduce_bucket_size": 3000} if zero["stage"] < 3 else {"stage3_param_persistence_threshold": 0}
    return {
        "train_micro_batch_size_per_gpu": BATCH // 2,
        "gradient_accumulation_steps": gas,
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


def train(rank: int, world: int, *, name: str, zero: dict, gas: int = 1) -> dict:
    import slipstream
    from slipstream.comm.counting import count_collectives

    engine, _, _, _ = slipstream.initialize(model=TinyTransformer(), config=config(zero, gas))
    op = "all_reduce" if zero["stage"] == 0 else "reduce_scatter"
    reduced: dict[str, int] = {}
    half = BATCH // world
    mine = slice(rank * half, (rank + 1) * half)
    for micro_batches in batches(gas):
        with count_collectives() as counter:
            for inputs, targets in micro_batches:
                engine.backward(TinyTransformer.loss(engine(inputs[mine]), targets[mine]))
                engine.step()
        for (kind, dtype), size in counter.dtype_bytes.items():
            if kind == op:
                reduced[dtype] = reduced.get(dtype, 0) + size
    result = {"params": full_params(engine), "reduced": {k: v // (gas if zero["stage"] > 1 else 1) for k, v in reduced.items()}}
    engine.destroy()
    dist.barrier()
    return result


def grid(rank: int, world: int) -> list[dict]:
    return run_subtests(CASES, lambda **case: train(rank, world, **case))


def safe_names(model: nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if type(m) is nn.Linear for n in (f"{n}.weight", f"{n}.bias")}


def rank_grads(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Each rank's gradients of its half of one micro-batch under a bf16 autocast forward."""
    grads = []
    for x, y in zip(inputs.chunk(2), targets.chunk(2)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        TinyTransformer.loss(out, y).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad()
    return grads


def reduced(a: torch.Tensor, b: torch.Tensor, low: bool) -> torch.Tensor:
    """Two ranks' gradients summed in bf16 (each rounded first, as the staging rows are) or in fp32."""
    return (a.bfloat16() + b.bfloat16()).float() if low else a + b


def reference(rule: str, gas: int = 1, stage: int = 0) -> dict[str, torch.Tensor]:
    """One process computing what two ranks do: the safe parameters' gradients summed over the ranks in bf16 and
    the others' in fp32 (`rule` "safe"), or all in fp32 ("fp32") or all in bf16 ("bf16"); with `gas` micro-batches,
    stages 0-1 add each rank's micro-batches in fp32 first and reduce once, stages 2-3 reduce each micro-batch and
    add the sums in fp32; divided by ranks x micro-batches; an SGD step."""
    model = TinyTransformer()
    safe = safe_names(model)
    for micro_batches in batches(gas):
        per_micro = [rank_grads(model, inputs, targets) for inputs, targets in micro_batches]
        with torch.no_grad():
            for n, p in model.named_parameters():
                low = rule == "bf16" or (rule == "safe" and n in safe)
                if stage < 2:  # each rank's micro-batches added first (in order), then one reduction
                    local = [sum((g[r][n] for g in per_micro[1:]), per_micro[0][r][n]) for r in (0, 1)]
                    total = reduced(local[0], local[1], low)
                else:  # each micro-batch reduced, the sums added in order
                    sums = [reduced(g[0][n], g[1][n], low) for g in per_micro]
                    total = sum(sums[1:], sums[0])
                p -= LR * (total / (2 * gas))
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
        expected = want
        if "gas" in case:  # the other stage family's order of accumulation and reduction is outside the bound
            stage = case["zero"]["stage"]
            expected = reference("safe", 2, stage)
            assert worst(expected, reference("safe", 2, 3 if stage < 2 else 1)) > 4 * BOUND, case["name"]
        for rank, result in enumerate(results):
            assert worst(result["params"], expected) <= BOUND, (case["name"], rank, worst(result["params"], expected))
            check_bytes(case, result["reduced"])
