"""engine.offload_states() / reload_states() at ZeRO 1, 2 and 3 (fp32 and bf16), and iter_full_weights().

Offload: the bytes of the storages the engine reaches on its device (tests/harness/device_bytes.py, written
apart from the offload's own list) fall to at most 5% after `offload_states()` and come back after
`reload_states()`; no collective is issued; forward is refused while the states are away; a partial offload
(`include=[OffloadStateTypeEnum.optim_states]`, DeepSpeed's import path) releases exactly the optimizer states;
unknown state names and NVMe are refused by name. Training continues bit-equal: an engine
that went through the round trip after 2 steps has, after 2 more, the same parameters (torch.equal) as one
trained 4 steps straight.
iter_full_weights: equals the consolidated state dict (stage 3: ZeroModel.full_state), and at stage 3 with a
small bucket no gather holds more than the bucket (or one unit when a unit is larger), each unit gathered once.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_distributed
from tests.harness.device_bytes import device_bytes
from tests.harness.models import TinyMLP

CASES = [(1, "fp32"), (2, "bf16"), (3, "fp32"), (3, "bf16")]
SKIP = frozenset({"_offloaded_states"})
BUCKET = 3000  # bytes: the 37x37 unit (5.5 KB in fp32) is a bucket of its own, the small ones share one


def _engine(stage: int, precision: str):  # type: ignore[no-untyped-def]
    import slipstream

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 700,
                                    "stage3_param_persistence_threshold": 0},
              "bf16": {"enabled": precision == "bf16"}}
    engine, *_ = slipstream.initialize(model=TinyMLP(hidden=37), config=config)
    return engine


def _train(engine, rank: int, steps: range) -> None:  # type: ignore[no-untyped-def]
    for step in steps:
        inputs, targets = TinyMLP().make_batch(seed=50 + step, batch_size=4)
        engine.backward(TinyMLP.loss(engine(inputs[2 * rank:2 * rank + 2]), targets[2 * rank:2 * rank + 2]))
        engine.step()


def _full(engine) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    return {name: value.clone() for name, value in engine.iter_full_weights()}


def _check_offload(engine, rank: int) -> None:  # type: ignore[no-untyped-def]
    from slipstream.comm import count_collectives

    before = device_bytes(engine, device=engine.device, skip=SKIP)
    with count_collectives() as counter:
        engine.offload_states()
    after = device_bytes(engine, device=engine.device, skip=SKIP)
    assert after <= 0.05 * before, f"{after} of {before} bytes still on the device after offload_states()"
    assert not counter.calls, counter.calls
    assert {k.value for k in engine.offloaded_state_types()} >= {"lp_params", "lp_grads", "optim_states"}
    with pytest.raises(RuntimeError, match="reload_states"):
        engine(TinyMLP().make_batch(seed=0, batch_size=2)[0])
    engine.reload_states()
    assert device_bytes(engine, device=engine.device, skip=SKIP) == before
    assert not engine.offloaded_state_types()
    state_bytes = sum(v.numel() * v.element_size() for s in engine.optimizer.optimizer.state.values()
                      for v in s.values() if isinstance(v, torch.Tensor))
    from slipstream.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum  # DeepSpeed's path

    engine.offload_states(include=[OffloadStateTypeEnum.optim_states], device=OffloadDeviceEnum.cpu, non_blocking=True)
    assert before - device_bytes(engine, device=engine.device, skip=SKIP) == state_bytes
    engine.reload_states(non_blocking=True)
    with pytest.raises(ValueError, match="unknown state type.*lp_weights"):
        engine.offload_states(include=["lp_weights"])
    with pytest.raises(ValueError, match="NVMe is not supported"):
        engine.offload_states(device="nvme")


def _check_full_weights(engine, stage: int) -> None:  # type: ignore[no-untyped-def]
    if stage == 3:
        expected = engine.zero_model.full_state(only_rank0=False)
    else:
        expected = {name: value.detach().clone() for name, value in engine.module.state_dict().items()}
    got = _full(engine)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name].cpu(), value.cpu()), name
    if stage != 3:
        return
    zero_model, sizes, gathered = engine.zero_model, [], []
    real_gather = zero_model.gather_units

    def spy(units, **kwargs):  # type: ignore[no-untyped-def]
        sizes.append(sum(u.full_bytes for u in units))
        gathered.extend(u.uid for u in units)
        return real_gather(units, **kwargs)

    zero_model.gather_units = spy
    try:
        for _name, _value in engine.iter_full_weights(bucket_bytes=BUCKET):
            pass
    finally:
        del zero_model.gather_units
    largest = max(u.full_bytes for u in zero_model.units)
    assert max(sizes) <= max(BUCKET, largest) and len(sizes) > 1, sizes
    assert sorted(gathered) == sorted({u.uid for u in zero_model.units if u.params}), gathered


def rank_fn(rank: int, world: int) -> None:
    for stage, precision in CASES:
        straight = _engine(stage, precision)
        _train(straight, rank, range(4))
        engine = _engine(stage, precision)
        _train(engine, rank, range(2))
        _check_offload(engine, rank)
        _train(engine, rank, range(2, 4))
        mine, theirs = _full(engine), _full(straight)
        for name, value in theirs.items():
            assert torch.equal(mine[name], value), f"stage {stage} {precision}: {name} differs after the round trip"
        _check_full_weights(engine, stage)


def test_offload_states_round_trip_and_full_weights(tmp_path) -> None:  # type: ignore[no-untyped-def]
    run_distributed(rank_fn, world_size=2, tmp_dir=tmp_path, timeout_s=180)
