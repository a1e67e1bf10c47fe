"""Checkpoints across world sizes and ZeRO stages (docs/design.md P3): save at (world 2, stage 3) and (world 2,
stage 1 + optimizer offload), load at (1, 0), (2, 2), (4, 3) and (4, 1); the parameters and the next steps'
losses equal an uninterrupted run at the new world size. Also: an exact resume at the same world size (LR
schedule, RNG of dropout, counters), every rank must call save (named error, bounded time), tag validation."""

from __future__ import annotations

import torch
from torch import nn

from tests.dist.engine.test_engine_parity import global_batches
from tests.harness import run_distributed
from tests.harness.models import TinyMLP

SAVED_AT = 3
TOTAL = 5
TARGETS = [(1, 0), (2, 2), (4, 3), (4, 1)]
SOURCES = {"zero3": dict(stage=3), "zero1_offload": dict(stage=1, offload_optimizer={"device": "cpu"})}


class DropoutMLP(TinyMLP):
    """TinyMLP with dropout after the first layer: resuming must restore the RNG to match."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.drop(x))


def config(world: int, stage: int, **zero: object) -> dict:
    return {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 8 // world,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 700,
                                  **zero}}


def train(rank: int, world: int, *, stage: int, steps: int, load: str | None = None, save: str | None = None,
          model: type = TinyMLP, **zero: object) -> tuple[list[float], dict[str, torch.Tensor]]:
    import slipstream

    engine, *_ = slipstream.initialize(model=model(), config=config(world, stage, **zero))
    if load is not None:
        path, client = engine.load_checkpoint(load)
        assert path is not None and client["epoch"] == 7 and torch.equal(client["ids"], torch.arange(3)), client
    losses = []
    micro = 8 // world
    for inputs, targets in global_batches()[engine.global_steps: engine.global_steps + steps]:
        x, y = inputs[rank * micro:(rank + 1) * micro], targets[rank * micro:(rank + 1) * micro]
        engine.backward(TinyMLP.loss(engine(x), y))
        engine.step()
        losses.append(float(engine.last_loss))
        if save is not None and engine.global_steps == SAVED_AT:
            engine.save_checkpoint(save, client_state={"epoch": 7, "ids": torch.arange(3)})
    state = engine.zero_model.full_state(only_rank0=False) if engine.zero_model is not None else \
        {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return losses, state


def save_both(rank: int, world: int, *, root: str) -> list:
    out = []
    for name, options in SOURCES.items():
        out.append(train(rank, world, steps=SAVED_AT, save=f"{root}/{name}", **options))  # type: ignore[arg-type]
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
                where = f"saved as {source}, loaded at world {world} stage {stage}"
                torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[SAVED_AT:]), rtol=2e-5, atol=0,
                                           msg=lambda m, where=where: f"{where}: {m}")
                for name, value in ref_state.items():
                    torch.testing.assert_close(state[name], value, rtol=2e-5, atol=2e-6,
                                               msg=lambda m, where=where, name=name: f"{where} {name}: {m}")


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
