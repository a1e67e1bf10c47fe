"""Tensor and sequence parallel training of a tiny Llama-style GPT against a single-process run: after 5 steps
the global parameters equal the reference to 2e-5 relative (fp32) and the logged losses match, with gradient
clipping on (so the global norm over TP shards must be right). One spawn of 2 ranks (TP=2 at ZeRO 1 and 3,
TP=2 at ZeRO 3 with everything on NVMe (the gradients in files), SP=2 at ZeRO 2, a TP=2 checkpoint resumed at TP=1, collectives per step) and one of 4 (TP=2 x DP=2 at ZeRO 3,
SP=2 x DP=2 at ZeRO 1)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist.parallel.models import SEQ, TinyGPT, batches, loss_fn
from tests.harness import run_distributed, run_subtests

STEPS, BATCH, LR, CLIP = 5, 4, 1e-2, 0.5
CASES_2 = [
    {"tp": 2, "sp": 1, "stage": 1},
    {"tp": 2, "sp": 1, "stage": 3},
    {"tp": 2, "sp": 1, "stage": 3, "nvme": True},  # gradients in files: the replicated share read per sub-group
    {"tp": 1, "sp": 2, "stage": 2},
    {"tp": 1, "sp": 2, "stage": 0, "seq": 7},
]  # slices of 4 and 3 tokens
CASES_4 = [{"tp": 2, "sp": 1, "stage": 3}, {"tp": 1, "sp": 2, "stage": 1}]


def reference(seq: int = SEQ, **model_args: int) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    model = TinyGPT(**model_args)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses, norms = [], []
    for x, y in batches(STEPS, BATCH, seq):
        loss = loss_fn(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def make_engine(tp: int, sp: int, stage: int, data: Any = None, nvme: str = "", **model_args: int) -> Any:
    """`nvme`: optimizer and parameter offload to NVMe under that directory, in sub-groups of 3000 elements."""
    import slipstream

    config = {
        "train_batch_size": BATCH,
        "gradient_clipping": CLIP,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage},
        "tensor_parallel": {"autotp_size": tp},
        "sequence_parallel_size": sp,
    }
    if nvme:
        offload = {"device": "nvme", "nvme_path": nvme}
        config["zero_optimization"].update(offload_optimizer=offload, offload_param=offload, sub_group_size=3000)
    group = slipstream.parallel.build_topology(tp=tp, sp=sp, device_type="cpu").sp_group if sp > 1 else None
    engine, *_ = slipstream.initialize(model=TinyGPT(sp_group=group, **model_args), config=config, training_data=data)
    return engine


def train_step(engine: Any, x: torch.Tensor, y: torch.Tensor) -> float:
    from slipstream.sequence.data import sequence_mean_loss, shard_sequence

    index, dp = engine.parallel.loader_rank_and_size()  # the ranks of a TP or SP group read the same rows
    rows = slice(index * BATCH // dp, (index + 1) * BATCH // dp)
    batch = {"input_ids": x[rows], "labels": y[rows]}
    topo = engine.parallel.topology
    if topo is None or topo.sp == 1:
        loss = loss_fn(engine(batch["input_ids"]), batch["labels"])
    else:
        batch = shard_sequence(batch, topo.sp_group)  # adds the slice's position_ids
        logits = engine(batch["input_ids"], batch["position_ids"])
        token_sum = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
        loss = sequence_mean_loss(token_sum, batch["labels"].numel(), topo.sp_group)
    engine.backward(loss)
    engine.step()
    return engine.last_loss


def train(rank: int, world: int, *, tp: int, sp: int, stage: int, seq: int = SEQ, nvme: bool = False,
          nvme_dir: str = "", **model_args: int) -> dict:
    engine = make_engine(tp, sp, stage, nvme=nvme_dir if nvme else "", **model_args)
    sub_groups = engine.optimizer.num_sub_groups
    losses, norms = [], []
    for x, y in batches(STEPS, BATCH, seq):
        losses.append(train_step(engine, x, y))
        norms.append(engine.get_global_grad_norm())
    params = engine._zero3_consolidated_16bit_state_dict()  # global tensors on rank 0
    engine.destroy()
    return {"losses": losses, "norms": norms, "params": params if rank == 0 else None, "sub_groups": sub_groups}


def count_tp_collectives(rank: int, world: int) -> dict[str, Any]:
    """DTensor's collectives of one TP=2 step (DTensor does not issue them through slipstream.comm, so torch's
    CommDebugMode counts them), and the first batch of the engine's loader on this rank."""
    from torch.distributed.tensor.debug import CommDebugMode

    engine = make_engine(2, 1, 1, data=torch.utils.data.TensorDataset(torch.arange(32)))
    first = next(iter(engine.training_dataloader))[0]
    x, y = batches(1, BATCH)[0]
    mode = CommDebugMode()
    with mode:
        loss_fn(engine(x), y).backward()
    engine.destroy()
    return {"counts": {str(op).rsplit(".", 1)[-1]: n for op, n in mode.get_comm_counts().items()}, "batch": first}


def resume_at_tp1(rank: int, world: int, *, path: str) -> dict:
    """3 steps at TP=2 (ZeRO 1) with a checkpoint after 2; the checkpoint resumed at TP=1 x DP=2 (ZeRO 2) must
    take the same third step."""
    data = batches(3, BATCH)
    tp2 = make_engine(2, 1, 1)
    for x, y in data[:2]:
        train_step(tp2, x, y)
    tp2.save_checkpoint(path, tag="tp2")
    loss_tp2 = train_step(tp2, *data[2])
    params_tp2 = tp2._zero3_consolidated_16bit_state_dict()
    tp2.destroy()
    dp2 = make_engine(1, 1, 2)
    dp2.load_checkpoint(path, tag="tp2")
    loss_dp2 = train_step(dp2, *data[2])
    params_dp2 = dp2._zero3_consolidated_16bit_state_dict()
    dp2.destroy()
    return {"losses": (loss_tp2, loss_dp2), "params": (params_tp2, params_dp2), "steps": dp2.global_steps}


def _close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: Any) -> None:
    assert set(got) >= set(expected), (what, sorted(set(expected) - set(got)))
    for name, value in expected.items():
        assert got[name].shape == value.shape, (what, name)
        torch.testing.assert_close(
            got[name], value, rtol=2e-5, atol=2e-5 * float(value.abs().max()), msg=lambda m, n=name: f"{what} {n}: {m}"
        )


def grid2(rank: int, world: int, path: str, nvme: str) -> dict:
    return {
        "train": run_subtests(CASES_2, lambda **case: train(rank, world, nvme_dir=nvme, **case)),
        "resume": resume_at_tp1(rank, world, path=path),
        "counts": count_tp_collectives(rank, world),
    }


def grid4(rank: int, world: int) -> list[dict]:
    return run_subtests(CASES_4, lambda **case: train(rank, world, **case))


def test_tp2_and_sp2_match_single_process_and_tp2_checkpoint_resumes_at_tp1(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "nvme").mkdir()
    ranks = run_distributed(grid2, world_size=2, path=str(tmp_path / "ckpt"), nvme=str(tmp_path / "nvme"))
    out = ranks[0]
    # the TP group reads one batch: both ranks get the same 4 samples (the whole batch: dp = 1)
    assert torch.equal(ranks[0]["counts"]["batch"], ranks[1]["counts"]["batch"])
    assert len(ranks[0]["counts"]["batch"]) == BATCH
    for case, got in zip(CASES_2, out["train"]):
        ref_losses, ref_params, ref_norms = reference(case.get("seq", SEQ))
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), (case, got["losses"], ref_losses)
        # the global norm over TP shards and replicated parameters, above CLIP so clipping acts
        assert got["norms"] == pytest.approx(ref_norms, rel=1e-5) and min(ref_norms) > CLIP, (case, got["norms"])
        _close(got["params"], ref_params, case)
        assert not case.get("nvme") or got["sub_groups"] > 2, (case, got["sub_groups"])
    (loss_tp2, loss_dp2), (params_tp2, params_dp2) = out["resume"]["losses"], out["resume"]["params"]
    assert loss_dp2 == pytest.approx(loss_tp2, rel=1e-5) and out["resume"]["steps"] == 3
    _close(params_dp2, params_tp2, "TP=2 checkpoint resumed at TP=1")
    # per layer: o_proj and down_proj reduce their outputs forward; the inputs' gradients of the column-wise
    # q/k/v and gate/up are reduced backward (one per projection). Once per model: the vocab embedding's output
    # (forward), the LM head's logits gathered (forward) and its input's gradient reduced (backward).
    layers = 2
    counts = out["counts"]["counts"]
    assert counts == {"all_reduce": layers * (2 + 5) + 2, "all_gather_into_tensor": 1}, counts


def test_tp2_dp2_and_sp2_dp2_match_single_process() -> None:
    ref_losses, ref_params, ref_norms = reference()
    for case, got in zip(CASES_4, run_distributed(grid4, world_size=4, timeout_s=240)[0]):
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), (case, got["losses"], ref_losses)
        assert got["norms"] == pytest.approx(ref_norms, rel=1e-5), (case, got["norms"], ref_norms)
        _close(got["params"], ref_params, case)
