"""Stochastic rounding of bf16 masters (precision/masters.py) draws its noise into rows allocated once: the
result equals the plain definition (fresh random integers and mask) bit for bit on a fixed seed, and a step
after the first allocates nothing inside the rounding and keeps the same rows."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from slipstream.precision import masters
from slipstream.precision.masters import RoundingScratch, StochasticRounding, stochastic_round_


def _plain_stochastic_round(values: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The definition with fresh tensors: random 16-bit integers added to the fp32 bits, low 16 bits cleared,
    non-finite values unchanged."""
    noise = torch.randint(0, 1 << 16, values.shape, dtype=torch.int32, generator=generator)
    rounded = (values.view(torch.int32) + noise).bitwise_and_(-(1 << 16)).view(torch.float32)
    return torch.where(torch.isfinite(values), rounded, values).bfloat16()


def test_rounding_through_scratch_rows_equals_the_definition() -> None:
    values = torch.randn(3000, generator=torch.Generator().manual_seed(1)) * 5
    values[::97], values[1::89], values[2::83] = float("inf"), float("-inf"), float("nan")
    values[3::79] = torch.tensor(0x7FFFFFFF, dtype=torch.int32).view(torch.float32)  # nan, every mantissa bit set
    mine, plain = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    scratch = RoundingScratch.allocate(4096, values.device)  # longer than the values: a prefix is used
    for _ in range(3):
        out = torch.empty(3000, dtype=torch.bfloat16)
        stochastic_round_(out, values.clone(), mine, scratch)
        want = _plain_stochastic_round(values, plain)
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))  # nan bits included


class _Allocations(TorchDispatchMode):
    """Records the storage of every tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        result = func(*args, **(kwargs or {}))
        for tensor in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(tensor, torch.Tensor):
                self.storages.append((str(func), tensor.untyped_storage().data_ptr()))
        return result


def _recording(calls: list[_Allocations]) -> Callable[..., None]:
    def wrapper(*args: object) -> None:
        with _Allocations() as mode:
            stochastic_round_(*args)  # type: ignore[arg-type]
        calls.append(mode)

    return wrapper


def test_a_second_step_reuses_the_noise_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    generator = torch.Generator().manual_seed(3)
    pieces = [torch.randn(1000, generator=generator).bfloat16(), torch.randn(250, generator=generator).bfloat16()]
    optimizer = torch.optim.AdamW(pieces, lr=1e-2)
    rounding = StochasticRounding(chunk_numel=100)
    for piece in pieces:
        piece.grad = torch.randn(piece.shape, generator=generator).bfloat16()
    rounding.step(optimizer)
    assert rounding._noise is not None and rounding._scratch is not None
    noise, finite, rows = rounding._noise.noise, rounding._noise.finite, rounding._scratch
    pointers = (noise.data_ptr(), finite.data_ptr(), rows.data_ptr())
    before = [piece.detach().clone() for piece in pieces]
    calls: list[_Allocations] = []
    monkeypatch.setattr(masters, "stochastic_round_", _recording(calls))
    rounding.step(optimizer)
    assert len(calls) == 13  # 10 chunks of the first piece, 3 of the second
    assert rounding._noise.noise is noise and rounding._noise.finite is finite and rounding._scratch is rows
    assert (noise.data_ptr(), finite.data_ptr(), rows.data_ptr()) == pointers
    allowed = {t.untyped_storage().data_ptr() for t in (noise, finite, rows, *pieces)}
    fresh = [(op, ptr) for mode in calls for op, ptr in mode.storages if ptr not in allowed]
    assert not fresh, f"the rounding allocated new tensors: {fresh[:4]}"
    assert all(not torch.equal(a, b) for a, b in zip(before, pieces))  # it did step
