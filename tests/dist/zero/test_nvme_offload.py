"""ZeRO-Infinity: optimizer offload to NVMe (a temp dir here) at stages 1, 2 and 3, and parameter offload to NVMe
at stage 3: the same parameters and per-step grad norms as the single-process reference after 5 steps clipped
at CLIP (under every step's norm); files live under nvme_path only while the run does; a directory left by a
dead run is removed; a checkpoint taken with NVMe offload (world 2, stage 2) loads at world 1, stage 0 with the
reference's parameters and Adam moments, and trains on to the reference's parameters.

Bounded host memory: a model built under zero.Init with its shards on NVMe and stepped in sub-groups of
`sub_group_size` elements trains to the reference's parameters, never has more than two sub-groups' masters in
memory during a step (none between steps), and zero.Init's own shard files are gone once the engine took over."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.dist.engine.test_engine_parity import CLIP, LR, STEPS, global_batches
from tests.dist.zero.test_stage3 import stage3_config, train
from tests.harness import run_distributed
from tests.harness.checks import assert_slices_match, owned_state
from tests.harness.models import TinyMLP
from tests.harness.reference import reference_run

SAVED_AT = 2


def nvme_grid(rank: int, world: int, *, nvme: str, ckpt: str) -> list:
    results = []
    for stage in (1, 2, 3):
        results.append(train(rank, world, model="mlp", micro=2, gas=2, torch_style=False, stage=stage, clip=CLIP,
                             offload_optimizer={"device": "nvme", "nvme_path": nvme}))
    # stage 3 with the parameter shards on NVMe too (masters offloaded to the host)
    results.append(train(rank, world, model="mlp", micro=2, gas=2, torch_style=True, stage=3, clip=CLIP,
                         offload_optimizer={"device": "cpu"}, offload_param={"device": "nvme", "nvme_path": nvme}))
    results.append(bounded_run(rank, world, nvme=nvme))
    import slipstream

    # two engines alive in one process, stepping in turns: their swap files must never mix
    pair_config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                   "gradient_clipping": CLIP,
                   "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
                   "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}}
    pair = [slipstream.initialize(model=TinyMLP(), config=pair_config)[0] for _ in range(2)]
    for inputs, targets in global_batches():
        for engine in pair:
            for m in range(2):
                start = (m * world + rank) * 2
                engine.backward(TinyMLP.loss(engine(inputs[start:start + 2]), targets[start:start + 2]))
                engine.step()
    for engine in pair:
        results.append({"params": {n: p.detach().clone() for n, p in engine.module.named_parameters()}})
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": nvme}}}
    engine, *_ = slipstream.initialize(model=TinyMLP(), config=config)
    swapped = sorted(p.name for p in Path(nvme).glob("slipstream-*/*.swp"))
    for inputs, targets in global_batches()[:SAVED_AT]:
        engine.backward(TinyMLP.loss(engine(inputs[rank * 4:(rank + 1) * 4]), targets[rank * 4:(rank + 1) * 4]))
        engine.step()
    engine.save_checkpoint(ckpt)
    return [results, swapped]


SUB_GROUP = 300  # TinyMLP's shards at world 2, one unit per layer: 241 + 19, 685 (a run of its own) + 19, 93 + 3
# elements: runs [260], [685], [19], [96], packed into three sub-groups [260], [685], [19 + 96]


def bounded_run(rank: int, world: int, *, nvme: str) -> dict:
    """Everything on NVMe, the model built under zero.Init(nvme), the step in sub-groups of SUB_GROUP elements."""
    import slipstream

    offload = {"device": "nvme", "nvme_path": nvme}
    config = stage3_config(2, 2, offload_optimizer=offload, offload_param=offload, sub_group_size=SUB_GROUP)
    config["gradient_clipping"] = CLIP
    with slipstream.zero.Init(config_dict_or_path=config):
        model = TinyMLP()
    own = f"slipstream-{os.getpid()}-rank{rank}-init*"
    init_files = len(list(Path(nvme).glob(f"{own}/*.swp")))
    engine, *_ = slipstream.initialize(model=model, config=config)
    init_files_after = len(list(Path(nvme).glob(f"{own}/*.swp")))
    zero = engine.optimizer
    buffers = [b for group in zero.groups for b in group.master_buffers]
    resident_at_update: list[int] = []
    step_sub_group = zero.step_sub_group

    def counting(index: int) -> None:
        resident_at_update.append(sum(b.untyped_storage().nbytes() > 0 for b in buffers))
        step_sub_group(index)

    zero.step_sub_group = counting
    norms = []
    for inputs, targets in global_batches():
        for m in range(2):
            start = (m * world + rank) * 2
            engine.backward(TinyMLP.loss(engine(inputs[start:start + 2]), targets[start:start + 2]))
            engine.step()
        norms.append(engine.get_global_grad_norm())
    resident_between = sum(b.untyped_storage().nbytes() > 0 for b in buffers)
    params = {name: value.float() for name, value in engine.zero_model.full_state(only_rank0=False).items()}
    engine.destroy()
    return {"params": params, "norms": norms, "sub_groups": zero.num_sub_groups, "masters": len(buffers),
            "init_files": (init_files, init_files_after), "resident": (max(resident_at_update), resident_between)}


def test_nvme_offload_matches_the_reference_and_cleans_up(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    stale = nvme / "slipstream-999999999-rank0-optimizer0"  # a crashed run's leftovers: removed, never mixed in
    stale.mkdir()
    (stale / "group0_master.swp").write_bytes(b"old")
    reference = reference_run(TinyMLP, global_batches(), lr=LR, steps=STEPS, optimizer="adamw", weight_decay=0.01,
                              grad_clip=CLIP)
    assert min(reference.grad_norms) > 3 * CLIP  # clipped at every step
    per_rank = run_distributed(nvme_grid, world_size=2, tmp_dir=tmp_path / "run", nvme=str(nvme),
                               ckpt=str(tmp_path / "ckpt"))
    for results, swapped in per_rank:
        assert any(name.endswith("_master.swp") for name in swapped), swapped  # masters really left memory
        assert len(results) == 7
        bounded = results[4]
        assert bounded["sub_groups"] == bounded["masters"] == 3, bounded["sub_groups"]
        assert bounded["resident"] == (2, 0), bounded["resident"]  # the sub-group updated and the next one, read
        assert bounded["init_files"][0] >= 3 and bounded["init_files"][1] == 0, bounded["init_files"]
        labels = (1, 2, 3, "3 + offload_param", "3, all on NVMe, sub-groups", "2, engine A of 2", "2, engine B of 2")
        for stage, result in zip(labels, results):
            if "norms" in result:
                torch.testing.assert_close(result["norms"], reference.grad_norms, rtol=1e-5, atol=0,
                                           msg=lambda m, stage=stage: f"stage {stage} grad norms: {m}")
            for name, value in reference.params.items():
                torch.testing.assert_close(result["params"][name], value, rtol=2e-5, atol=2e-6,
                                           msg=lambda m, stage=stage, name=name: f"stage {stage} {name}: {m}")
    assert not stale.exists()
    assert not list(nvme.glob("slipstream-*")), "run directories are removed at exit"
    # the NVMe-offloaded checkpoint (world 2, stage 2, default clip 1.0) loads in one process at stage 0
    loaded = run_distributed(load_at_stage0, world_size=1, tmp_dir=tmp_path / "load", ckpt=str(tmp_path / "ckpt"))[0]
    saved = reference_run(TinyMLP, global_batches(), lr=LR, steps=SAVED_AT, weight_decay=0.01, grad_clip=1.0)
    assert loaded["steps"] == (SAVED_AT, STEPS)
    assert_slices_match([loaded["master"]], saved.masters, rtol=2e-5, atol=2e-6, where="loaded masters")
    for key in ("exp_avg", "exp_avg_sq"):
        moments = {name: state[key] for name, state in saved.optimizer_state.items()}
        assert_slices_match([loaded[key]], moments, rtol=2e-5, atol=1e-9, where=f"loaded {key}")
    resumed = reference_run(TinyMLP, global_batches(), lr=LR, steps=STEPS, weight_decay=0.01, grad_clip=1.0)
    for name, value in resumed.params.items():
        torch.testing.assert_close(loaded["params"][name], value, rtol=2e-5, atol=2e-6,
                                   msg=lambda m, name=name: f"trained on after the load {name}: {m}")


def load_at_stage0(rank: int, world: int, *, ckpt: str) -> dict:
    import slipstream

    config = {"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": LR,
                                                                                           "weight_decay": 0.01}},
              "zero_optimization": {"stage": 0}}
    engine, *_ = slipstream.initialize(model=TinyMLP(), config=config)
    engine.load_checkpoint(ckpt)
    out = owned_state(engine, keys=("exp_avg", "exp_avg_sq"))
    steps = engine.global_steps
    for inputs, targets in global_batches()[SAVED_AT:]:
        engine.backward(TinyMLP.loss(engine(inputs), targets))
        engine.step()
    return {**out, "steps": (steps, engine.global_steps),
            "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()}}


def test_nvme_path_must_be_a_writable_directory_with_room(tmp_path: Path) -> None:
    from slipstream.offload.nvme import NVMeOffload

    with pytest.raises(ValueError, match="nvme_path=.*not a writable directory"):
        NVMeOffload(nvme_path=str(tmp_path / "missing"))
    policy = NVMeOffload(nvme_path=str(tmp_path))
    assert policy.directory is not None and oct(policy.directory.stat().st_mode)[-3:] == "700"
    with pytest.raises(RuntimeError, match=r"needs .* GiB .* only .* GiB is free"):
        policy.check_room(2**62)
    os.rmdir(policy.directory)


# ---- swapped gradients (docs/design.md D38): ZeRO-3 with NVMe offload keeps each sub-group's gradients in a file

POISONED_STEP, SET_INF_STEP, SET_INF_PARAM = 1, 3, "layers.2.weight"  # layers.2.weight is in the third sub-group


def swapped_run(rank: int, world: int, *, nvme: str, device: str, precision: str = "fp32",
                limit: int | None = None, gradients: str | None = None) -> dict:
    """Five steps of TinyMLP at ZeRO-3 (accumulation 2, clipping active, SUB_GROUP's three sub-groups) with the
    optimizer offloaded to `device`. Before every step the averaged gradients are read with safe_get_full_grad;
    fp16: one micro-batch carries an inf (a skipped step), and a later step gets an inf gradient set for
    SET_INF_PARAM (another skipped step, naming it). NVMe also counts the resident gradient buffers."""
    import slipstream
    from slipstream.utils import safe_get_full_grad, safe_set_full_grad

    offload = {"device": device, **({"nvme_path": nvme} if device == "nvme" else {})}
    config = stage3_config(2, 2, offload_optimizer=offload, sub_group_size=SUB_GROUP)
    config["gradient_clipping"] = CLIP
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000}
    if gradients is not None:  # SLIPSTREAM_NVME_GRADIENTS, read when the engine is built
        os.environ["SLIPSTREAM_NVME_GRADIENTS"] = gradients
    from slipstream.offload.nvme import NVMeOffload

    room: list[int] = []  # what the start-up disk check asked for
    check_room = NVMeOffload.check_room
    NVMeOffload.check_room = lambda self, needed: (room.append(needed), check_room(self, needed))[1]  # type: ignore[method-assign]
    try:
        engine, *_ = slipstream.initialize(model=TinyMLP(), config=config)
    finally:
        os.environ.pop("SLIPSTREAM_NVME_GRADIENTS", None)
        NVMeOffload.check_room = check_room  # type: ignore[method-assign]
    if device == "nvme":  # fp32: the masters alias the shards; fp16: each sub-group's were written as it was built.
        zero = engine.optimizer  # Either way the start-up check asks room for the two Adam states and the gradients
        elements = sum(p.numel() for group in zero.groups for p in group.master_pieces)
        files = zero.offload.gradients.file_bytes() if zero.offload.gradients is not None else 0
        assert elements > 0 and room == [2 * 4 * elements + files], (room, elements, files)
    swap = engine.optimizer.offload.gradients if device == "nvme" else None
    if gradients == "memory":
        assert swap is None and not engine.optimizer.offload.swaps_gradients
        assert engine.optimizer.groups[0].grad_storage.numel() > 0  # the whole shard, in memory
    if swap is not None and limit is not None:
        swap.limit = limit
    names = dict(engine.module.named_parameters())
    norms, grads, culprits, after_backward, after_step = [], [], [], [], []
    for step, (inputs, targets) in enumerate(global_batches()):
        for m in range(2):
            start = (m * world + rank) * 2
            x = inputs[start:start + 2].clone()
            if precision == "fp16" and step == POISONED_STEP and m == 0:
                x[0, 0] = float("inf")
            engine.backward(TinyMLP.loss(engine(x).float(), targets[start:start + 2]))
            if swap is not None:
                after_backward.append(swap.resident_count())
            if m == 1:
                grads.append({n: safe_get_full_grad(p).clone() for n, p in names.items()})
                if precision == "fp16" and step == SET_INF_STEP:
                    safe_set_full_grad(names[SET_INF_PARAM], torch.full(tuple(names[SET_INF_PARAM].ds_shape), float("inf")))
            engine.step()
        if swap is not None:
            after_step.append(swap.resident_count())
        norms.append(engine.get_global_grad_norm())
        culprits.append(engine.optimizer.last_nonfinite_param if not engine._step_applied else "")
    params = {name: value.float() for name, value in engine.zero_model.full_state(only_rank0=False).items()}
    out = {"params": params, "norms": norms, "grads": grads, "culprits": culprits,
           "skipped": engine.skipped_steps, "sub_groups": engine.optimizer.num_sub_groups}
    if swap is not None:
        out.update(peak=swap.peak_open, after_backward=after_backward, after_step=after_step, buffers=len(swap),
                   files=sorted(p.name for p in engine.optimizer.offload.directory.glob("*_grad.swp")))
    engine.destroy()
    return out


def swapped_grid(rank: int, world: int, *, nvme: str) -> dict:
    return {
        "cpu": swapped_run(rank, world, nvme=nvme, device="cpu"),
        "nvme": swapped_run(rank, world, nvme=nvme, device="nvme"),
        "nvme_limit1": swapped_run(rank, world, nvme=nvme, device="nvme", limit=1),
        "cpu_fp16": swapped_run(rank, world, nvme=nvme, device="cpu", precision="fp16"),
        "nvme_fp16": swapped_run(rank, world, nvme=nvme, device="nvme", precision="fp16"),
        "nvme_memory": swapped_run(rank, world, nvme=nvme, device="nvme", gradients="memory"),
    }


def test_swapped_gradients_equal_cpu_offload_and_stay_bounded(tmp_path: Path) -> None:
    """NVMe offload at ZeRO-3 with the gradients in files (at most `limit` sub-groups' buffers resident during
    backward, counted by the policy) trains to exactly the CPU-offload run's parameters, grad norms and
    safe_get_full_grad values (the divisor, 2 ranks x 2 micro-batches x a power-of-two loss scale, keeps the
    streamed norm bit-equal), including fp16 steps skipped for a non-finite gradient, each naming its parameter."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    per_rank = run_distributed(swapped_grid, world_size=2, tmp_dir=tmp_path / "run", nvme=str(nvme))
    for rank, runs in enumerate(per_rank):
        for label, cpu in (("nvme", "cpu"), ("nvme_limit1", "cpu"), ("nvme_fp16", "cpu_fp16")):
            mine, theirs = runs[label], runs[cpu]
            assert mine["sub_groups"] == mine["buffers"] == 3, (label, mine["sub_groups"], mine["buffers"])
            assert mine["files"] == ["group0_grad.swp"], (label, mine["files"])  # the gradients went to a file
            # the last `limit` buffers opened stay for the next micro-batch and the step (the first ones it
            # steps); the rest are in the file; after the step none is in memory
            kept = 1 if label == "nvme_limit1" else 2
            assert mine["after_backward"] == [kept] * (2 * STEPS), (label, mine["after_backward"])
            assert mine["after_step"] == [0] * STEPS, (label, mine["after_step"])
            assert mine["norms"] == theirs["norms"], (label, rank, mine["norms"], theirs["norms"])
            assert mine["culprits"] == theirs["culprits"] and mine["skipped"] == theirs["skipped"], label
            for step, (a, b) in enumerate(zip(mine["grads"], theirs["grads"])):
                for name in b:
                    torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, equal_nan=True,  # bit-equal
                                               msg=lambda m, w=f"{label} rank {rank} step {step} {name}": f"{w}: {m}")
            for name, value in theirs["params"].items():
                assert torch.equal(mine["params"][name], value), f"{label} rank {rank} {name}"
        # units finish in reverse order: the third sub-group is still being filled when the second opens (and is
        # written out when the first opens; with a limit of 1, when the second opens, and read back for its last
        # run)
        memory, cpu = runs["nvme_memory"], runs["cpu"]  # SLIPSTREAM_NVME_GRADIENTS=memory: no gradient file
        assert "files" not in memory and memory["norms"] == cpu["norms"], (memory.get("files"), memory["norms"])
        assert all(torch.equal(memory["params"][n], v) for n, v in cpu["params"].items())
        assert runs["nvme"]["peak"] == 2 and runs["nvme_limit1"]["peak"] == 1, (runs["nvme"]["peak"],
                                                                                 runs["nvme_limit1"]["peak"])
        assert min(runs["cpu"]["norms"]) > CLIP  # clipping is active at every step
        fp16 = runs["nvme_fp16"]
        assert fp16["skipped"] == 2, fp16["skipped"]
        assert fp16["culprits"][POISONED_STEP] == "layers.0.weight", fp16["culprits"]
        assert fp16["culprits"][SET_INF_STEP] == SET_INF_PARAM, fp16["culprits"]
        assert [c == "" for c in fp16["culprits"]] == [s not in (POISONED_STEP, SET_INF_STEP) for s in range(STEPS)]


def checkpoint_with_pending_grads(rank: int, world: int, *, nvme: str, ckpt: str) -> dict:
    """fp16 at ZeRO-3, everything on NVMe: save between a backward and its step (the gradients in files), load
    into a fresh engine, run the same backward and step in both."""
    import slipstream

    offload = {"device": "nvme", "nvme_path": nvme}

    def make():  # type: ignore[no-untyped-def]
        config = stage3_config(8, 1, offload_optimizer=offload, offload_param=offload, sub_group_size=SUB_GROUP)
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
        return slipstream.initialize(model=TinyMLP(), config=config)[0]

    batches = global_batches()
    engine = make()
    for inputs, targets in batches[:2]:
        engine.backward(TinyMLP.loss(engine(inputs).float(), targets))
        engine.step()
    inputs, targets = batches[2]
    engine.backward(TinyMLP.loss(engine(inputs).float(), targets))
    states = [s.value for s in engine.optimizer.offload.gradients.states]
    engine.save_checkpoint(ckpt)
    engine.step()
    loaded = make()
    loaded.load_checkpoint(ckpt)
    loaded.backward(TinyMLP.loss(loaded(inputs).float(), targets))
    loaded.step()
    return {"states": states, "params": [engine.zero_model.full_state(only_rank0=False),
                                         loaded.zero_model.full_state(only_rank0=False)]}


def test_checkpoint_with_gradients_in_files(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    out = run_distributed(checkpoint_with_pending_grads, world_size=1, tmp_dir=tmp_path / "run", nvme=str(nvme),
                          ckpt=str(tmp_path / "ckpt"))[0]
    assert "saved" in out["states"], out["states"]  # some gradients were in the file when the save ran
    trained, loaded = out["params"]
    for name, value in trained.items():
        assert torch.equal(loaded[name], value), name
