"""DeepSpeed behaviours client libraries rely on, at world size 2 (issues 15 and 16):

- Accelerate's gradient accumulation: `set_gradient_accumulation_boundary(False)`, several `backward()` calls
  with no `step()`, then the boundary set to True, `backward()` and `step()`. At every ZeRO stage the
  parameters equal the single-process reference (same batches, same AdamW).
- `checkpoint.tag_validation` with a different tag per rank: FAIL raises on every rank, catchable as
  AssertionError (DeepSpeed's type); WARN and IGNORE save one checkpoint under rank 0's tag, which loads back
  to the same parameters; `save_checkpoint(save_dir=None)` and `save_dir=""` raise ValueError naming it.
One spawn per test; the cases loop inside it.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from tests.dist.engine.test_engine_parity import LR, STEPS, global_batches
from tests.harness import run_distributed
from tests.harness.models import TinyMLP
from tests.harness.reference import reference_run

GAS = 3
MICRO = 1  # 8 rows per global batch = 2 ranks x micro x GAS would need 6: use the first 6 rows
ROWS = 2 * MICRO * GAS


def _config(stage: int, gas: int = GAS, **extra: object) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 700, "stage3_param_persistence_threshold": 0},
        **extra,
    }


def _full_params(engine: object) -> dict[str, torch.Tensor]:
    zero_model = getattr(engine, "zero_model", None)
    if zero_model is not None:
        return {n: v.float() for n, v in zero_model.full_state(only_rank0=False).items()}
    module = engine.module  # type: ignore[attr-defined]
    return {n: p.detach().float().clone() for n, p in module.named_parameters()}


def accumulate_like_accelerate(rank: int, world: int, *, stages: list[int]) -> list[dict[str, torch.Tensor]]:
    import slipstream

    out = []
    for stage in stages:
        engine, *_ = slipstream.initialize(model=TinyMLP(), config=_config(stage))
        for inputs, targets in global_batches():
            for m in range(GAS):
                boundary = m == GAS - 1
                engine.set_gradient_accumulation_boundary(boundary)  # what Accelerate's backward does
                start = (m * world + rank) * MICRO
                engine.backward(TinyMLP.loss(engine(inputs[start : start + MICRO]), targets[start : start + MICRO]))
                if boundary:
                    engine.step()
        assert engine.global_steps == STEPS, (stage, engine.global_steps)
        out.append(_full_params(engine))
        engine.destroy()
        dist.barrier()
    return out


def test_caller_driven_accumulation_matches_the_reference_at_every_stage(tmp_path) -> None:  # type: ignore[no-untyped-def]
    stages = [0, 1, 2, 3]
    batches = [(x[:ROWS], y[:ROWS]) for x, y in global_batches()]
    reference = reference_run(TinyMLP, batches, lr=LR, steps=STEPS, optimizer="adamw", weight_decay=0.01)
    first, second = run_distributed(accumulate_like_accelerate, world_size=2, tmp_dir=tmp_path, stages=stages)
    for stage, mine, other in zip(stages, first, second):
        torch.testing.assert_close(mine, other, rtol=0, atol=0, msg=lambda m, s=stage: f"stage {s} ranks: {m}")
        torch.testing.assert_close(
            mine,
            {n: v.float() for n, v in reference.params.items()},
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m, s=stage: f"stage {s} vs reference: {m}",
        )


def tags_per_rank(rank: int, world: int, *, root: str) -> dict:
    import slipstream

    results: dict = {}
    inputs, targets = global_batches()[0]
    for mode in ("FAIL", "WARN", "IGNORE"):
        engine, *_ = slipstream.initialize(
            model=TinyMLP(), config=_config(1, gas=1, checkpoint={"tag_validation": mode})
        )
        start = rank * MICRO
        engine.backward(TinyMLP.loss(engine(inputs[start : start + MICRO]), targets[start : start + MICRO]))
        engine.step()
        save_dir = f"{root}/{mode}"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                engine.save_checkpoint(save_dir, tag=f"tag-{rank}")
                results[mode] = "saved"
            except AssertionError as exc:  # DeepSpeed's callers catch this type
                results[mode] = f"raised {type(exc).__name__}: {exc}"
        results[f"{mode} warnings"] = [str(w.message) for w in caught if "different tags" in str(w.message)]
        if mode != "FAIL":
            saved = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
            fresh, *_ = slipstream.initialize(model=TinyMLP(seed=9), config=_config(1, gas=1))
            path, _ = fresh.load_checkpoint(save_dir)
            results[f"{mode} loaded"] = path
            for name, param in fresh.module.named_parameters():
                assert torch.equal(param, saved[name]), (mode, name)
            fresh.destroy()
        for bad in (None, ""):
            try:
                engine.save_checkpoint(save_dir=bad)  # type: ignore[arg-type]
                results[f"save_dir={bad!r}"] = "saved"
            except ValueError as exc:
                results[f"save_dir={bad!r}"] = str(exc)
        engine.destroy()
        dist.barrier()
    return results


def test_tag_validation_modes_with_a_tag_per_rank(tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "ckpt"
    results = run_distributed(tags_per_rank, world_size=2, tmp_dir=tmp_path, root=str(root), timeout_s=120)
    for rank, result in enumerate(results):
        assert result["FAIL"].startswith("raised TagMismatchError") and "different tags" in result["FAIL"], result
        for mode in ("WARN", "IGNORE"):
            assert result[mode] == "saved", (rank, mode, result)
            assert result[f"{mode} loaded"] == str(root / mode / "tag-0"), result  # rank 0's tag wins
        assert len(result["WARN warnings"]) == rank and not result["IGNORE warnings"], result  # rank 1 is renamed
        for bad in ("None", "''"):
            assert result[f"save_dir={bad}"].startswith(f"save_checkpoint(save_dir={bad})"), result
    for mode in ("WARN", "IGNORE"):
        assert sorted(p.name for p in (root / mode).iterdir()) == ["latest", "tag-0"], mode
    assert not (root / "FAIL").exists() or not any((root / "FAIL").iterdir())
