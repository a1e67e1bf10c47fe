"""The planner counts the 1-bit optimizers' compressed all-reduce ([Note: compressed all-reduce bytes] in
planner/zero_bytes.py): at 2 ranks, after compression has started, the bytes its tensors hold (counted here from
the all-reduce objects, each storage once) equal the planner's term within 5%, the optimizer reports exactly
them (`owned_bytes()`), and the engine's model-state bytes by role equal the planner's within 5%, at ZeRO 0
(1-bit Adam in fp32 and bf16, 0/1 Adam, 1-bit LAMB) and ZeRO 1 (1-bit Adam in fp32 and bf16). bf16 gradients
with fp32 masters tell the two stages apart: stage 0 compresses the masters' fp32 momentum, stage 1 the bf16
gradient buckets. The ratios are printed (`pytest -s`).
"""

from __future__ import annotations

import dataclasses

import torch

from tests.harness import run_distributed
from tests.harness.models import TinyMLP

BF16 = {"bf16": {"enabled": True}}
BF16_GRADS = {**BF16, "data_types": {"grad_accum_dtype": "bf16"}}
BF16_MASTERS = {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}}
ADAM = ("OneBitAdam", {"freeze_step": 1})
CASES = [  # (stage, (optimizer type, its own params), precision sections)
    (0, ADAM, {}),
    (0, ADAM, BF16_GRADS),
    (0, ("ZeroOneAdam", {"var_update_scaler": 1}), {}),  # steps 1, 2 full precision, then compressed
    (0, ("OneBitLamb", {"freeze_step": 1}), {}),
    (1, ADAM, {}),
    (1, ADAM, BF16_GRADS),
    (1, ADAM, BF16_MASTERS),
]
STEPS = 4


def _config(stage: int, optimizer: tuple[str, dict], precision: dict) -> dict:
    name, params = optimizer
    return {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": name, "params": {"lr": 1e-3, "comm_backend_name": "gloo", **params}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 1000},  # buckets of 190, 1406 and 518 elements
        "gradient_clipping": 0.0,
        **precision,
    }


def _counted(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor the compressed all-reduces reach (their own and their work buffers), each storage
    once: what they hold, counted without their own accounting."""
    storages: dict[int, int] = {}
    for reduce in optimizer._all_reduces.values():  # type: ignore[attr-defined]
        for value in vars(reduce).values():
            tensors = [value] if isinstance(value, torch.Tensor) else []
            if dataclasses.is_dataclass(value):
                tensors = [getattr(value, f.name) for f in dataclasses.fields(value)]
            for tensor in tensors:
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def grid(rank: int, world: int) -> list[dict]:
    import slipstream
    from slipstream.planner import engine_estimate
    from slipstream.planner.zero_bytes import compressed_allreduce_bytes

    results = []
    for stage, optimizer, precision in CASES:
        model = TinyMLP()
        engine, *_ = slipstream.initialize(model=model, config=_config(stage, optimizer, precision))
        for seed in range(STEPS):
            inputs, targets = model.make_batch(seed=10 * seed + rank, batch_size=2)
            engine.backward(TinyMLP.loss(engine(inputs).float(), targets))
            engine.step()
        zero, onebit = engine.optimizer, engine.optimizer.optimizer
        slots = [b.padded_numel for flat in zero.groups for b in flat.layout.buckets]
        dtype_bytes = next(iter(onebit._all_reduces.values())).worker_error.element_size()
        term = compressed_allreduce_bytes(slots, world=world, dtype_bytes=dtype_bytes)
        predicted = engine_estimate(plan=engine.plan, model=engine.module, world_size=world)
        results.append({
            "case": (stage, optimizer[0], precision), "dtype_bytes": dtype_bytes, "counted": _counted(onebit), "reported": onebit.owned_bytes(),
            "term": term, "owned": dict(zero.owned_bytes()), "predicted": dict(predicted.owned),
            "model_states": predicted.model_states, "num_reduces": len(onebit._all_reduces),
        })  # fmt: skip
        engine.destroy()
    return results


def test_the_planner_counts_the_compressed_allreduce(tmp_path) -> None:  # type: ignore[no-untyped-def]
    measured = run_distributed(grid, world_size=2, tmp_dir=tmp_path, timeout_s=240)
    for per_rank in measured:
        for result in per_rank:
            counted, term = result["counted"], sum(result["term"].values())
            owned, predicted = result["owned"], result["predicted"]
            held = sum(owned.values())
            print(f"{result['case']}: compressed all-reduce planner {term:,} B / held {counted:,} B = "
                  f"{term / counted:.3f}; model states planner {result['model_states']:,} B / held {held:,} B = "
                  f"{result['model_states'] / held:.3f}")
            assert result["num_reduces"] == 3, result  # one per bucket: compression has started everywhere
            stage, precision = result["case"][0], result["case"][2]
            assert result["dtype_bytes"] == (2 if (stage == 1 and precision) or precision == BF16_MASTERS else 4)
            assert sum(result["reported"].values()) == counted, result
            assert abs(term - counted) <= 0.05 * counted, result
            for role, value in owned.items():
                assert abs(predicted.get(role, 0) - value) <= 0.05 * max(value, 1), (role, result)
            assert abs(result["model_states"] - held) <= 0.05 * held, result
