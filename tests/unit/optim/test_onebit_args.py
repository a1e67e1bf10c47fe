"""The 1-bit optimizers' single-process surface: sign packing, argument checks, the ZeRO refusal, the aliases."""

from __future__ import annotations

import pytest
import torch

import slipstream
from slipstream.comm.compressed import pack_signs, unpack_signs
from slipstream.comm.compressed.onebit import Scratch, compress_rows, decompress_rows
from slipstream.optim.onebit import OneBitAdam, OneBitLamb, ZeroOneAdam
from tests.harness.models import TinyMLP


def test_signs_pack_eight_to_a_byte_first_in_the_high_bit() -> None:
    rows = torch.tensor([[1.0, -1.0, 0.0, -0.5, 2.0, 3.0, -4.0, -0.0], [-1.0] * 7 + [1.0]])
    packed = pack_signs(rows)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0b10101101], [0b00000001]]  # 0 and -0 count as +
    assert torch.equal(unpack_signs(packed), torch.where(rows >= 0, 1.0, -1.0))


def test_every_byte_unpacks_to_its_bits() -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(256, 1)
    bits = [[(code >> (7 - k)) & 1 for k in range(8)] for code in range(256)]
    assert torch.equal(unpack_signs(codes), torch.tensor(bits, dtype=torch.float32) * 2 - 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compressed_rows_are_scale_times_sign_and_the_error_is_the_rest(dtype: torch.dtype) -> None:
    rows = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    rows[0, :3] = torch.tensor([0.0, -0.0, -1.0])
    scratch = Scratch.allocate(rows.numel(), dtype, rows.device)
    packed, error = torch.empty(3, 64 // 8 + 4, dtype=torch.uint8), torch.empty_like(rows)
    compress_rows(rows, error, packed, scratch)
    scales = (torch.linalg.vector_norm(rows, dim=1, keepdim=True) / 8).to(dtype)
    expected = scales * torch.where(rows >= 0, 1.0, -1.0).to(dtype)
    assert torch.equal(decompress_rows(packed, scratch), expected)
    assert torch.equal(error, rows - expected)


@pytest.mark.parametrize("cls", [OneBitAdam, ZeroOneAdam, OneBitLamb])
def test_arguments_are_checked_by_name(cls: type) -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="comm_backend_name='ucx'.*nccl, gloo, mpi"):
        cls(params, comm_backend_name="ucx")
    with pytest.raises(ValueError, match="amsgrad"):
        cls(params, amsgrad=True)
    for backend in ("nccl", "gloo", "mpi"):
        cls(params, comm_backend_name=backend, cuda_aware=True)


@pytest.mark.parametrize(
    ("kind", "stage", "why", "fix"),
    [
        ("OneBitAdam", 2, "stages 2-3 shard the gradients themselves", "0 or 1"),
        ("OneBitAdam", 3, "stages 2-3 shard the gradients themselves", "0 or 1"),
        ("ZeroOneAdam", 1, "local steps compress this rank's whole gradient", "0"),
        ("ZeroOneAdam", 2, "stages 2-3 shard", "0"),
        ("OneBitLamb", 1, "scales each tensor's whole momentum", "0"),
        ("OneBitLamb", 3, "stages 2-3 shard", "0"),
    ],
)
def test_sharded_zero_stages_refuse_them_by_name(kind: str, stage: int, why: str, fix: str) -> None:
    """1-bit Adam runs at ZeRO 0 and 1 ([Note: 1-bit gradients at stage 1]); the rest is refused, naming the
    stage, the reason and the stages that work."""
    config = {
        "train_batch_size": 4,
        "optimizer": {"type": kind, "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage},
    }
    expected = f"{kind} communicates its own gradients.*ZeRO stage {stage}.*{why}.*zero_optimization.stage to {fix},"
    with pytest.raises(ValueError, match=expected):
        slipstream.initialize(model=TinyMLP(), config=config)


def test_onebit_adam_is_built_at_zero_stage_1() -> None:
    config = {
        "train_batch_size": 4,
        "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 1}},
        "zero_optimization": {"stage": 1},
    }
    engine = slipstream.initialize(model=TinyMLP(), config=config)[0]
    assert isinstance(engine.basic_optimizer, OneBitAdam) and engine.basic_optimizer.compresses_gradients() is False
    engine.destroy()  # one rank: no bucket is reduced, so none is compressed


def test_positional_arguments_follow_deepspeed_order() -> None:
    """[Note: declared arguments]: positional values bind in DeepSpeed's order; unknown or doubled names fail."""
    import inspect

    params = [torch.nn.Parameter(torch.zeros(3))]
    adam = OneBitAdam(params, None, 0.5, 7)
    assert (adam.defaults["lr"], adam.freeze_step) == (0.5, 7)
    lamb = OneBitLamb(params, None, 0.5, 3, True, (0.8, 0.9), 1e-6, False, 0.1, 0.0, 5.0)
    assert (lamb.freeze_step, lamb.defaults["betas"], lamb.defaults["weight_decay"], lamb.defaults["max_coeff"]) == (
        3,
        (0.8, 0.9),
        0.1,
        5.0,
    )
    assert list(inspect.signature(ZeroOneAdam.__init__).parameters)[10:14] == [
        "var_freeze_step",
        "var_update_scaler",
        "local_step_scaler",
        "local_step_clipper",
    ]
    with pytest.raises(TypeError, match=r"unknown arguments \['lrr'\]"):
        OneBitAdam(params, lrr=0.1)
    with pytest.raises(TypeError, match=r"doubled arguments \['lr'\]"):
        OneBitAdam(params, None, 0.1, lr=0.2)


def test_deepspeed_import_paths() -> None:
    from slipstream.runtime.fp16.onebit import OnebitAdam, OnebitLamb
    from slipstream.runtime.fp16.onebit.lamb import OnebitLamb as AliasedLamb
    from slipstream.runtime.fp16.onebit.zoadam import ZeroOneAdam as Aliased

    assert OnebitAdam is OneBitAdam and Aliased is ZeroOneAdam
    assert OnebitLamb is OneBitLamb and AliasedLamb is OneBitLamb


def test_both_warm_up_optimizers_check_freeze_step() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    for cls in (OneBitAdam, OneBitLamb):
        with pytest.raises(ValueError, match=f"{cls.__name__}: .*freeze_step=-1 must be >= 0"):
            cls(params, freeze_step=-1)
        assert cls(params, freeze_step=0).freeze_step == 0


def test_onebit_lamb_arguments_are_checked_by_name() -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    for bad, named in (
        ({"freeze_step": -1}, "freeze_step=-1"),
        ({"min_coeff": 0.0}, "min_coeff=0.0"),
        ({"coeff_beta": 1.0}, "coeff_beta=1.0"),
        ({"factor_min": 5.0}, "factor_min=5.0"),
        ({"factor_threshold": -0.1}, "factor_threshold=-0.1"),
    ):
        with pytest.raises(ValueError, match=f"OneBitLamb: .*{named}"):
            OneBitLamb(params, **bad)
