"""DeepSpeed's `deepspeed.comm` functions and `safe_get_*` helpers on two ranks: the values each rank gets are
the ones torch.distributed's semantics define, every collective is counted, a rank that never arrives is
named within the timeout, and the full fp32 parameters agree with the gathered model at ZeRO-2 and ZeRO-3."""

from __future__ import annotations

import time

import torch

from tests.harness import run_distributed
from tests.harness.models import TinyMLP


def comm_calls(rank: int, world: int) -> dict:
    from slipstream import comm

    out: dict = {"rank": comm.get_rank(), "world": comm.get_world_size()}
    with comm.count_collectives() as counter:
        t = torch.tensor([float(rank + 1)])
        comm.all_reduce(t)
        out["sum"] = t.item()
        t = torch.tensor([float(rank + 1)])
        comm.all_reduce(t, op=comm.ReduceOp.MAX)
        out["max"] = t.item()
        parts = [torch.empty(2) for _ in range(world)]
        comm.all_gather(parts, torch.tensor([rank, 10.0 + rank]))
        out["all_gather"] = [p.tolist() for p in parts]
        flat = torch.empty(2 * world)
        comm.all_gather_into_tensor(flat, torch.tensor([rank, 10.0 + rank]))
        out["all_gather_into_tensor"] = flat.tolist()
        mine = torch.empty(2)
        comm.reduce_scatter_tensor(mine, torch.arange(4.0) * (rank + 1))
        out["reduce_scatter_tensor"] = mine.tolist()
        mine = torch.empty(2)
        comm.reduce_scatter(mine, [torch.ones(2) * (rank + 1), torch.ones(2) * 10 * (rank + 1)])
        out["reduce_scatter"] = mine.tolist()
        b = torch.tensor([float(rank)]) + 5
        comm.broadcast(b, src=1)
        out["broadcast"] = b.item()
        r = torch.tensor([float(rank + 1)])
        comm.reduce(r, dst=0)
        out["reduce_on_0"] = r.item() if rank == 0 else None
        swapped = torch.empty(2)
        comm.all_to_all_single(swapped, torch.tensor([rank * 10.0, rank * 10.0 + 1]))
        out["all_to_all_single"] = swapped.tolist()
        group = comm.new_group([0, 1])
        g = torch.ones(1)
        work = comm.all_reduce(g, group=group, async_op=True)
        work.wait()
        out["group_sum"] = g.item()
        comm.barrier()
        objects: list = [None] * world
        comm.all_gather_object(objects, {"rank": rank})
        out["objects"] = objects
        counted = dict(counter.calls)
    out["counted"] = counted

    from slipstream.comm import CollectiveTimeout
    from slipstream.comm.collectives import set_collective_timeout

    set_collective_timeout(2)
    if rank == 1:
        time.sleep(3)  # never joins the next all_reduce
        out["timeout"] = "skipped"
        return out
    try:
        comm.all_reduce(torch.ones(1))
        out["timeout"] = "no error"
    except CollectiveTimeout as exc:
        out["timeout"] = f"missing={exc.missing} {exc}"
    return out


def both(rank: int, world: int) -> tuple[list[dict], dict]:
    """One spawn for both checks (a spawn costs seconds); the timeout check runs last, it leaves rank 1 out."""
    return full_params(rank, world), comm_calls(rank, world)


def test_deepspeed_comm_and_safe_get_on_two_ranks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (params_0, first), (params_1, second) = run_distributed(both, world_size=2, tmp_dir=tmp_path, timeout_s=180)
    check_full_params(params_0, params_1)
    for rank, got in enumerate((first, second)):
        assert (got["rank"], got["world"], got["sum"], got["max"]) == (rank, 2, 3.0, 2.0)
        assert got["all_gather"] == [[0.0, 10.0], [1.0, 11.0]]
        assert got["all_gather_into_tensor"] == [0.0, 10.0, 1.0, 11.0]
        assert got["reduce_scatter_tensor"] == [[0.0, 3.0], [6.0, 9.0]][rank]  # arange(4) * (1 + 2)
        assert got["reduce_scatter"] == [[3.0, 3.0], [30.0, 30.0]][rank]
        assert got["broadcast"] == 6.0 and got["group_sum"] == 2.0
        assert got["all_to_all_single"] == [[0.0, 10.0], [1.0, 11.0]][rank]
        assert got["objects"] == [{"rank": 0}, {"rank": 1}]
        counted = got["counted"]
        assert counted["all_reduce"] == 3 and counted["all_gather"] == 2 and counted["reduce_scatter"] == 2
        assert counted["broadcast"] == 1 and counted["barrier"] == 1 and counted["all_to_all"] == 1
    assert first["reduce_on_0"] == 3.0
    assert "missing=[1]" in first["timeout"] and "all_reduce" in first["timeout"], first["timeout"]


def full_params(rank: int, world: int) -> list[dict]:
    import slipstream
    from slipstream.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state, safe_set_full_fp32_param

    results = []
    for stage in (2, 3):
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
            "zero_optimization": {"stage": stage},
        }
        engine, *_ = slipstream.initialize(model=TinyMLP(), config=config)
        x, y = TinyMLP().make_batch(seed=rank, batch_size=4)
        engine.backward(TinyMLP.loss(engine(x), y))
        engine.step()
        params = list(engine.module.parameters())
        full = {i: safe_get_full_fp32_param(p) for i, p in enumerate(params)}
        exp_avg = {i: safe_get_full_optimizer_state(p, "exp_avg") for i, p in enumerate(params)}
        with slipstream.zero.GatheredParameters(params):
            gathered = {i: p.detach().clone() for i, p in enumerate(params)}
        safe_set_full_fp32_param(params[0], torch.full(tuple(full[0].shape), 0.25))
        with slipstream.zero.GatheredParameters(params[:1]):
            after_set = params[0].detach().clone()
        results.append({"full": full, "gathered": gathered, "exp_avg": exp_avg, "after_set": after_set})
        engine.destroy()
    return results


def check_full_params(first: list[dict], second: list[dict]) -> None:
    for stage, a, b in zip((2, 3), first, second):
        for i, value in a["full"].items():
            assert value.shape == a["gathered"][i].shape, (stage, i)
            assert torch.equal(value, a["gathered"][i]) and torch.equal(value, b["full"][i]), (stage, i)
            assert torch.equal(a["exp_avg"][i], b["exp_avg"][i]) and a["exp_avg"][i].abs().sum() > 0, (stage, i)
        assert torch.equal(a["after_set"], torch.full_like(a["after_set"], 0.25)), stage
        assert torch.equal(b["after_set"], a["after_set"]), stage
