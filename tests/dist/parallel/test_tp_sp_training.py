"""Tensor and sequence parallel training of a tiny Llama-style GPT against a single-process run: after 5 steps
the global parameters equal the reference to 2e-5 relative (fp32) and the logged losses match, with gradient
clipping on (so the global norm over TP shards must be right). One spawn of 2 ranks (TP=2 at ZeRO 1 and 3,
TP=2 at ZeRO 3 with everything on NVMe (the gradients in files), SP=2 at ZeRO 2, a TP=2 checkpoint resumed at
TP=1, collectives per step), one of 3 (TP=3 on heads it does not divide, split by whole KV groups, at ZeRO 2
and 3; its checkpoint resumed at TP=1 and TP=3) and one of 4 (TP=2 x DP=2 at ZeRO 3, SP=2 x DP=2 at ZeRO 1)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist.parallel.models import SEQ, TinyGPT, batches, loss_fn
from tests.harness import run_distributed, run_subtests

STEPS, BATCH, LR, CLIP = 5, 4, 1e-2, 0.5
EPS = 1e-6
"""Adam's eps, here and in the reference. At torch's default 1e-8 the comparison measured rounding order, not
layout. Adam's update lr * g / (|g| + eps) moves by up to lr * dg / eps for a gradient error dg, and a gradient
that cancels to near eps is mostly rounding: in TP=3's model (8 heads) layers.1.self_attn.o_proj.weight[29, 58]
sums 32 token products with sum |t| = 9.9e-3 to g = -1.7e-8 (-7.6e-9 after clipping by 0.44). Reassociating 32
fp32 terms leaves dg ~ sqrt(32) * 2^-24 * 9.9e-3 * 0.44 = 1.5e-9 (one process in fp32 against fp64: 9.1e-11),
so the first step alone can move that element by lr * dg / eps = 1.5e-3, 4.5e-4 of the tensor's norm (3.4).
Measured at 1e-8: that one element carries the whole difference, 3.0e-5 fp32 against fp64 and 4.3e-5 TP=3
against one process (1.3e-5 of the norm here, the same bits in 7 of 7 runs, 4 of them on 2 busy cores; 3.9e-5 of
the norm in a failing `make test`, over the 2e-5 bound). At 1e-6 the same dg moves it by at most 1.5e-5
(4.5e-6 of the norm); measured: fp32 against fp64 at most 7.3e-7 of any tensor's norm, the batch rows
reordered 4.2e-7, TP=3 against one process 1.0e-6, so the 2e-5 bounds below hold with a margin of 4 or more."""
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
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, eps=EPS)
    losses, norms = [], []
    for x, y in batches(STEPS, BATCH, seq):
        loss = loss_fn(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def make_engine(
    tp: int, sp: int, stage: int, data: Any = None, nvme: str = "", batch: int = BATCH, **model_args: int
) -> Any:
    """`nvme`: optimizer and parameter offload to NVMe under that directory, in sub-groups of 3000 elements.
    `batch` rows per step over the data-parallel ranks; the config gives the micro batch (train_batch_size
    counts TP ranks as data-parallel ones, as DeepSpeed's does, so it would not say `batch`)."""
    import torch.distributed as dist

    import slipstream

    config = {
        "train_micro_batch_size_per_gpu": batch // (dist.get_world_size() // (tp * sp)),
        "gradient_accumulation_steps": 1,
        "gradient_clipping": CLIP,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "eps": EPS}},
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
    rows = slice(index * len(x) // dp, (index + 1) * len(x) // dp)
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


def train(
    rank: int,
    world: int,
    *,
    tp: int,
    sp: int,
    stage: int,
    seq: int = SEQ,
    nvme: bool = False,
    nvme_dir: str = "",
    **model_args: int,
) -> dict:
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


def resume_at_tp1(
    rank: int,
    world: int,
    *,
    path: str,
    tp: int = 2,
    again_at_tp: bool = False,
    batch: int = BATCH,
    **model_args: int,
) -> dict:
    """3 steps at TP=`tp` (ZeRO 1) with a checkpoint after 2; the checkpoint resumed at TP=1 x DP=`tp` (ZeRO 2)
    must take the same third step (with `again_at_tp`, also resumed at TP=`tp` under ZeRO 3)."""
    data = batches(3, batch)
    first = make_engine(tp, 1, 1, batch=batch, **model_args)
    for x, y in data[:2]:
        train_step(first, x, y)
    first.save_checkpoint(path, tag="tp")
    losses = [train_step(first, *data[2])]
    params = [first._zero3_consolidated_16bit_state_dict()]
    first.destroy()
    for resumed_tp, stage in [(1, 2), (tp, 3)][: 1 + again_at_tp]:
        resumed = make_engine(resumed_tp, 1, stage, batch=batch, **model_args)
        resumed.load_checkpoint(path, tag="tp")
        assert resumed.global_steps == 2, resumed.global_steps
        losses.append(train_step(resumed, *data[2]))
        params.append(resumed._zero3_consolidated_16bit_state_dict())
        resumed.destroy()
    return {"losses": losses, "params": params}


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
    assert loss_dp2 == pytest.approx(loss_tp2, rel=1e-5)
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


UNEVEN = {"heads": 8, "kv_heads": 4}  # 4 KV groups on 3 ranks: 2 + 1 + 1 (query heads 4 + 2 + 2)
CASES_3 = [{"tp": 3, "sp": 1, "stage": 2, **UNEVEN}, {"tp": 3, "sp": 1, "stage": 3, **UNEVEN}]


def grid3(rank: int, world: int, path: str) -> dict:
    return {
        "train": run_subtests(CASES_3, lambda **case: train(rank, world, **case)),
        "resume": resume_at_tp1(rank, world, path=path, tp=3, again_at_tp=True, batch=6, **UNEVEN),
        "widths": _local_widths(),
    }


def _local_widths() -> dict[str, int]:
    engine = make_engine(3, 1, 0, **UNEVEN)
    attn = engine.module.layers[0].self_attn
    widths = {name: getattr(attn, name).weight.shape[name == "o_proj"] for name in ("q_proj", "k_proj", "o_proj")}
    engine.destroy()
    return widths


def _close_by_norm(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: Any) -> None:
    """Each tensor within 2e-5 of the reference relative to its norm (see EPS for why rounding order stays
    below that)."""
    assert set(got) >= set(expected), (what, sorted(set(expected) - set(got)))
    for name, value in expected.items():
        assert got[name].shape == value.shape, (what, name)
        error = float((got[name] - value).norm() / value.norm())
        assert error <= 2e-5, (what, name, error)


def test_tp3_splits_uneven_heads_by_whole_kv_groups_and_matches_single_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """TP=3 on 8 query / 4 KV heads (head size 8): the ranks hold 2, 1 and 1 KV groups; trained at ZeRO 2 and 3
    like one process; its checkpoint (global tensors, saved at ZeRO 1) resumes at TP=1 x DP=3 and again at TP=3
    under ZeRO 3."""
    ranks = run_distributed(grid3, world_size=3, timeout_s=240, path=str(tmp_path / "ckpt"))
    assert [r["widths"] for r in ranks] == [
        {"q_proj": 32, "k_proj": 16, "o_proj": 32},
        {"q_proj": 16, "k_proj": 8, "o_proj": 16},
        {"q_proj": 16, "k_proj": 8, "o_proj": 16},
    ]
    out = ranks[0]
    ref_losses, ref_params, ref_norms = reference(**UNEVEN)
    for case, got in zip(CASES_3, out["train"]):
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-5), (case, got["losses"], ref_losses)
        assert got["norms"] == pytest.approx(ref_norms, rel=1e-5) and min(ref_norms) > CLIP, (case, got["norms"])
        _close_by_norm(got["params"], ref_params, case)
    losses, params = out["resume"]["losses"], out["resume"]["params"]
    assert losses[1:] == pytest.approx([losses[0]] * 2, rel=1e-5), losses
    for resumed, what in zip(params[1:], ("TP=3 checkpoint resumed at TP=1", "TP=3 checkpoint resumed at TP=3")):
        _close(resumed, params[0], what)
