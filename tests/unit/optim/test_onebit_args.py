"""The 1-bit optimizers' single-process surface: sign packing, argument checks, the ZeRO refusal, the aliases."""

from __future__ import annotations

import pytest
import torch

import slipstream
from slipstream.comm.compressed import pack_signs, unpack_signs
from slipstream.optim.onebit import OneBitAdam, ZeroOneAdam
from tests.harness.models import TinyMLP


def test_signs_pack_eight_to_a_byte_first_in_the_high_bit() -> None:
    rows = torch.tensor([[1.0, -1.0, 0.0, -0.5, 2.0, 3.0, -4.0, -0.0], [-1.0] * 7 + [1.0]])
    packed = pack_signs(rows)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0b10101101], [0b00000001]]  # 0 and -0 count as +
    assert torch.equal(unpack_signs(packed), torch.where(rows >= 0, 1.0, -1.0))


@pytest.mark.parametrize("cls", [OneBitAdam, ZeroOneAdam])
def test_arguments_are_checked_by_name(cls: type) -> None:
    params = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ValueError, match="comm_backend_name='ucx'.*nccl, gloo, mpi"):
        cls(params, comm_backend_name="ucx")
    with pytest.raises(ValueError, match="amsgrad"):
        cls(params, amsgrad=True)
    for backend in ("nccl", "gloo", "mpi"):
        cls(params, comm_backend_name=backend, cuda_aware=True)


@pytest.mark.parametrize("kind", ["OneBitAdam", "ZeroOneAdam"])
def test_sharded_zero_stages_refuse_them_by_name(kind: str) -> None:
    config = {"train_batch_size": 4, "optimizer": {"type": kind, "params": {"lr": 1e-3}},
              "zero_optimization": {"stage": 1}}
    with pytest.raises(ValueError, match=f"{kind} communicates its own gradients.*zero_optimization.stage to 0"):
        slipstream.initialize(model=TinyMLP(), config=config)


def test_deepspeed_import_paths() -> None:
    from slipstream.runtime.fp16.onebit import OnebitAdam
    from slipstream.runtime.fp16.onebit.zoadam import ZeroOneAdam as Aliased

    assert OnebitAdam is OneBitAdam and Aliased is ZeroOneAdam
