"""cpu_lamb op: the native build equals the PyTorch fallback on known inputs (moments, updates, per-segment sums
of squares, the scaled update), for lengths around the SIMD width and chunk size, with and without
eps_inside_sqrt and weight decay; its argument checks name what is wrong."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

import slipstream.ops.fallback.cpu_lamb as fallback_op

LENGTHS = (1, 7, 17, 1029, 40000)
"""A scalar tail only, shorter than a vector, one vector and a tail, more than a sum block, more than a chunk."""


@pytest.fixture(scope="module")
def native_op() -> ModuleType:
    from slipstream.ops.op_builder import CPULambBuilder

    return CPULambBuilder().jit_load()


def _inputs(seed: int) -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    make = lambda n, scale=1.0: torch.randn(n, generator=gen) * scale  # noqa: E731
    return {
        "params": [make(n) for n in LENGTHS],
        "grads": [make(n, 0.1) for n in LENGTHS],
        "exp_avgs": [make(n, 0.01) for n in LENGTHS],
        "exp_avg_sqs": [make(n, 0.01).abs() for n in LENGTHS],
        "updates": [torch.full((n,), float("nan")) for n in LENGTHS],
    }


def _segments() -> torch.Tensor:
    """Whole tensors, and the 40000-element one cut in three parts (the middle one crossing a chunk boundary)."""
    rows = [(i, 0, n) for i, n in enumerate(LENGTHS[:-1])]
    last = len(LENGTHS) - 1
    rows += [(last, 0, 5), (last, 5, 33000), (last, 33000, 40000)]
    return torch.tensor(rows, dtype=torch.int64)


def _step(op: ModuleType, *, eps_inside_sqrt: bool, weight_decay: float) -> tuple[dict, torch.Tensor]:
    tensors = _inputs(seed=3)
    segments = _segments()
    sums = op.lamb_moments(*tensors.values(), segments, 0.9, 0.999, 1e-6, weight_decay, eps_inside_sqrt)
    scales = torch.linspace(0.01, 0.2, len(segments), dtype=torch.float64)
    op.lamb_apply(tensors["params"], tensors["updates"], segments, scales)
    return tensors, sums


@pytest.mark.needs_compiler
@pytest.mark.parametrize(("eps_inside_sqrt", "weight_decay"), [(False, 0.01), (True, 0.0)])
def test_native_equals_the_fallback(native_op: ModuleType, eps_inside_sqrt: bool, weight_decay: float) -> None:
    got, got_sums = _step(native_op, eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay)
    want, want_sums = _step(fallback_op, eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay)
    assert got_sums.dtype == torch.float64 and got_sums.shape == (len(_segments()), 2)
    torch.testing.assert_close(got_sums, want_sums, rtol=2e-6, atol=0.0)
    for name in want:
        for index, (g, w) in enumerate(zip(got[name], want[name], strict=True)):
            torch.testing.assert_close(g, w, rtol=2e-6, atol=1e-7, msg=lambda m, n=name, i=index: f"{n}[{i}]: {m}")


def test_the_fallback_is_lamb_on_a_known_input() -> None:
    """First step from zero moments: m = 0.1 g, v = 0.001 g^2, u = m / (sqrt(v) + eps) + wd p."""
    p, g = torch.tensor([3.0, -4.0]), torch.tensor([0.5, 0.25])
    m, v, u = torch.zeros(2), torch.zeros(2), torch.empty(2)
    segments = torch.tensor([[0, 0, 1], [0, 1, 2]])
    sums = fallback_op.lamb_moments([p], [g], [m], [v], [u], segments, 0.9, 0.999, 0.0, 0.5, False)
    expected_u = torch.tensor([0.1 / 0.001**0.5 + 1.5, 0.1 / 0.001**0.5 - 2.0])
    torch.testing.assert_close(u, expected_u)
    torch.testing.assert_close(sums, torch.stack([p.double() ** 2, expected_u.double() ** 2], dim=1), rtol=1e-6, atol=0)
    fallback_op.lamb_apply([p], [u], segments, torch.tensor([0.1, 0.0], dtype=torch.float64))
    torch.testing.assert_close(p, torch.tensor([3.0 - 0.1 * float(expected_u[0]), -4.0]))


@pytest.mark.needs_compiler
def test_native_checks_name_the_argument(native_op: ModuleType) -> None:
    t = torch.zeros(4)
    args = ([t], [t.clone()], [t.clone()], [t.clone()], [t.clone()])
    with pytest.raises(ValueError, match=r"segment 0 = \(0, 0, 5\) is outside"):
        native_op.lamb_moments(*args, torch.tensor([[0, 0, 5]]), 0.9, 0.999, 1e-6, 0.0, False)
    with pytest.raises(TypeError, match=r"grads\[0\] has dtype Double"):
        native_op.lamb_moments([t], [t.double()], *args[2:], torch.tensor([[0, 0, 4]]), 0.9, 0.999, 1e-6, 0.0, False)
    with pytest.raises(ValueError, match="one value per segment"):
        native_op.lamb_apply([t], [t.clone()], torch.tensor([[0, 0, 4]]), torch.zeros(2))


@pytest.mark.needs_compiler
def test_native_sums_do_not_depend_on_the_number_of_threads(native_op: ModuleType) -> None:
    """Above the serial threshold the chunks run on OpenMP threads; each sums into its own slot, added in order."""
    results = []
    before = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        gen = torch.Generator().manual_seed(5)
        p, g = torch.randn(150_000, generator=gen), torch.randn(150_000, generator=gen)
        m, v, u = torch.zeros_like(p), torch.zeros_like(p), torch.empty_like(p)
        segments = torch.tensor([[0, 0, 99_000], [0, 99_000, 150_000]])
        sums = native_op.lamb_moments([p], [g], [m], [v], [u], segments, 0.9, 0.999, 1e-6, 0.01, False)
        native_op.lamb_apply([p], [u], segments, torch.tensor([0.1, 0.2], dtype=torch.float64))
        results.append((sums, p))
    torch.set_num_threads(before)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_lamb_sends_fp32_cpu_tensors_to_its_op_and_the_rest_to_the_fallback() -> None:
    from slipstream.optim.lamb import FusedLamb

    optimizer = FusedLamb([torch.nn.Parameter(torch.ones(3))])
    pinned = ModuleType("pinned_cpu_lamb")
    optimizer._op = pinned
    assert optimizer._op_for([torch.ones(3), torch.ones(3)]) is pinned
    assert optimizer._op_for([torch.ones(3), torch.ones(3, dtype=torch.bfloat16)]) is fallback_op
    assert optimizer._op_for([torch.ones(3, 2).t()]) is fallback_op  # not contiguous
