"""Precision options on the engine at world 2 against a single-process run computed the same way:
`torch_autocast` (bf16 forward, fp32 parameters) at ZeRO 0, 2, 3 and with CPU offload, `amp` (fp16 autocast
with loss scaling) at ZeRO 2, `bf16` master weights
with bf16 Adam moments at ZeRO 1-3 and offloaded at ZeRO 3, offloaded with fp32 moments at ZeRO 2, and fp16
masters (offloaded, with `auto_cast` inputs and a static loss scale), the reference stepping low-precision
parameters with the same optimizer and rounding. Parameters must be within a bound the dtype implies, and a
reference with one step left out must
not be (the bound is tight enough to see one step). Also the bytes the planner predicts for bf16 masters and
states at ZeRO-2, about half those of fp32 masters. One spawn runs every case."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.harness import run_distributed, run_subtests
from tests.harness.models import TinyMLP

STEPS = 3
BATCH = 8
LR = 1e-2
# every gradient reduced in fp32 (no safe modules): tests/dist/precision/test_safe_modules.py checks the default
AUTOCAST = {"torch_autocast": {"enabled": True, "dtype": "bfloat16", "lower_precision_safe_modules": []}}
BF16_STATES = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}
BF16_MASTERS = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}
# auto_cast: the fp32 inputs reach the fp16 model cast to fp16 (else its first Linear refuses them)
FP16_MASTERS = {"fp16": {"enabled": True, "loss_scale": 128, "fp16_master_weights_and_grads": True, "auto_cast": True}}
CPU = {"offload_optimizer": {"device": "cpu"}}
CASES = [
    *({"name": f"autocast z{s}", "extra": AUTOCAST, "zero": {"stage": s}, "kind": "autocast"} for s in (0, 2, 3)),
    {"name": "autocast z2 offload", "extra": AUTOCAST, "zero": {"stage": 2, **CPU}, "kind": "autocast"},
    {"name": "amp z2", "extra": {"amp": {"enabled": True}}, "zero": {"stage": 2}, "kind": "amp"},
    *({"name": f"bf16 states z{s}", "extra": BF16_STATES, "zero": {"stage": s}, "kind": "bf16", "resume": s == 2}
      for s in (1, 2, 3)),
    {"name": "bf16 masters z2 offload", "extra": BF16_MASTERS, "zero": {"stage": 2, **CPU}, "kind": "bf16_fp32_states"},
    {"name": "bf16 states z3 offload", "extra": BF16_STATES, "zero": {"stage": 3, **CPU}, "kind": "bf16_host_states",
     "resume": True},
    {"name": "fp16 masters z2 offload", "extra": FP16_MASTERS, "zero": {"stage": 2, **CPU}, "kind": "fp16"},
]
# parameter bounds: fp32 parameters may differ by fp32 rounding (the order of the reduction); bf16 parameters
# (|p| < 1) by one bf16 rounding step, 2**-8. A step of this AdamW moves a parameter by about LR = 1e-2.
BOUNDS = {"autocast": 1e-6, "amp": 1e-6, "bf16": 2.0**-8, "bf16_fp32_states": 2.0**-8, "bf16_host_states": 2.0**-8, "fp16": 2.0**-11}
DTYPES = {"autocast": torch.float32, "amp": torch.float32, "fp16": torch.float16}  # parameters; bf16 otherwise
LOSS_SCALE = {"fp16": 128.0, "amp": 2.0**16}  # amp: fp16 autocast with the dynamic scale, 2**16 at first
AUTOCAST_DTYPES = {"autocast": torch.bfloat16, "amp": torch.float16}


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [TinyMLP().make_batch(seed=200 + s, batch_size=BATCH) for s in range(STEPS)]


def config(case: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": BATCH // 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "zero_optimization": {"reduce_bucket_size": 700, **case["zero"]}, **case["extra"]}


def full_params(engine) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    from slipstream.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def resumed(engine, case: dict, ckpt: str) -> float:  # type: ignore[no-untyped-def]
    """Save, load into a fresh engine, one more step on both: the largest parameter difference (0: exact, so
    the moments came back in their dtype)."""
    import slipstream

    engine.save_checkpoint(ckpt, tag="t")
    again, _, _, _ = slipstream.initialize(model=TinyMLP(), config=config(case))
    again.load_checkpoint(ckpt, tag="t")
    inputs, targets = batches()[0]
    for each in (engine, again):
        each.backward(TinyMLP.loss(each(inputs[:BATCH // 2]), targets[:BATCH // 2]))
        each.step()
    difference = worst(full_params(engine), full_params(again))
    again.destroy()
    return difference


def train(rank: int, world: int, ckpt: str, **case: object) -> dict:
    import slipstream

    engine, _, _, _ = slipstream.initialize(model=TinyMLP(), config=config(case))
    for inputs, targets in batches():
        half = BATCH // world
        mine = slice(rank * half, (rank + 1) * half)
        engine.backward(TinyMLP.loss(engine(inputs[mine]), targets[mine]))
        engine.step()
    zero = engine.optimizer
    owned = {**zero.owned_bytes(), "optimizer_state": state_bytes(zero.optimizer)}
    states = {t.dtype for s in zero.optimizer.state.values() for t in s.values() if t.dim() > 0}
    result = {"params": full_params(engine), "owned": owned, "state_dtypes": sorted(map(str, states)),
              "dtypes": sorted({str(p.dtype) for p in engine.module.parameters()})}
    if case.get("resume"):
        result["resumed"] = resumed(engine, case, f"{ckpt}/{case['name'].replace(' ', '_')}")
    engine.destroy()
    dist.barrier()
    return result


# prescale_gradients / gradient_predivide_factor: each rank's gradient is 40000 in fp16 accumulation; their sum
# (80000) overflows fp16 unless divided before the reduction (20000 + 20000 = 40000)
OVERFLOW = [{"extra": {}, "stage": 1}, {"extra": {"prescale_gradients": True}, "stage": 1},
            {"extra": {"gradient_predivide_factor": 2.0}, "stage": 2},
            {"extra": {"prescale_gradients": True}, "stage": 0}]
SGD_LR = 1e-6  # SGD sees the gradient's size (Adam would not): the step's divisor must account for the division


def overflow_step(rank: int, world: int, *, extra: dict, stage: int) -> torch.Tensor:
    import slipstream

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "optimizer": {"type": "SGD", "params": {"lr": SGD_LR}},
              "data_types": {"grad_accum_dtype": "fp16"}, "zero_optimization": {"stage": stage}, **extra}
    engine, _, _, _ = slipstream.initialize(model=torch.nn.Linear(4, 1, bias=False), config=config)
    engine.backward(engine(torch.full((1, 4), 40000.0)).sum())
    engine.step()
    weight = full_params(engine)["weight"]
    engine.destroy()
    dist.barrier()
    return weight


def grid(rank: int, world: int, ckpt: str) -> tuple[list[dict], list[torch.Tensor]]:
    overflow = run_subtests(OVERFLOW, lambda **case: overflow_step(rank, world, **case))
    return run_subtests(CASES, lambda **case: train(rank, world, ckpt, **case)), overflow


def reference(kind: str, steps: int) -> dict[str, torch.Tensor]:
    """One process, the batch's two halves (gradients summed, then halved): autocast forward over fp32
    parameters and AdamW, or low-precision parameters stepped by FusedAdam (AdamW) with moments in their dtype,
    or offloaded by the CPU Adam op (fp32 or bf16 moments), rounded to nearest as stored."""
    from slipstream.ops.adam import DeepSpeedCPUAdam, FusedAdam

    model = TinyMLP().to(DTYPES.get(kind, torch.bfloat16))
    if kind in ("bf16_fp32_states", "bf16_host_states", "fp16"):  # offloaded: the CPU Adam op
        fp32_states = kind != "bf16_host_states"
        opt: torch.optim.Optimizer = DeepSpeedCPUAdam(model.parameters(), lr=LR, weight_decay=0.01,
                                                      fp32_optimizer_states=fp32_states)
    else:  # what the config's "AdamW" builds on the accelerator
        opt = FusedAdam(model.parameters(), lr=LR, weight_decay=0.01, adam_w_mode=True)
    scale = LOSS_SCALE.get(kind, 1.0)
    for inputs, targets in batches()[:steps]:
        for x, y in zip(inputs.chunk(2), targets.chunk(2)):  # the ranks' halves, gradients summed in their dtype
            with torch.autocast("cpu", dtype=AUTOCAST_DTYPES.get(kind), enabled=kind in AUTOCAST_DTYPES):
                out = model(x.to(next(model.parameters()).dtype))
            (TinyMLP.loss(out, y) * scale).backward()
        for p in model.parameters():
            p.grad /= 2 * scale
        opt.step()
        opt.zero_grad()
    return {n: p.detach().float() for n, p in model.named_parameters()}


def worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_precision_options_match_reference_and_planner(tmp_path) -> None:  # type: ignore[no-untyped-def]
    per_rank, overflow = zip(*run_distributed(grid, world_size=2, tmp_dir=tmp_path, ckpt=str(tmp_path / "ckpt")))
    check_divided_on_arrival(overflow[0])
    for case, *results in zip(CASES, *per_rank):
        kind, bound = case["kind"], BOUNDS[case["kind"]]
        full, short = reference(kind, STEPS), reference(kind, STEPS - 1)
        for rank, result in enumerate(results):
            assert worst(result["params"], full) <= bound, (case["name"], rank, worst(result["params"], full))
            assert worst(result["params"], short) > 2 * bound, (case["name"], "one step left out is within bound")
        want_params = str(DTYPES.get(kind, torch.bfloat16))
        want_states = "torch.bfloat16" if kind in ("bf16", "bf16_host_states") else "torch.float32"
        assert all(r.get("resumed", 0.0) == 0.0 for r in results), (case["name"], "resumed from a checkpoint")
        assert results[0]["dtypes"] == [want_params] and results[0]["state_dtypes"] == [want_states], (case, results[0])
    check_planner_bytes(per_rank[0])


def check_divided_on_arrival(weights: list[torch.Tensor]) -> None:
    """Without prescaling the fp16 sum overflows (an fp32 model steps on inf: non-finite weights); divided on
    arrival, the averaged gradient is 40000 and SGD moves every weight by SGD_LR * 40000."""
    torch.manual_seed(0)
    start = torch.nn.Linear(4, 1, bias=False).weight.detach()
    assert not torch.isfinite(weights[0]).all(), weights[0]
    for case, weight in zip(OVERFLOW[1:], weights[1:]):
        torch.testing.assert_close(weight, start - SGD_LR * 40000, rtol=0, atol=1e-6,
                                   msg=lambda m, case=case: f"{case}: {m}")


def check_planner_bytes(results: list[dict]) -> None:
    """bf16 masters + bf16 states at ZeRO-2 hold what the planner predicts from the same config (within 5%),
    about half the bytes of fp32 masters with Adam; offloaded bf16 masters keep fp32 moments, as predicted."""
    from slipstream.config import resolve
    from slipstream.planner.estimate import settings_from_plan
    from slipstream.planner.zero_bytes import stage012_bytes

    numels = [p.numel() for p in TinyMLP().parameters()]
    roles = ("params", "master", "grads", "optimizer_state")

    def predicted(name: str, extra: dict | None = None) -> dict[str, int]:
        case = next(c for c in CASES if c["name"] == name)
        settings, option = settings_from_plan(resolve(config({**case, **(extra or {})}), world_size=2))
        offload = option.optimizer_target.__name__ != "NoOffloadTarget"
        return stage012_bytes(numels, 0, stage=2, world=2, settings=settings, offload=offload).owned

    measured = dict(zip((c["name"] for c in CASES), results))
    low, want = measured["bf16 states z2"]["owned"], predicted("bf16 states z2")
    total = sum(want[r] for r in roles)
    assert abs(sum(low[r] for r in roles) - total) <= 0.05 * total, (low, want)
    fp32 = predicted("bf16 states z2", {"extra": {"bf16": {"enabled": True}}})  # bf16 params, fp32 masters
    assert 0.4 <= total / sum(fp32[r] for r in roles) <= 0.6, (want, fp32)
    offloaded = measured["bf16 masters z2 offload"]["owned"]["optimizer_state"]
    assert offloaded == predicted("bf16 masters z2 offload")["optimizer_state"], offloaded
