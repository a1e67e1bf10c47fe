"""Tests of the test harness itself: the gloo runner, the decorator, subtests, models and the reference.

Each run_distributed call spawns 2 ranks (~2-3 s on 2 cores); the file stays around 25 s in all.
"""

from __future__ import annotations

import functools
import inspect
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.harness import (
    DistributedTestError,
    DistributedTimeoutError,
    SubtestError,
    distributed,
    run_distributed,
    run_subtests,
    subtest_grid,
)
from tests.harness import dist as dist_harness
from tests.harness.models import TinyMLP, TinyTransformer
from tests.harness.reference import reference_run, train_reference


def _all_reduce_sum(rank: int, world_size: int, *, scale: float) -> dict[str, object]:
    t = torch.tensor([float(rank + 1) * scale])
    dist.all_reduce(t)
    return {"rank": rank, "world_size": world_size, "sum": t, "threads": torch.get_num_threads()}


def test_results_come_back_per_rank() -> None:
    results = run_distributed(_all_reduce_sum, world_size=2, timeout_s=60, scale=2.0)
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        assert r["world_size"] == 2 and r["threads"] == 1
        torch.testing.assert_close(r["sum"], torch.tensor([6.0]))


def _raise_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank 1")


def test_exception_carries_rank_and_traceback() -> None:
    with pytest.raises(DistributedTestError, match=r"rank 1 of 2 failed first") as info:
        run_distributed(_raise_on_rank_1, world_size=2, timeout_s=60)
    message = str(info.value)
    assert "Traceback (most recent call last)" in message
    assert "_raise_on_rank_1" in message and "ValueError: boom from rank 1" in message
    assert "--- rank 0" not in message  # rank 0 succeeded and is not blamed


def _hang_on_rank_1(rank: int, world_size: int, *, pid_dir: str) -> None:
    Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    if rank == 1:
        while True:
            time.sleep(0.1)


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_hung_rank_is_named_and_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist_harness, "_load_factor", lambda: 1.0)  # the bound below as on an idle machine
    start = time.monotonic()
    with pytest.raises(DistributedTimeoutError, match=r"rank\(s\) \[1\] of 2 still running after") as info:
        run_distributed(_hang_on_rank_1, world_size=2, timeout_s=5.0, pid_dir=str(tmp_path))
    # timeout_s counts from the moment both ranks are in the function (startup varies with the machine's load);
    # from then on: 5 s, the stack dump (0.5 s) and the kill, with 10 s of margin for a loaded machine
    assert info.value.startup_s is not None
    assert time.monotonic() - start - info.value.startup_s < 5.0 + 10.0
    message = str(info.value)
    assert "finished: [0]" in message
    assert "_hang_on_rank_1" in message  # the hung rank's Python stack is in the report
    pids = [int(tmp_path.joinpath(f"rank{r}.pid").read_text()) for r in range(2)]
    assert not [pid for pid in pids if _is_alive(pid)], "a rank outlived run_distributed"
    assert mp.active_children() == []


def _sleep(rank: int, world_size: int, seconds: float) -> int:
    time.sleep(seconds)
    return rank


def test_timeout_counts_idle_machine_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a machine 4x oversubscribed, 3 s of wall time are 0.75 s of an idle one: within timeout_s=2."""
    monkeypatch.setattr(dist_harness, "_load_factor", lambda: 4.0)
    assert run_distributed(_sleep, world_size=2, timeout_s=2.0, seconds=3.0) == [0, 1]
    monkeypatch.setattr(dist_harness, "_load_factor", lambda: 1.0)
    with pytest.raises(DistributedTimeoutError):
        run_distributed(_sleep, world_size=2, timeout_s=2.0, seconds=3.0)


def test_load_factor_is_the_load_per_core_within_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist_harness.os, "cpu_count", lambda: 2)
    for load, factor in ((0.3, 1.0), (6.0, 3.0), (100.0, dist_harness._MAX_LOAD_FACTOR)):
        monkeypatch.setattr(dist_harness.os, "getloadavg", lambda load=load: (load, 0.0, 0.0))
        assert dist_harness._load_factor() == factor


def _skip_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        pytest.skip("widget not available")


def test_skip_in_rank_becomes_skip() -> None:
    with pytest.raises(pytest.skip.Exception, match=r"rank 1: widget not available"):
        run_distributed(_skip_on_rank_1, world_size=2, timeout_s=60)


@distributed(world_size=2, timeout_s=60)
def test_decorator_passes_fixtures(rank: int, world_size: int, tmp_path: Path) -> None:
    tmp_path.joinpath(f"rank{rank}").write_text(str(world_size))
    dist.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


def test_decorator_signature_hides_rank_args() -> None:
    assert list(inspect.signature(test_decorator_passes_fixtures).parameters) == ["tmp_path", "tmp_path_factory"]
    assert test_decorator_passes_fixtures.__name__ == "test_decorator_passes_fixtures"


def _fail_on(a: int, b: int, *, bad: tuple[int, int]) -> int:
    if (a, b) == bad:
        raise AssertionError(f"mismatch at a={a}")
    return a * b


def test_run_subtests_in_process() -> None:
    grid = subtest_grid(a=[1, 2], b=[3, 4])
    assert grid == [{"a": 1, "b": 3}, {"a": 1, "b": 4}, {"a": 2, "b": 3}, {"a": 2, "b": 4}]
    assert run_subtests(grid, functools.partial(_fail_on, bad=(0, 0))) == [3, 4, 6, 8]
    with pytest.raises(SubtestError, match=r"subtest 3/4 failed for case \{'a': 2, 'b': 3\}: AssertionError"):
        run_subtests(grid, functools.partial(_fail_on, bad=(2, 3)))


def _subtests_in_rank(rank: int, world_size: int) -> None:
    def case(size: int) -> None:
        t = torch.ones(size) * rank
        dist.all_reduce(t)
        if rank == 0 and size == 7:
            raise AssertionError(f"size {size} padded wrong")

    run_subtests(subtest_grid(size=[4, 7, 9]), case)


def test_run_subtests_names_case_across_ranks() -> None:
    with pytest.raises(DistributedTestError, match=r"rank 0 of 2 failed first") as info:
        run_distributed(_subtests_in_rank, world_size=2, timeout_s=60)
    assert "subtest 2/3 failed for case {'size': 7}" in str(info.value)


def test_unpicklable_function_is_rejected_before_spawn() -> None:
    with pytest.raises(TypeError, match="define it at module level"):
        run_distributed(lambda rank, world_size: None)
    with pytest.raises(TypeError, match=r"first two parameters are \(rank, world_size\)"):
        distributed()(_fail_on)


def test_models_are_deterministic_and_odd_shaped() -> None:
    mlp_a, mlp_b = TinyMLP(seed=3), TinyMLP(seed=3)
    torch.manual_seed(123)  # the global RNG must not matter
    for (name, a), b in zip(mlp_a.state_dict().items(), mlp_b.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert [tuple(layer.weight.shape) for layer in mlp_a.layers] == [(37, 13), (37, 37), (5, 37)]
    x, y = mlp_a.make_batch(seed=1, batch_size=4)
    torch.testing.assert_close(x, mlp_b.make_batch(seed=1, batch_size=4)[0], rtol=0, atol=0)
    assert mlp_a.loss(mlp_a(x), y).ndim == 0
    lm = TinyTransformer()
    tokens, targets = lm.make_batch(seed=0, batch_size=3)
    assert tokens.shape == targets.shape == (3, 8)
    assert torch.equal(tokens[:, 1:], targets[:, :-1])
    assert lm(tokens).shape == (3, 8, 61) and len(lm.layers) == 2


@pytest.mark.parametrize("model_cls", [TinyMLP, TinyTransformer])
def test_reference_training_lowers_loss(model_cls: type[torch.nn.Module]) -> None:
    model_fn = functools.partial(model_cls, seed=0)
    template = model_fn()
    batches = [template.make_batch(seed=s, batch_size=8) for s in range(2)]  # type: ignore[operator]
    losses, state = train_reference(model_fn, batches, lr=1e-2, steps=20, weight_decay=0.01, grad_clip=1.0)
    assert len(losses) == 20 and losses[-1] < 0.7 * losses[0]
    again, state_again = train_reference(model_fn, batches, lr=1e-2, steps=20, weight_decay=0.01, grad_clip=1.0)
    assert again == losses
    assert state.keys() == template.state_dict().keys()
    for name, value in state.items():
        torch.testing.assert_close(value, state_again[name], rtol=0, atol=0, msg=name)


def test_reference_run_norms_split_and_bf16_masters() -> None:
    batches = [TinyMLP().make_batch(seed=s, batch_size=8) for s in range(3)]
    full = reference_run(TinyMLP, batches, lr=1e-2, steps=3, weight_decay=0.1, grad_clip=0.1)
    model = TinyMLP()  # the first step's norm by hand: the full-batch gradient of the initial model
    TinyMLP.loss(model(batches[0][0]), batches[0][1]).backward()
    first = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).norm()
    assert full.grad_norms[0] == pytest.approx(float(first), rel=1e-6) and min(full.grad_norms) > 0.1
    # the engine's split (2 ranks x 2 micro-batches of 2) averages to the full-batch gradient in fp32
    split = reference_run(TinyMLP, batches, lr=1e-2, steps=3, weight_decay=0.1, grad_clip=0.1, split=(2, 2, 2))
    torch.testing.assert_close(split.grad_norms, full.grad_norms, rtol=1e-6, atol=0)
    torch.testing.assert_close(split.losses, full.losses, rtol=1e-6, atol=0)
    for name, value in full.masters.items():
        torch.testing.assert_close(split.masters[name], value, rtol=1e-5, atol=1e-7)
        assert torch.equal(full.params[name], value)
        assert set(full.optimizer_state[name]) == {"exp_avg", "exp_avg_sq"}
    bf16 = reference_run(TinyMLP, batches, lr=1e-2, steps=3, weight_decay=0.1, grad_clip=0.1, split=(2, 2, 2),
                         dtype=torch.bfloat16)
    for name, master in bf16.masters.items():
        assert master.dtype == torch.float32 and bf16.params[name].dtype == torch.bfloat16
        assert torch.equal(bf16.params[name], master.to(torch.bfloat16))  # the model holds the cast masters
        gap = float((master - full.masters[name]).abs().max())
        assert gap > 1e-5, (name, gap)  # bf16 rounding changes the trajectory (by up to 2e-2 here: Adam amplifies)
