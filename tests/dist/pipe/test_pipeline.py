"""Pipeline parallelism against a single-process run of the same layers and micro-batches (pipe_models.py):
parameters to 2e-5 relative after 5 train_batch calls, the loss of every batch and the global gradient norm
(clipping is active: CLIP is below every step's norm), at 2 stages and 2 stages x 2 data-parallel ranks,
with tied embeddings, activation checkpointing, ZeRO 0/1/2, the interleaved and zero-bubble schedules,
micro-batches of different lengths and dict activations; a checkpoint saved at 2 stages loaded at 1 and 4;
a stage that raises fails every stage quickly, naming it; the DeepSpeed engine surface (pipe_surface.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.dist.pipe import pipe_models as pm
from tests.dist.pipe.pipe_surface import check_surface, surface_case
from tests.harness import run_distributed

STEPS = 5
RTOL = 2e-5


def _config(stage: int, micros: int, dp: int, **extra: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": micros,
        "train_batch_size": 3 * micros * dp,
        "gradient_clipping": pm.CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": pm.LR, "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200},
        **extra,
    }


def _engine(
    stages: int,
    *,
    zero: int,
    micros: int,
    kind: str = "plain",
    schedule: str = "1f1b",
    interval: int = 0,
    partition: object = "parameters",
    config_interval: int = 0,
    dynamic_shape: bool = True,
) -> object:
    import slipstream
    from slipstream.pipe import PipelineModule

    module = PipelineModule(
        pm.specs(kind),
        num_stages=stages,
        loss_fn=pm.loss_fn,
        seed_layers=True,
        partition_method=partition,
        activation_checkpoint_interval=interval,
        activation_checkpoint_func=_counting_checkpoint,
        dynamic_shape=dynamic_shape,
        schedule=schedule,
    )
    dp = dist.get_world_size() // stages
    extra = {"pipeline": {"activation_checkpoint_interval": config_interval}} if config_interval else {}
    engine, returned, *_ = slipstream.initialize(model=module, config=_config(zero, micros, dp, **extra))
    assert returned is engine.optimizer  # DeepSpeed's pipeline engine hands back its own optimizer at every stage
    return engine


CHECKPOINTED = [0]


def _counting_checkpoint(function: object, *args: object) -> object:
    from torch.utils.checkpoint import checkpoint

    CHECKPOINTED[0] += 1
    return checkpoint(function, *args, use_reentrant=False)  # type: ignore[arg-type]


def _batches(engine: object, step: int, micros: int, seqs: list[int] | None) -> object:
    dp_rank = engine.grid.get_data_parallel_id()  # type: ignore[attr-defined]
    return iter([pm.micro_batch(step, dp_rank, m, seq=None if seqs is None else seqs[m]) for m in range(micros)])


def train_case(
    stages: int,
    zero: int,
    micros: int = 4,
    kind: str = "plain",
    schedule: str = "1f1b",
    interval: int = 0,
    seqs: list[int] | None = None,
    config_interval: int = 0,
    dynamic_shape: bool = True,
) -> dict:
    CHECKPOINTED[0] = 0
    engine = _engine(
        stages,
        zero=zero,
        micros=micros,
        kind=kind,
        schedule=schedule,
        interval=interval,
        config_interval=config_interval,
        dynamic_shape=dynamic_shape,
    )
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(float(engine.train_batch(_batches(engine, step, micros, seqs))))  # type: ignore[attr-defined]
        norms.append(engine.get_global_grad_norm())  # type: ignore[attr-defined]
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}  # type: ignore[attr-defined]
    engine.destroy()  # type: ignore[attr-defined]
    dist.barrier()
    return {"params": params, "losses": losses, "norms": norms, "checkpointed": CHECKPOINTED[0]}


def run_cases(rank: int, world: int, *, cases: list[dict]) -> list[dict]:
    return [train_case(**case) for case in cases]


def _check(case: dict, results: list[dict], world: int) -> None:
    dp = world // case["stages"]
    ref = pm.reference(
        case.get("kind", "plain"), steps=STEPS, dp=dp, micros=case.get("micros", 4), seqs=case.get("seqs")
    )
    seen: set[str] = set()
    for result in results:
        torch.testing.assert_close(
            torch.tensor(result["losses"]),
            torch.tensor(ref["losses"]),
            rtol=RTOL,
            atol=1e-6,
            msg=lambda m: f"{case}: losses {m}",
        )
        torch.testing.assert_close(
            torch.tensor(result["norms"]),
            torch.tensor(ref["norms"]),
            rtol=RTOL,
            atol=1e-6,
            msg=lambda m: f"{case}: grad norms {m}",
        )
        for name, value in result["params"].items():
            torch.testing.assert_close(
                value, ref["params"][name], rtol=RTOL, atol=1e-6, msg=lambda m, n=name: f"{case}: {n} {m}"
            )
            seen.add(name)
    assert seen == set(ref["params"]), f"{case}: parameters missing across stages: {set(ref['params']) - seen}"


TWO = [
    dict(stages=2, zero=0),
    dict(stages=2, zero=1, config_interval=1),  # the config's pipeline.activation_checkpoint_interval
    dict(stages=2, zero=2, schedule="interleaved_1f1b"),
    dict(stages=2, zero=1, schedule="interleaved_zero_bubble"),
    dict(stages=2, zero=2, schedule="zbv_zero_bubble"),
    # a dict activation whose shapes change; dynamic_shape=False still resends the description when it changes
    dict(stages=2, zero=1, kind="dict", seqs=[5, 3, 7, 4], dynamic_shape=False),
]


def _eval_loss(engine: object) -> float:
    batches = iter([pm.micro_batch(99, 0, m) for m in range(4)])  # the same data on every rank
    return float(engine.eval_batch(batches))  # type: ignore[attr-defined]


def save_then_load(rank: int, world: int, *, save_stages: int, load_stages: list[int], path: str) -> list[dict]:
    """Train 2 batches at `save_stages`, save; then at each of `load_stages`: load, compare."""
    engine = _engine(save_stages, zero=1, micros=4)
    for step in range(2):
        engine.train_batch(_batches(engine, step, 4, None))  # type: ignore[attr-defined]
    engine.save_checkpoint(path, tag="t")  # type: ignore[attr-defined]
    out = [
        {
            "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},  # type: ignore[attr-defined]
            "eval": _eval_loss(engine),
        }
    ]
    engine.destroy()  # type: ignore[attr-defined]
    for stages in load_stages:
        engine = _engine(stages, zero=2, micros=4)
        engine.load_checkpoint(path)  # type: ignore[attr-defined]
        out.append(
            {
                "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},  # type: ignore[attr-defined]
                "eval": _eval_loss(engine),
                "steps": engine.global_steps,
            }
        )  # type: ignore[attr-defined]
        engine.train_batch(_batches(engine, 2, 4, None))  # type: ignore[attr-defined] - optimizer state loads and steps
        engine.destroy()  # type: ignore[attr-defined]
    return out


def _check_reload(results: list[list[dict]], loads: int) -> None:
    saved = {n: v for rank in results for n, v in rank[0]["params"].items()}
    root, funcs = pm.build_reference(pm.specs())
    root.load_state_dict(saved)  # eval_batch of the saving engine against one process with its parameters
    with torch.no_grad():
        expected = []
        for m in range(4):
            x, y = pm.micro_batch(99, 0, m)
            for f in funcs:
                x = f(x)
            expected.append(float(pm.loss_fn(x, y)))
    assert abs(results[0][0]["eval"] - sum(expected) / 4) <= RTOL * abs(results[0][0]["eval"])
    for i in range(1, loads + 1):
        assert len({round(rank[i]["eval"], 6) for rank in results}) == 1
        assert abs(results[0][i]["eval"] - results[0][0]["eval"]) <= 1e-6 * abs(results[0][0]["eval"]) + 1e-7
        for rank in results:
            assert rank[i]["steps"] == 2
            for name, value in rank[i]["params"].items():
                torch.testing.assert_close(value, saved[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def failing_stage(rank: int, world: int) -> str:
    """Stage 1 raises in its third micro-batch's forward; every rank must raise within the timeout."""
    import time

    engine = _engine(world, zero=0, micros=4)
    for call in (engine.backward, engine.step):  # type: ignore[attr-defined]
        try:
            call(torch.zeros(()))
        except Exception as exc:
            assert "train_batch" in str(exc), exc
        else:
            raise AssertionError(f"{call.__name__}() on a pipeline engine must raise")
    boom = {"calls": 0}
    if engine.is_last_stage():  # type: ignore[attr-defined]

        def loss(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            boom["calls"] += 1
            if boom["calls"] == 3:
                raise ValueError("boom in the loss")
            return pm.loss_fn(out, labels)

        engine.module.loss_fn = loss  # type: ignore[attr-defined]
    started = time.monotonic()
    try:
        engine.train_batch(_batches(engine, 0, 4, None))  # type: ignore[attr-defined]
    except Exception as exc:
        return f"{time.monotonic() - started:.1f}|{exc}"
    return "no error"


def data_case(rank: int, world: int) -> dict:
    """initialize(training_data=...) and train_batch() without an iterator: the engine's loader, restarted."""
    import slipstream
    from slipstream.pipe import PipelineModule

    module = PipelineModule(pm.specs(), num_stages=world, loss_fn=pm.loss_fn, seed_layers=True)
    engine, _, loader, _ = slipstream.initialize(model=module, config=_config(1, 4, 1), training_data=pm.dataset())
    losses = [float(engine.train_batch()) for _ in range(3)]
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {"losses": losses, "params": params, "loader_batches": len(loader)}


def two_process_suite(rank: int, world: int, *, path: str) -> dict:
    from slipstream.comm import collectives

    out = {
        "cases": run_cases(rank, world, cases=TWO),
        "reload": save_then_load(rank, world, save_stages=2, load_stages=[1], path=path),
        "data": data_case(rank, world),
        "surface": surface_case(rank, world, path=path + "-16bit", config=_config(1, 4, 1)),
    }
    collectives.set_collective_timeout(6.0)
    out["failure"] = failing_stage(rank, world)
    return out


def test_two_processes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = run_distributed(
        two_process_suite, world_size=2, tmp_dir=tmp_path / "run", timeout_s=240, path=str(tmp_path / "ckpt")
    )
    for i, case in enumerate(TWO):
        _check(case, [results[r]["cases"][i] for r in range(2)], 2)
        checkpointed = [results[r]["cases"][i]["checkpointed"] for r in range(2)]
        assert all(checkpointed) if case.get("config_interval") else not any(checkpointed), (case, checkpointed)
    _check_reload([r["reload"] for r in results], loads=1)
    ref = pm.reference_on("plain", pm.loader_batches(24, 3, 4, 3))
    assert results[0]["data"]["loader_batches"] == 8  # 12 micro-batches were drawn: the loader restarted
    for result in results:
        torch.testing.assert_close(
            torch.tensor(result["data"]["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=1e-6
        )
        for name, value in result["data"]["params"].items():
            torch.testing.assert_close(value, ref["params"][name], rtol=RTOL, atol=1e-6)
    check_surface([r["surface"] for r in results], str(tmp_path / "ckpt") + "-16bit")
    for rank, result in enumerate(results):
        seconds, _, message = result["failure"].partition("|")
        assert message and float(seconds) < 12, f"rank {rank}: {result['failure']}"
        assert "stage 1" in message and "rank 1" in message and "boom in the loss" in message, message


FOUR = [dict(stages=2, zero=1), dict(stages=2, zero=2, schedule="interleaved_1f1b")]


def four_process_suite(rank: int, world: int, *, path: str) -> dict:
    return {
        "cases": run_cases(rank, world, cases=FOUR),
        "reload": save_then_load(rank, world, save_stages=2, load_stages=[4, 1], path=path),
    }


def test_four_processes_two_stages_by_two_replicas(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = run_distributed(
        four_process_suite, world_size=4, tmp_dir=tmp_path / "run", timeout_s=240, path=str(tmp_path / "ckpt")
    )
    for i, case in enumerate(FOUR):
        _check(case, [results[r]["cases"][i] for r in range(4)], 4)
    _check_reload([r["reload"] for r in results], loads=2)
