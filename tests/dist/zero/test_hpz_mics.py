"""ZeRO++ hpZ (`zero_hpz_partition_size`) and MiCS (`mics_shard_size`) against plain stage 3.

Both move the values plain stage 3 moves, so losses and parameters after a few steps are equal to the last bit
(gradient clipping off: the global norm is summed over other shards, equal only to rounding, and is compared
separately). At 4 ranks as 2 "nodes" x 2 (LOCAL_WORLD_SIZE=2): hpZ's backward all-gathers stay inside a node,
MiCS' gathers and reduce-scatters inside its shard groups and its all-reduces across them. MiCS at 4 ranks sums a
gradient as (r0 + r1) + (r2 + r3) where gloo's all-reduce adds in ring order, so its parity case uses a model whose
gradients are small integers (every order gives the same sum); at 2 ranks with one rank per shard group the sums
are the same two terms and the MLP is used, built under MiCS_Init. Checkpoints saved by each option at 4 ranks
load at 2 ranks without it. hpZ's secondary shards and MiCS' shards are the bytes the planner counts. One spawn
per world size."""

from __future__ import annotations

import os

import torch
from torch import nn

from tests.harness import run_distributed, run_subtests
from tests.harness.models import TinyMLP

MICRO, STEPS = 4, 2
NODES = [(0, 1), (2, 3)]
"""The "nodes" of 4 ranks with LOCAL_WORLD_SIZE=2."""


class IntegerGrads(nn.Module):
    """Three linear layers, each on its own integer input, the loss the sum of their outputs: every gradient is a
    sum of small integers, exact in any order."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.layers = nn.ModuleList(nn.Linear(13, 7) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x[:, i]).sum() for i, layer in enumerate(self.layers))  # type: ignore[return-value]

    @staticmethod
    def batch(seed: int) -> torch.Tensor:
        return torch.randint(-3, 4, (MICRO, 3, 13), generator=torch.Generator().manual_seed(seed)).float()


def _config(**zero: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }


def _engine(model: nn.Module, **zero: object):  # type: ignore[no-untyped-def]
    import slipstream

    engine, *_ = slipstream.initialize(model=model, config=_config(**zero))
    return engine


def _full_params(engine) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    import slipstream

    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def train_case(rank: int, world: int, *, zero: dict, model: str, folder: str = "", mics_init: bool = False) -> dict:
    """STEPS steps; the process-group ranks of the backward's all-gathers and of each collective of the last step.
    `mics_init`: the model is built under DeepSpeed's import path of MiCS_Init (sharded while it is built)."""
    from slipstream.runtime.zero.mics import MiCS_Init

    from slipstream.comm import count_collectives
    from slipstream.compat.param_access import safe_get_full_optimizer_state

    with MiCS_Init(config_dict_or_path=_config(**zero), enabled=mics_init):
        net: nn.Module = TinyMLP(hidden=40) if model == "mlp" else IntegerGrads()
    engine = _engine(net, **zero)
    losses, norms, backward, step_groups = [], [], set(), set()
    for step in range(STEPS):
        if model == "mlp":
            x, y = TinyMLP(hidden=40).make_batch(seed=10 * step + rank, batch_size=MICRO)
            with count_collectives() as whole:
                loss = TinyMLP.loss(engine(x), y)
                with count_collectives() as counted:
                    engine.backward(loss)
                engine.step()
        else:
            with count_collectives() as whole:
                loss = engine(IntegerGrads.batch(10 * step + rank))
                with count_collectives() as counted:
                    engine.backward(loss)
                engine.step()
        losses.append(float(loss.detach()))
        norms.append(float(engine.get_global_grad_norm()))
        backward |= {ranks for op, ranks in counted.group_bytes if op == "all_gather"}
        step_groups = set(whole.group_bytes)
    if folder:
        engine.save_checkpoint(folder, tag="saved")
    shard_ranks = sorted({_ranks(u.group, world) for u in engine.zero_model.units if u.params})
    first = next(iter(engine.module.parameters()))
    exp_avg = safe_get_full_optimizer_state(first, "exp_avg")
    param_bytes = engine.optimizer.owned_bytes()["params"]
    params = _full_params(engine)
    engine.destroy()
    return {
        "param_bytes": param_bytes,
        "losses": losses,
        "norms": norms,
        "params": params,
        "backward_gathers": backward,
        "step_groups": step_groups,
        "shard_ranks": shard_ranks,
        "exp_avg": exp_avg,
    }


def _ranks(group, world: int) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    return tuple(range(world)) if group is None else tuple(dist.get_process_group_ranks(group))


def load_case(rank: int, world: int, *, folder: str, model: str, zero: dict) -> dict:
    """A stage-3 engine at this world size (with the options `zero`) loads a checkpoint written with hpZ or MiCS."""
    from slipstream.compat.param_access import safe_get_full_optimizer_state

    net: nn.Module = TinyMLP(hidden=40, seed=7) if model == "mlp" else IntegerGrads()
    engine = _engine(net, **zero)
    engine.load_checkpoint(folder, tag="saved")
    first = next(iter(engine.module.parameters()))
    exp_avg = safe_get_full_optimizer_state(first, "exp_avg")
    params = _full_params(engine)
    engine.destroy()
    return {"params": params, "exp_avg": exp_avg}


FOUR = [
    {"zero": {}, "model": "mlp"},
    {"zero": {"zero_hpz_partition_size": 2}, "model": "mlp", "save": "hpz"},
    {"zero": {}, "model": "int"},
    {"zero": {"mics_shard_size": 2}, "model": "int", "save": "mics"},
]
TWO = [
    {"zero": {}, "model": "mlp"},
    {"zero": {"mics_shard_size": 1}, "model": "mlp", "mics_init": True},
]


def four_ranks(rank: int, world: int, *, root: str) -> list[dict]:
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # 2 "nodes" x 2 ranks, before any group is built

    def case(zero: dict, model: str, save: str = "") -> dict:
        return train_case(rank, world, zero=zero, model=model, folder=os.path.join(root, save) if save else "")

    return run_subtests(FOUR, case)


def two_ranks(rank: int, world: int, *, root: str) -> dict:
    trained = run_subtests(TWO, lambda **case: train_case(rank, world, **case))
    loaded = {  # plain stage 3; and MiCS (one rank per shard group) loading the hpZ checkpoint
        key: load_case(rank, world, folder=os.path.join(root, name), model=model, zero=zero)
        for key, name, model, zero in (
            ("hpz", "hpz", "mlp", {}),
            ("mics", "mics", "int", {}),
            ("hpz into mics", "hpz", "mlp", {"mics_shard_size": 1}),
        )
    }
    return {"trained": trained, "loaded": loaded}


def _assert_same_run(got: dict, want: dict, what: str) -> None:
    assert got["losses"] == want["losses"], (what, got["losses"], want["losses"])
    for name, value in want["params"].items():
        assert torch.equal(got["params"][name], value), f"{what}: parameter {name} differs from plain stage 3"
    for mine, plain in zip(got["norms"], want["norms"]):  # summed over other shards: equal up to rounding
        assert abs(mine - plain) <= 1e-6 * plain, (what, got["norms"], want["norms"])


def _planned_param_bytes(model: nn.Module, world: int, **stage3: object) -> int:
    """The planner's stage-3 parameter bytes per rank (shards, and hpZ's secondary shards) for an fp32 model."""
    from slipstream.config.zero_plans import default_stage3_plan
    from slipstream.planner.shapes import from_module
    from slipstream.planner.types import Settings
    from slipstream.planner.zero_bytes import stage3_bytes

    settings = Settings(dtype="fp32", stage3=default_stage3_plan(persistence_threshold=0, **stage3))
    units = from_module(model).units(0, (), (), ())
    figures, _ = stage3_bytes(units, world=world, settings=settings, offload=False, offload_param=False)
    return figures.owned["params"]


def test_hpz_and_mics_match_plain_stage3_and_save_loadable_checkpoints(tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = str(tmp_path / "checkpoints")
    four = run_distributed(four_ranks, world_size=4, tmp_dir=tmp_path / "four", timeout_s=240, root=root)
    for rank, (plain, hpz, plain_int, mics) in enumerate(four):
        _assert_same_run(hpz, plain, f"hpZ rank {rank}")
        _assert_same_run(mics, plain_int, f"MiCS rank {rank}")
        node = NODES[rank // 2]
        assert hpz["param_bytes"] > plain["param_bytes"]  # the secondary shards, as the planner counts them
        assert hpz["param_bytes"] == _planned_param_bytes(TinyMLP(hidden=40), 4, secondary_shard_size=2)
        assert mics["param_bytes"] == _planned_param_bytes(IntegerGrads(), 4, shard_size=2)
        assert plain["backward_gathers"] == {(0, 1, 2, 3)}, plain["backward_gathers"]
        assert hpz["backward_gathers"] == {node}, f"rank {rank}: hpZ backward gathers over {hpz['backward_gathers']}"
        column = (rank % 2, rank % 2 + 2)
        assert mics["shard_ranks"] == [node], mics["shard_ranks"]
        sharded = {(op, ranks) for op, ranks in mics["step_groups"] if op in ("all_gather", "reduce_scatter")}
        assert sharded == {("all_gather", node), ("reduce_scatter", node)}, (rank, mics["step_groups"])
        assert ("all_reduce", column) in mics["step_groups"], (rank, mics["step_groups"])  # across the replicas
    two = run_distributed(two_ranks, world_size=2, tmp_dir=tmp_path / "two", timeout_s=240, root=root)
    for rank, got in enumerate(two):
        plain, mics = got["trained"]
        _assert_same_run(mics, plain, f"MiCS (1 rank per shard group, model built under MiCS_Init) rank {rank}")
        assert mics["shard_ranks"] == [(rank,)], mics["shard_ranks"]
        for name, saved in (("hpz", four[0][1]), ("mics", four[0][3]), ("hpz into mics", four[0][1])):
            loaded = got["loaded"][name]
            for key, value in saved["params"].items():
                assert torch.equal(loaded["params"][key], value), f"{name} checkpoint at 2 ranks: {key} differs"
            assert torch.equal(loaded["exp_avg"], saved["exp_avg"]), f"{name} checkpoint at 2 ranks: exp_avg differs"
