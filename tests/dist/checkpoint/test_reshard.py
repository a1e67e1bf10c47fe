"""Checkpoints across world sizes and ZeRO stages (docs/design.md P3): save at (world 2, stage 3) and (world 2,
stage 1 + optimizer offload), load at (1, 0), (2, 2), (4, 3) and (4, 1); the parameters and the next steps'
losses equal an uninterrupted run at the new world size. The same across gradient-accumulation counts
(2 -> 4, 4 -> 1, 2 -> 3) at stages 0-3 and with offload; saving or loading mid-window is a named
error. Also: an exact resume at the same world size (LR schedule, RNG of dropout, counters), every rank must
call save (named error, bounded time), tag validation."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.harness import run_distributed, run_subtests
from tests.harness.models import TinyMLP

SAVED_AT = 3
TOTAL = 5
TARGETS = [(1, 0), (2, 2), (4, 3), (4, 1)]
SOURCES = {"zero3": {"stage": 3}, "zero1_offload": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}


class DropoutMLP(TinyMLP):
    """TinyMLP with dropout after the first layer: resuming must restore the RNG to match."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.drop(x))


def config(world: int, stage: int, *, batch: int = 8, gas: int = 1, **zero: object) -> dict:
    return {"train_batch_size": batch, "train_micro_batch_size_per_gpu": batch // (world * gas),
            "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 700,
                                  **zero}}


def global_batches(batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    model = TinyMLP()
    return [model.make_batch(seed=100 + s, batch_size=batch) for s in range(TOTAL)]


def train_steps(engine: Any, rank: int, world: int, *, steps: int, batch: int = 8, save: str | None = None,
                saved_at: int = SAVED_AT) -> list[float]:
    """`steps` global batches from the engine's global step on, each split into ranks x accumulation steps."""
    gas = engine.gradient_accumulation_steps()
    micro = batch // (world * gas)
    losses = []
    for inputs, targets in global_batches(batch)[engine.global_steps: engine.global_steps + steps]:
        for m in range(gas):
            start = (m * world + rank) * micro
            engine.backward(TinyMLP.loss(engine(inputs[start:start + micro]), targets[start:start + micro]))
            engine.step()
        losses.append(float(engine.last_loss))
        if save is not None and engine.global_steps == saved_at:
            engine.save_checkpoint(save, client_state={"epoch": 7, "ids": torch.arange(3)})
    return losses


def final_state(engine: Any) -> dict[str, torch.Tensor]:
    zero_model = engine.zero_model
    if zero_model is not None:
        return zero_model.full_state(only_rank0=False)
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def run(rank: int, world: int, *, stage: int, steps: int, load: str | None = None, save: str | None = None,
        saved_at: int = SAVED_AT, model: type = TinyMLP, batch: int = 8, gas: int = 1,
        **zero: object) -> dict[str, Any]:
    """Build an engine, load `load` if given, train `steps` steps; the losses, parameters and counters."""
    import slipstream

    engine, *_ = slipstream.initialize(model=model(), config=config(world, stage, batch=batch, gas=gas, **zero))
    if load is not None:
        path, client = engine.load_checkpoint(load)
        assert path is not None and client["epoch"] == 7 and torch.equal(client["ids"], torch.arange(3)), client
    losses = train_steps(engine, rank, world, steps=steps, batch=batch, save=save, saved_at=saved_at)
    out = {"losses": losses, "state": final_state(engine),
           "counters": (engine.global_steps, engine.global_samples, engine.micro_steps)}
    engine.destroy()
    return out


def train(rank: int, world: int, **kwargs: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    out = run(rank, world, **kwargs)
    return out["losses"], out["state"]


def assert_matches(where: str, losses: list[float], state: dict[str, torch.Tensor], ref_losses: list[float],
                   ref_state: dict[str, torch.Tensor], *, saved_at: int = SAVED_AT) -> None:
    """The next steps' losses and the final parameters of a resumed run equal those of the uninterrupted one."""
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[saved_at:]), rtol=2e-5, atol=0,
                               msg=lambda m: f"{where}: {m}")
    for name, value in ref_state.items():
        torch.testing.assert_close(state[name], value, rtol=2e-5, atol=2e-6,
                                   msg=lambda m, name=name: f"{where} {name}: {m}")


def save_both(rank: int, world: int, *, root: str) -> list:
    out = []
    for name, options in SOURCES.items():
        out.append(train(rank, world, steps=SAVED_AT, save=f"{root}/{name}", **options))
    # exact resume at the same world size: dropout RNG, schedule and counters come back
    uninterrupted = train(rank, world, stage=3, steps=TOTAL, save=f"{root}/dropout", model=DropoutMLP)
    resumed = train(rank, world, stage=3, steps=TOTAL - SAVED_AT, load=f"{root}/dropout", model=DropoutMLP)
    out.append((uninterrupted, resumed))
    return out


def load_everywhere(rank: int, world: int, *, root: str, stage: int) -> list:
    reference = train(rank, world, stage=stage, steps=TOTAL)
    loaded = [train(rank, world, stage=stage, steps=TOTAL - SAVED_AT, load=f"{root}/{name}") for name in SOURCES]
    return [reference, loaded]


def test_checkpoints_reshard_across_world_sizes_and_stages(tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = str(tmp_path / "ckpt")
    saved = run_distributed(save_both, world_size=2, tmp_dir=tmp_path / "save", root=root)
    (full_run, resumed) = saved[0][-1]
    assert resumed[0] == full_run[0][SAVED_AT:], (resumed[0], full_run[0])  # exact, fp32
    for name, value in full_run[1].items():
        assert torch.equal(resumed[1][name], value), name
    for world, stage in TARGETS:
        results = run_distributed(load_everywhere, world_size=world, tmp_dir=tmp_path / f"w{world}s{stage}", root=root,
                                  stage=stage, timeout_s=120)
        for (ref_losses, ref_state), loaded in results:
            for source, (losses, state) in zip(SOURCES, loaded):
                assert_matches(f"saved as {source}, loaded at world {world} stage {stage}", losses, state,
                               ref_losses, ref_state)


# ---- another gradient-accumulation count after the load ----
# The sources are saved at world 1 and the targets load at world 2, so every target reshards too. A global
# batch of 24 splits into all these layouts; the reference is an uninterrupted run at the target's layout
# (world 2, its accumulation count) at stage 0: the stages agree to rounding (tests/dist/engine).
# Saved after 1 step, the micro-step count (2 or 4) is not a multiple of the new counts 3 and 4, so a window
# counted from the restored micro_steps would close early (4 -> 1 cannot misalign: every micro-step steps).
GAS_BATCH = 24
GAS_SAVED_AT, GAS_TOTAL = 1, 3
GAS_SOURCES: dict[str, dict[str, Any]] = {
    "gas2": {"gas": 2, "stage": 3},
    "gas4": {"gas": 4, "stage": 1, "offload_optimizer": {"device": "cpu"}},
}
GAS_TARGETS = [("gas2", 4), ("gas4", 1), ("gas2", 3)]  # (source, accumulation count at the load)
GAS_VARIANTS: dict[str, dict[str, Any]] = {
    "stage0": {"stage": 0}, "stage1": {"stage": 1}, "stage2": {"stage": 2}, "stage3": {"stage": 3},
    "stage3_offload": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}},
}


def save_gas_sources(rank: int, world: int, *, root: str) -> dict[str, Any]:
    runs = {name: run(rank, world, steps=GAS_TOTAL, save=f"{root}/{name}", saved_at=GAS_SAVED_AT, batch=GAS_BATCH,
                      **options)
            for name, options in GAS_SOURCES.items()}
    return {"runs": runs, "mid_window": mid_window(rank, world, root=root)}


def mid_window(rank: int, world: int, *, root: str) -> dict[str, Any]:
    """At the gas-4 layout, one micro-batch into the second window: save and load fail naming it. After the
    window's step the gas-2 checkpoint loads into this engine, and two more steps follow."""
    import slipstream
    from slipstream.checkpoint.errors import CheckpointError

    engine, *_ = slipstream.initialize(model=TinyMLP(), config=config(world, batch=GAS_BATCH, **GAS_SOURCES["gas4"]))
    train_steps(engine, rank, world, steps=1, batch=GAS_BATCH)
    micro = GAS_BATCH // (world * 4)
    inputs, targets = global_batches(GAS_BATCH)[1]
    errors = []
    for m in range(4):
        start = (m * world + rank) * micro
        engine.backward(TinyMLP.loss(engine(inputs[start:start + micro]), targets[start:start + micro]))
        engine.step()
        if m == 0:
            for attempt, where in ((engine.save_checkpoint, f"{root}/mid"), (engine.load_checkpoint, f"{root}/gas2")):
                try:
                    attempt(where)
                    errors.append("no error")
                except CheckpointError as exc:
                    errors.append(str(exc))
    engine.load_checkpoint(f"{root}/gas2")
    losses = train_steps(engine, rank, world, steps=GAS_TOTAL - GAS_SAVED_AT, batch=GAS_BATCH)
    out = {"errors": errors, "losses": losses, "state": final_state(engine),
           "counters": (engine.global_steps, engine.global_samples, engine.micro_steps)}
    engine.destroy()
    return out


def load_gas_targets(rank: int, world: int, *, root: str) -> dict[str, Any]:
    def one(source: str, gas: int, variant: str) -> dict[str, Any]:
        options = {**GAS_VARIANTS[variant], "batch": GAS_BATCH, "gas": gas}
        return run(rank, world, steps=GAS_TOTAL - GAS_SAVED_AT, load=f"{root}/{source}", **options)

    references = {gas: run(rank, world, stage=0, steps=GAS_TOTAL, batch=GAS_BATCH, gas=gas) for _, gas in GAS_TARGETS}
    cases = [{"source": source, "gas": gas, "variant": variant} for source, gas in GAS_TARGETS
             for variant in GAS_VARIANTS]
    return {"references": references, "loaded": run_subtests(cases, one)}


def test_resume_with_another_gradient_accumulation_count(tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "ckpt"
    saved = run_distributed(save_gas_sources, world_size=1, tmp_dir=tmp_path / "save", root=str(root))[0]
    mid = saved["mid_window"]
    assert mid["errors"][0].startswith("save_checkpoint at micro-step 5"), mid["errors"]
    assert "1 micro-batch of gradients" in mid["errors"][0] and "after 3 more micro-batches" in mid["errors"][0], \
        mid["errors"]
    assert mid["errors"][1].startswith("load_checkpoint at micro-step 5"), mid["errors"]
    assert not (root / "mid").exists() and not list(root.glob(".tmp-*"))
    gas4 = saved["runs"]["gas4"]
    assert_matches("gas 2 loaded at a boundary of a trained gas 4 engine", mid["losses"], mid["state"],
                   gas4["losses"], gas4["state"], saved_at=GAS_SAVED_AT)
    counters = (GAS_TOTAL, GAS_TOTAL * GAS_BATCH, GAS_SAVED_AT * 2 + (GAS_TOTAL - GAS_SAVED_AT) * 4)
    assert mid["counters"] == counters, mid["counters"]
    results = run_distributed(load_gas_targets, world_size=2, tmp_dir=tmp_path / "load", root=str(root),
                              timeout_s=120)
    cases = [(source, gas, variant) for source, gas in GAS_TARGETS for variant in GAS_VARIANTS]
    for rank_results in results:
        for (source, gas, variant), loaded in zip(cases, rank_results["loaded"], strict=True):
            ref = rank_results["references"][gas]
            source_gas = GAS_SOURCES[source]["gas"]
            assert_matches(f"saved at accumulation {source_gas}, loaded at {gas} ({variant}, world 2)",
                           loaded["losses"], loaded["state"], ref["losses"], ref["state"], saved_at=GAS_SAVED_AT)
            # micro_steps counts the micro-batches trained, whatever layout trained them
            micro_steps = GAS_SAVED_AT * source_gas + (GAS_TOTAL - GAS_SAVED_AT) * gas
            assert loaded["counters"] == (GAS_TOTAL, GAS_TOTAL * GAS_BATCH, micro_steps), (source, gas, variant,
                                                                                       loaded["counters"])


def partial_save(rank: int, world: int, *, root: str) -> str:
    import slipstream
    from slipstream.checkpoint.errors import CheckpointError

    engine, *_ = slipstream.initialize(model=TinyMLP(), config={**config(world, 2), "collective_timeout": 3,
                                                                 "checkpoint": {"tag_validation": "FAIL"}})
    message = ""
    try:
        engine.save_checkpoint(root, tag=f"tag{rank}")  # different tags: FAIL
    except CheckpointError as exc:
        message += f"tags: {exc}\n"
    if rank == 0:  # rank 1 never calls save
        try:
            engine.save_checkpoint(root, tag="lonely")
        except CheckpointError as exc:
            message += f"lonely: {exc}"
    return message


def test_every_rank_must_save_and_tags_must_agree(tmp_path) -> None:  # type: ignore[no-untyped-def]
    messages = run_distributed(partial_save, world_size=2, tmp_dir=tmp_path, root=str(tmp_path / "ckpt"), timeout_s=60)
    for message in messages:
        assert "different tags" in message
    assert "never arrived" in messages[0] and "[1]" in messages[0], messages[0]
    assert not (tmp_path / "ckpt" / "lonely").exists()
