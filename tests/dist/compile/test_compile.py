"""engine.compile() at ZeRO stages 0-3 (with CPU offload and bf16) against the same run in eager mode, on 2
ranks in one spawn: the parameters after STEPS steps agree, no compiled block has a graph break (counted by
dynamo), and a checkpoint written by a compiled engine loads into an eager one. The cases of the first test use
aot_eager, which traces forward and backward the same way without generating code; the second test is one
stage-3 case with inductor (it builds C++ with g++ on CPU), the compiled 2-rank run of every cell of
`make matrix` (.ci/matrix names it), so a torch release that breaks compiled ZeRO-3 fails there."""

from __future__ import annotations

import shutil
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_distributed
from tests.harness.models import TinyTransformer

STEPS = 5
MICRO = 2
LR = 1e-2
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}
CASES = [
    dict(stage=0, backend="aot_eager"),
    dict(stage=1, backend="aot_eager"),
    dict(stage=2, backend="aot_eager"),
    dict(stage=3, backend="aot_eager"),
    dict(stage=2, backend="aot_eager", zero=OFFLOAD),
    dict(stage=3, backend="aot_eager", zero={**OFFLOAD, "offload_param": {"device": "cpu"}}),
    dict(stage=3, backend="aot_eager", bf16=True),
    dict(stage=1, backend="eager", bf16=True),
]
INDUCTOR = dict(stage=3, backend="inductor", optimizer="SGD")
"""Needs a C++ compiler (inductor builds its CPU kernels with it). It steps with SGD: inductor's kernels round
differently from eager (outputs agree to ~5e-7), and Adam turns such differences in near-zero gradients into
whole steps of `lr`, while SGD keeps them that small."""


PARTITIONED = {3: {"stage3_param_persistence_threshold": 0}}
"""At stage 3 every block is partitioned (the test model's parameters are all below the default threshold, which
would keep them whole on every rank): the gather before each compiled block and the release after it run."""
OPTIMIZERS = {"AdamW": {"lr": LR, "weight_decay": 0.01}, "SGD": {"lr": 0.1, "momentum": 0.9}}


def config(stage: int, zero: dict | None, bf16: bool, optimizer: str) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0,
            "optimizer": {"type": optimizer, "params": OPTIMIZERS[optimizer]},
            "zero_optimization": {"stage": stage, **PARTITIONED.get(stage, {}), **(zero or {})},
            "bf16": {"enabled": bf16}}


def make_engine(stage: int, zero: dict | None = None, bf16: bool = False, optimizer: str = "AdamW"):  # type: ignore[no-untyped-def]
    import slipstream

    engine, _, _, _ = slipstream.initialize(model=TinyTransformer(layers=3),
                                            config=config(stage, zero, bf16, optimizer))
    return engine


def train(engine, rank: int) -> tuple[list[int], dict[str, tuple[int, int]]]:  # type: ignore[no-untyped-def]
    """STEPS steps; dynamo's count of compiled frames after each (it grows only when something compiles), and
    the collectives of the steps after the first (name -> calls, bytes)."""
    from torch._dynamo.utils import counters

    from slipstream.comm.counting import count_collectives

    model = TinyTransformer()
    before, frames = counters["frames"]["total"], []
    with count_collectives() as collectives:
        for step in range(STEPS):
            collectives.reset()  # the first step's are left out: a compiled engine's first step compiles
            tokens, targets = model.make_batch(seed=10 * step + rank, batch_size=MICRO)
            engine.backward(TinyTransformer.loss(engine(tokens), targets))
            engine.step()
            frames.append(counters["frames"]["total"] - before)
    return frames, {op: (collectives.calls[op], collectives.bytes[op]) for op in collectives.calls}


def full_params(engine) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    from slipstream.zero import GatheredParameters

    with GatheredParameters(list(engine.module.parameters())):
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}


def compiled_vs_eager(rank: int, *, stage: int, backend: str, zero: dict | None = None, bf16: bool = False,
                      optimizer: str = "AdamW") -> dict:
    torch._dynamo.reset()  # every case compiles its own graphs (and counts its own breaks)
    case_started = time.perf_counter()
    eager = make_engine(stage, zero, bf16, optimizer)
    _, eager_collectives = train(eager, rank)
    expected = full_params(eager)
    eager.destroy()
    compiled = make_engine(stage, zero, bf16, optimizer)
    compiled.compile(backend=backend)
    assert compiled.is_compiled and not eager.is_compiled
    started = time.perf_counter()
    frames, collectives = train(compiled, rank)
    seconds = time.perf_counter() - started
    got = full_params(compiled)
    if stage == 3:  # the blocks' parameters got their sharded type back after each compiled call
        from slipstream.zero.stage3.sharded_param import ShardedParameter

        assert all(isinstance(p, ShardedParameter) for p in compiled.module.parameters())
    breaks = compiled.graph_breaks
    compiled.destroy()
    dist.barrier()
    worst = max((got[n] - expected[n]).abs().max().item() for n in expected)
    return {"worst": worst, "breaks": breaks, "seconds": seconds, "names": sorted(breaks), "frames": frames,
            "collectives": collectives, "eager_collectives": eager_collectives,
            "case_seconds": time.perf_counter() - case_started}


def checkpoint_round_trip(rank: int, *, folder: str) -> float:
    """A stage-3 engine compiled and trained saves; an eager stage-3 engine loads it and has its parameters."""
    torch._dynamo.reset()
    compiled = make_engine(3)
    compiled.compile(backend="aot_eager")
    train(compiled, rank)
    compiled.save_checkpoint(folder, tag="compiled")
    saved = full_params(compiled)
    compiled.destroy()
    eager = make_engine(3)
    eager.load_checkpoint(folder, tag="compiled")
    loaded = full_params(eager)
    assert not eager.is_compiled
    eager.destroy()
    return max((loaded[n] - saved[n]).abs().max().item() for n in saved)


def frames_per_batch_size(rank: int, sizes: tuple[int, ...] = (MICRO, 3, 5, MICRO)) -> list[int]:
    """A compiled stage-3 engine steps on micro-batches of these sizes; dynamo's compiled frames after each."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    engine = make_engine(3)
    engine.compile(backend="aot_eager")
    model, frames, before = TinyTransformer(), [], counters["frames"]["total"]
    for step, size in enumerate(sizes):
        tokens, targets = model.make_batch(seed=10 * step + rank, batch_size=size)
        engine.backward(TinyTransformer.loss(engine(tokens), targets))
        engine.step()
        frames.append(counters["frames"]["total"] - before)
    engine.destroy()
    return frames


def run_all(rank: int, world: int, *, folder: str, cases: list[dict]) -> dict:
    results = [compiled_vs_eager(rank, **case) for case in cases]
    return {"cases": results, "checkpoint": checkpoint_round_trip(rank, folder=folder),
            "batch_sizes": frames_per_batch_size(rank)}


def check(outcome: list[dict], cases: list[dict]) -> None:
    for rank, result in enumerate(outcome):
        assert len(result["cases"]) == len(cases)
        for case, found in zip(cases, result["cases"]):
            where = f"rank {rank} {case}"
            assert found["names"] == ["layers.0", "layers.1", "layers.2"], where  # each block is a region
            assert all(not reasons for reasons in found["breaks"].values()), f"{where}: {found['breaks']}"
            # the first step compiles (one frame per block at most); later steps reuse it: no recompiles
            assert 1 <= found["frames"][0] <= 3 and len(set(found["frames"])) == 1, f"{where}: {found['frames']}"
            # compiling changes no communication: the same gathers, reductions and bytes per step as eager
            assert found["collectives"] == found["eager_collectives"], f"{where}: {found['collectives']} vs eager"
            tolerance = 1e-2 if case.get("bf16") else 2e-5
            assert found["worst"] <= tolerance, f"{where}: parameters differ by {found['worst']}"
    for case, found in zip(cases, outcome[0]["cases"]):
        print(f"{case}: compiled {STEPS} steps {found['seconds']:.1f} s, case {found['case_seconds']:.1f} s")


def test_compiled_training_matches_eager_at_every_stage(tmp_path) -> None:  # type: ignore[no-untyped-def]
    outcome = run_distributed(run_all, world_size=2, tmp_dir=tmp_path / "run", timeout_s=300,
                              folder=str(tmp_path / "ckpt"), cases=CASES)
    check(outcome, CASES)
    for rank, result in enumerate(outcome):
        assert result["checkpoint"] == 0.0, f"rank {rank}: the eager engine loaded other values"
        # a new batch size compiles once more (dynamo makes the batch dimension dynamic); later sizes reuse it
        first, *later = result["batch_sizes"]
        assert later[-1] - first <= first, f"rank {rank}: compiled frames per batch size {result['batch_sizes']}"


def inductor_case(rank: int, world: int) -> list[dict]:
    return [compiled_vs_eager(rank, **INDUCTOR)]


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="inductor on CPU needs a C++ compiler")
def test_compiled_zero3_with_inductor_matches_eager(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The compiled run of `make matrix` (.ci/matrix): ZeRO-3 on 2 ranks, each block compiled by inductor."""
    outcome = run_distributed(inductor_case, world_size=2, tmp_dir=tmp_path / "run", timeout_s=400)
    check([{"cases": cases} for cases in outcome], [INDUCTOR])
