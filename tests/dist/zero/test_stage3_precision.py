"""Precision at ZeRO-3 on 2 gloo ranks (one spawn for every case):

- prescale_gradients / gradient_predivide_factor divide each gradient before the reduce-scatter, in the
  communication dtype: each rank's gradient is 40000, the fp16 sum of two (80000) overflows unless divided
  first (20000 + 20000), and the step divides by world / factor after; with fp32 communication 3 SGD steps of
  a small MLP equal a single-process reference (the gradients' mean);
- the fp8 section's tensorwise layers (fp32 and bf16 weights) gather their weights in float8: the gathered float8 weight is the local
  cast of the full weight, bit for bit, with its scale; the parameter holds its dequantized values; the bytes
  of the gather are the formula of [Note: float8 gather rows] (a weight costs 1/4 of its fp32 bytes, 1/2 of
  bf16); the forward runs with the gathered weight, and 3 AdamW steps equal a single-process emulated float8
  reference (one step left out is not within the bound).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_distributed
from tests.harness.models import TinyMLP
from tests.harness.reference import reference_run
from tests.harness.subtests import run_subtests

WORLD = 2
SGD_LR = 1e-6  # SGD sees the gradient's size: the step's divisor must account for the division
OVERFLOW = [
    {"prescale_gradients": True},
    {"gradient_predivide_factor": 2.0},
    {"gradient_predivide_factor": 4.0},
    {},  # no predivision: the fp16 reduction overflows (the keys have an effect)
]
MODEL = {"in_dim": 32, "hidden": 64, "out_dim": 16}
STEPS, BATCH, LR = 3, 8, 1e-2
BOUND = 1e-5  # fp32 reduction order through 3 steps (measured: equal); one step moves parameters by ~LR
TRAIN = [{"dtype": "fp32"}, {"dtype": "bf16"}]
ZERO3 = {"stage": 3, "stage3_param_persistence_threshold": 0}


def overflow_step(rank: int, **extra: object) -> torch.Tensor:
    import slipstream

    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        "communication_data_type": "fp16",
        "optimizer": {"type": "SGD", "params": {"lr": SGD_LR}},
        "zero_optimization": ZERO3,
        **extra,
    }
    engine, _, _, _ = slipstream.initialize(model=torch.nn.Linear(4, 1, bias=False), config=config)
    engine.backward(engine(torch.full((1, 4), 40000.0)).sum())
    engine.step()
    return finish(engine)["weight"]


def finish(engine) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The engine's full parameters (fp32 copies) once it is destroyed on every rank."""
    from slipstream.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    dist.barrier()
    return params


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [TinyMLP(**MODEL).make_batch(seed=500 + s, batch_size=BATCH) for s in range(STEPS)]


def engine_for(dtype: str, optimizer: dict[str, object], **extra: object):  # type: ignore[no-untyped-def]
    import slipstream

    config = {
        "train_micro_batch_size_per_gpu": BATCH // WORLD,
        "gradient_clipping": 0.0,
        "bf16": {"enabled": dtype == "bf16"},
        "optimizer": optimizer,
        "zero_optimization": ZERO3,
        **extra,
    }
    engine, _, _, _ = slipstream.initialize(model=TinyMLP(**MODEL), config=config)
    return engine


def train(engine, rank: int) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """STEPS steps on this rank's rows of each batch (rank r: the r-th of WORLD equal parts)."""
    for batch in batches():
        inputs, targets = (part.chunk(WORLD)[rank] for part in batch)
        engine.backward(TinyMLP.loss(engine(inputs), targets))
        engine.step()
    return finish(engine)


def predivided_training(rank: int) -> dict[str, torch.Tensor]:
    engine = engine_for("fp32", {"type": "SGD", "params": {"lr": 0.5}}, gradient_predivide_factor=4.0)
    return train(engine, rank)


def gathered_fp8(rank: int, dtype: str) -> dict[str, object]:
    """Each layer's unit gathered by the hooks' path (float8) and exactly: bit equality, dequantized values, bytes."""
    from slipstream.comm.counting import count_collectives
    from slipstream.precision.fp8 import E4M3, quantize_fp8

    engine = engine_for(dtype, {"type": "AdamW", "params": {"lr": LR}}, fp8={"enabled": True, "emulate": True})
    out: dict[str, object] = {"bits": [], "dequantized": [], "emptied": [], "fp8_bytes": 0, "exact_bytes": 0}
    for layer in engine.module.layers:
        unit = layer.weight.ds_record.unit
        with count_collectives() as exact:
            unit.finish_gather()
        full = layer.weight.detach().clone()
        unit.release()
        with count_collectives() as cast:
            unit.finish_gather(hook=True)
        values, scale = layer.precast.cast()
        expected, expected_scale = quantize_fp8(full, E4M3, None)
        out["bits"].append(
            torch.equal(values.view(torch.uint8), expected.view(torch.uint8)) and torch.equal(scale, expected_scale)
        )
        out["dequantized"].append(
            torch.equal(layer.weight.detach(), (expected.float() / expected_scale).to(full.dtype))
        )
        unit.release()
        out["emptied"].append(layer.precast.cast() is None)
        out["fp8_bytes"] += cast.bytes["all_gather"]
        out["exact_bytes"] += exact.bytes["all_gather"]
    engine.destroy()
    dist.barrier()
    return out


def fp8_training(rank: int) -> tuple[dict[str, torch.Tensor], list[bool]]:
    engine = engine_for(
        "fp32", {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}, fp8={"enabled": True, "emulate": True}
    )
    used: list[bool] = []
    for layer in engine.module.layers:
        layer.register_forward_pre_hook(lambda module, _args: used.append(module.precast.cast() is not None))
    return train(engine, rank), used


def all_cases(rank: int, world: int) -> dict[str, object]:
    return {
        "overflow": run_subtests(OVERFLOW, lambda **case: overflow_step(rank, **case)),
        "predivided": predivided_training(rank),
        "gathered": run_subtests(TRAIN, lambda dtype: gathered_fp8(rank, dtype)),
        "fp8_training": fp8_training(rank),
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    return run_distributed(all_cases, world_size=WORLD, tmp_dir=tmp_path_factory.mktemp("zero3_precision"))


def sgd_reference(steps: int) -> dict[str, torch.Tensor]:
    """One process, each batch's WORLD parts backwarded in turn, their gradients' mean stepped by SGD."""
    split = (WORLD, BATCH // WORLD, 1)
    return reference_run(lambda: TinyMLP(**MODEL), batches(), lr=0.5, steps=steps, optimizer="sgd", split=split).params


def fp8_reference(steps: int) -> dict[str, torch.Tensor]:
    """The same with the emulated tensorwise float8 layers and AdamW."""
    from slipstream.fp8 import convert_to_float8_training

    def model() -> torch.nn.Module:
        return convert_to_float8_training(TinyMLP(**MODEL), recipe="tensorwise", emulate=True)

    run = reference_run(model, batches(), lr=LR, steps=steps, weight_decay=0.01, split=(WORLD, BATCH // WORLD, 1))
    return run.params


def worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def test_gradients_are_divided_before_the_fp16_reduce_scatter(ranks: list[dict[str, object]]) -> None:
    torch.manual_seed(0)
    expected = torch.nn.Linear(4, 1, bias=False).weight.detach().add(torch.full((1, 4), 40000.0), alpha=-SGD_LR)
    for rank, result in enumerate(ranks):
        *divided, undivided = result["overflow"]
        for case, weight in zip(OVERFLOW, divided):
            assert torch.allclose(weight, expected, rtol=1e-6, atol=0), (rank, case, weight, expected)
        assert not torch.isfinite(undivided).all(), (rank, "the undivided fp16 sum was expected to overflow")


def test_predivided_training_matches_the_single_process_reference(ranks: list[dict[str, object]]) -> None:
    full, short = sgd_reference(STEPS), sgd_reference(STEPS - 1)
    for rank, result in enumerate(ranks):
        assert worst(result["predivided"], full) <= BOUND, (rank, worst(result["predivided"], full))
        assert worst(result["predivided"], short) > 2 * BOUND, (rank, "one step left out is within the bound")


def test_fp8_gathered_weights_are_the_local_cast_and_a_quarter_of_the_bytes(ranks: list[dict[str, object]]) -> None:
    for rank, result in enumerate(ranks):
        for case, gathered in zip(TRAIN, result["gathered"]):
            assert all(gathered["bits"]) and all(gathered["dequantized"]) and all(gathered["emptied"]), (
                rank,
                case,
                gathered,
            )
            itemsize = 4 if case["dtype"] == "fp32" else 2
            dims = [MODEL["in_dim"], MODEL["hidden"], MODEL["hidden"], MODEL["out_dim"]]
            weights = sum(a * b for a, b in zip(dims[:-1], dims[1:])) // WORLD  # per rank, no padding here
            biases = sum(dims[1:]) // WORLD
            tags = len(dims) - 1
            # exact rows: every element and one tag element in the dtype; float8 rows: weights 1 byte, a 4-byte tag
            assert gathered["exact_bytes"] == WORLD * itemsize * (weights + biases + tags), (rank, case, gathered)
            assert gathered["fp8_bytes"] == WORLD * (weights + itemsize * biases + 4 * tags), (rank, case, gathered)
            weight_share = (gathered["fp8_bytes"] - WORLD * (itemsize * biases + 4 * tags)) / (
                WORLD * itemsize * weights
            )
            assert weight_share == 1 / itemsize, (rank, case, weight_share)


def test_fp8_training_at_zero3_uses_the_gathered_weights_and_matches_the_reference(
    ranks: list[dict[str, object]],
) -> None:
    full, short = fp8_reference(STEPS), fp8_reference(STEPS - 1)
    for rank, result in enumerate(ranks):
        params, used = result["fp8_training"]
        assert used and all(used), (rank, "a forward ran without the gathered float8 weight")
        assert worst(params, full) <= BOUND, (rank, worst(params, full))
        assert worst(params, short) > 2 * BOUND, (rank, "one step left out is within the bound")
