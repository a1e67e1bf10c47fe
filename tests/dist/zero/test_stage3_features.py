"""ZeRO-3 behaviour at world size 2: per-rank memory against stage 0, one all-gather per unit per forward and
per backward, the named error for a sharded parameter, ds_* attributes, GatheredParameters with
modifier_rank, generation that gathers once, save_16bit_model, an inference-only engine, rank-routed MoE,
LoRA-style frozen bases, the unit-order check, and zero.Init (values and construction peak)."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

from tests.dist.zero.stage3_models import Experts, Stack, TinyLoRA, TinyMoE
from tests.harness import run_distributed
from tests.harness.models import TinyTransformer
from tests.harness.reference import ReferenceRun, run_reference

MOE_ROUTES = ((0, 1), (2, 3))  # the experts each rank routes to
MOE_STEPS = 20


def _config(stage: int, **zero: object) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0, **zero}}


def _step(engine, model: TinyTransformer, seed: int) -> None:  # type: ignore[no-untyped-def]
    inputs, targets = model.make_batch(seed=seed, batch_size=2)
    engine.backward(TinyTransformer.loss(engine(inputs), targets))
    engine.step()


def memory_and_counts(rank: int, world: int) -> dict:
    import slipstream
    from slipstream.comm import count_collectives

    owned = {}
    for stage in (0, 3):
        model = TinyTransformer()
        engine, *_ = slipstream.initialize(model=model, config=_config(stage))
        _step(engine, model, 0)
        owned[stage] = engine.optimizer.owned_bytes()
        if stage == 3:
            units = [u for u in engine.zero_model.units if u.params and not u.persistent]
            inputs, targets = model.make_batch(seed=1, batch_size=2)
            with count_collectives() as forward:
                loss = TinyTransformer.loss(engine(inputs), targets)
            with count_collectives() as backward:
                engine.backward(loss)
            engine.step()
            counts = {"units": len(units), "forward": forward.calls["all_gather"],
                      "backward": backward.calls["all_gather"], "reduce": backward.calls["reduce_scatter"],
                      "n_params": sum(len(u.params) for u in units)}
        engine.destroy()
    return {"owned": owned, "counts": counts}


def test_memory_is_one_over_world_and_one_gather_per_unit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = run_distributed(memory_and_counts, world_size=2, tmp_dir=tmp_path)
    for result in results:
        zero0, zero3, counts = result["owned"][0], result["owned"][3], result["counts"]
        padding = counts["n_params"] * 4  # at most one padding element per parameter, fp32
        for role in ("params", "grads", "optimizer_state"):
            slack = (2 if role == "optimizer_state" else 1) * padding
            assert zero3[role] <= zero0[role] / 2 + slack, (role, zero0, zero3)
            assert zero3[role] >= zero0[role] / 2 - padding * 8, (role, zero0, zero3)
        assert counts["units"] == 6  # tok_emb, pos_emb, 2 blocks, norm, head
        assert counts["forward"] == counts["units"] and counts["backward"] == counts["units"], counts
        assert counts["reduce"] == counts["units"], counts


def behaviours(rank: int, world: int) -> dict:
    import slipstream
    from slipstream.comm import count_collectives
    from slipstream.zero import GatheredParameters, ShardedParameterError, ZeroParamStatus, unwrap_model_for_generation

    out: dict = {}
    model = TinyTransformer()
    engine, *_ = slipstream.initialize(model=model, config=_config(3, stage3_gather_16bit_weights_on_model_save=True))
    _step(engine, model, 0)
    weight = engine.module.layers[0].mlp[0].weight
    out["shape"] = (tuple(weight.shape), weight.numel(), weight.dtype, weight.ds_numel, tuple(weight.ds_shape),
                    weight.ds_tensor.numel(), weight.ds_status, weight.ds_persist)
    try:
        weight.sum()
        out["error"] = None
    except ShardedParameterError as exc:
        out["error"] = str(exc)
    with GatheredParameters([weight]):
        out["gathered_sum"] = float(weight.sum())
        out["gathered_status"] = weight.ds_status
    assert weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
    # modifier_rank=0: rank 0's change reaches every rank
    embedding = engine.module.tok_emb.weight
    with GatheredParameters(embedding, modifier_rank=0):
        if rank == 0:
            embedding.data.fill_(0.25)
    with GatheredParameters(embedding):
        out["embedding"] = (float(embedding.min()), float(embedding.max()))
    # generation: one gather of the whole model, not one per call
    inputs, _ = model.make_batch(seed=3, batch_size=1)
    with torch.no_grad():
        with count_collectives() as plain:
            engine(inputs)
        with count_collectives() as held, unwrap_model_for_generation(engine) as module:
            for _ in range(4):
                logits = module(inputs)
    out["gathers"] = (plain.calls["all_gather"], held.calls["all_gather"])
    out["logits"] = logits
    # save_16bit_model writes the whole model on rank 0
    directory = os.environ["S3_SAVE_DIR"]
    out["saved"] = engine.save_16bit_model(directory, "model.bin")
    full = engine.zero_model.full_state(only_rank0=False)
    if rank == 0:
        loaded = torch.load(os.path.join(directory, "model.bin"), weights_only=True)
        out["save_matches"] = set(loaded) >= set(full) and all(torch.equal(loaded[k], v) for k, v in full.items())
    engine.destroy()
    # without the flag: False and nothing written
    engine, *_ = slipstream.initialize(model=TinyTransformer(), config=_config(3))
    out["saved_without_flag"] = engine.save_16bit_model(directory, "other.bin")
    engine.destroy()
    # inference-only engine (no optimizer): same outputs as the plain model
    config = _config(3)
    del config["optimizer"]
    engine, *_ = slipstream.initialize(model=TinyTransformer(), config=config)
    with torch.no_grad():
        out["inference"] = torch.allclose(engine(inputs), TinyTransformer()(inputs), atol=1e-6)
    engine.destroy()
    return out


def test_sharded_parameter_surface(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("S3_SAVE_DIR", str(tmp_path / "saved"))
    results = run_distributed(behaviours, world_size=2, tmp_dir=tmp_path / "run")
    from slipstream.zero import ZeroParamStatus

    for rank, out in enumerate(results):
        assert out["shape"] == ((96, 24), 96 * 24, torch.float32, 96 * 24, (96, 24), math.ceil(96 * 24 / 2),
                                ZeroParamStatus.NOT_AVAILABLE, False)
        assert out["error"] is not None and "layers.0.mlp.0.weight" in out["error"]
        assert "GatheredParameters" in out["error"]
        assert out["gathered_status"] is ZeroParamStatus.AVAILABLE and math.isfinite(out["gathered_sum"])
        assert out["embedding"] == (0.25, 0.25), (rank, out["embedding"])
        plain, held = out["gathers"]
        assert plain == 6 and held == 6, out["gathers"]  # 4 forwards inside the context: still one gather per unit
        assert out["saved"] is True and out["saved_without_flag"] is False
        assert out["inference"]
    assert results[0]["save_matches"]
    torch.testing.assert_close(results[0]["logits"], results[1]["logits"])
    assert not (tmp_path / "saved" / "other.bin").exists()


def moe_lora_and_order(rank: int, world: int) -> dict:
    import slipstream
    from slipstream.comm import count_collectives
    from slipstream.zero import GatheredParameters
    from slipstream.zero.stage3.unit import UnitOrderError

    out: dict = {}
    # MoE: each rank routes to a different pair of experts; 20 steps, no hang; every expert trained everywhere
    model = TinyMoE()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.route(MOE_ROUTES[rank])
    engine, *_ = slipstream.initialize(model=model, config=_config(3))
    gen = torch.Generator().manual_seed(rank)
    norms = []
    for _ in range(MOE_STEPS):
        x = torch.randn(2, 10, generator=gen)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        norms.append(engine.get_global_grad_norm())
    final = engine.zero_model.full_state(only_rank0=False)
    out["moe_changed"] = all(not torch.equal(final[n], initial[n]) for n in initial)
    out["moe_final"], out["moe_norms"] = final, norms
    engine.destroy()
    # LoRA: frozen bases get no optimizer state and take no part in the reduce-scatter
    model = TinyLoRA()
    base_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    engine, *_ = slipstream.initialize(model=model, config=_config(3))
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(9))
    with count_collectives() as counter:
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    state_numel = sum(v.numel() for s in engine.optimizer.optimizer.state.values() for v in s.values() if v.dim() > 0)
    out["lora"] = (state_numel, 2 * math.ceil(trainable / 2), counter.bytes["reduce_scatter"], 4 * (trainable + 8))
    after = engine.zero_model.full_state(only_rank0=False)
    out["base_unchanged"] = all(torch.equal(after[n], v) for n, v in base_before.items())
    with GatheredParameters(list(model.parameters())):
        out["lora_grads_dropped"] = all(p.grad is None for p in model.parameters())
    engine.destroy()
    # experts as top-level units with rank-dependent routing: a named error, not a hang or mixed values
    engine, *_ = slipstream.initialize(model=Experts(), config=_config(3))
    try:
        engine(torch.randn(2, 10), 0 if rank == 0 else 2)
        out["order_error"] = None
    except UnitOrderError as exc:
        out["order_error"] = str(exc)
    dist.barrier()
    return out


def test_moe_lora_and_unit_order(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = run_distributed(moe_lora_and_order, world_size=2, tmp_dir=tmp_path, timeout_s=120)
    for out in results:
        assert out["moe_changed"]
        state, expected_state, rs_bytes, rs_limit = out["lora"]
        assert state == expected_state, out["lora"]  # exp_avg + exp_avg_sq of this rank's adapter shards only
        assert 0 < rs_bytes <= rs_limit, out["lora"]  # the frozen bases were not reduced
        assert out["base_unchanged"] and out["lora_grads_dropped"]
        error = out["order_error"]
        assert error is not None and "experts.0" in error and "experts.2" in error
    # one process, both ranks' routes: each step averages the two ranks' routed losses (the default clip of 1.0
    # is active in most steps: norms 0.4-4.4)
    reference = moe_reference()
    assert max(reference.grad_norms) > 2.0
    for rank, out in enumerate(results):
        torch.testing.assert_close(out["moe_norms"], reference.grad_norms, rtol=1e-5, atol=0,
                                   msg=lambda m, rank=rank: f"rank {rank} MoE grad norms: {m}")
        for name, value in reference.params.items():
            torch.testing.assert_close(out["moe_final"][name], value, rtol=2e-5, atol=2e-6,
                                       msg=lambda m, rank=rank, name=name: f"rank {rank} MoE {name}: {m}")


def moe_reference() -> ReferenceRun:
    gens = [torch.Generator().manual_seed(rank) for rank in range(2)]  # the ranks' input streams

    def micro_losses(model: torch.nn.Module, step: int) -> list[torch.Tensor]:
        losses = []
        for rank, gen in enumerate(gens):
            model.route(MOE_ROUTES[rank])  # type: ignore[operator]
            losses.append(model(torch.randn(2, 10, generator=gen)).pow(2).mean())
        return losses

    return run_reference(TinyMoE, micro_losses, lr=1e-2, steps=MOE_STEPS, grad_clip=1.0)


def _peak_growth_mib(build) -> float:  # type: ignore[no-untyped-def]
    def status(key: str) -> int:
        with open("/proc/self/status") as handle:
            return next(int(line.split()[1]) for line in handle if line.startswith(key))

    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # reset VmHWM to the current RSS
    before = status("VmRSS:")
    build()
    return (status("VmHWM:") - before) / 1024


def init_memory_and_values(rank: int, world: int, *, dim: int, count: int) -> dict:
    import slipstream
    from slipstream.zero.stage3.model import zero_model_of

    keep = [_init_stack(slipstream, 8, 2), Stack(8, 2)]  # warm up: imports and first collectives are not the model
    keep.clear()
    plain = _peak_growth_mib(lambda: keep.append(Stack(dim, count)))
    keep.clear()
    sharded = _peak_growth_mib(lambda: keep.append(_init_stack(slipstream, dim, count)))
    stack = keep[0]
    shard_numel = sum(p.ds_tensor.numel() for p in stack.parameters())
    # values: a model built under Init equals the same model built without it (same seed); changes made with
    # GatheredParameters(modifier_rank=0) before initialize() (how Transformers loads weights) reach every rank
    with slipstream.zero.Init(config_dict_or_path=_config(3)):
        model = TinyTransformer()
    with slipstream.zero.GatheredParameters(list(model.head.parameters(recurse=False)), modifier_rank=0):
        if rank == 0:
            model.head.bias.data.fill_(0.5)
    init_pool = model.head.bias.ds_record.unit.pool  # holds the gathered memory lent above, idle
    engine, *_ = slipstream.initialize(model=model, config=_config(3))
    assert zero_model_of(model) is engine.zero_model
    values = engine.zero_model.full_state(only_rank0=False)
    reference = TinyTransformer().state_dict()
    reference["head.bias"] = torch.full_like(reference["head.bias"], 0.5)
    # Init(module=...) shards an existing model in place
    existing = TinyTransformer()
    slipstream.zero.Init(module=existing, config_dict_or_path=_config(3))
    sharded_existing = all(p.ds_tensor.numel() == -(-p.numel() // world) for p in existing.parameters())
    engine2, *_ = slipstream.initialize(model=existing, config=_config(3))
    values2 = engine2.zero_model.full_state(only_rank0=False)
    plain_reference = TinyTransformer().state_dict()
    return {"plain": plain, "sharded": sharded, "shard_numel": shard_numel, "init_pool": init_pool.gathered_bytes,
            "equal": all(torch.equal(values[n], reference[n]) for n in values) and sharded_existing
            and all(torch.equal(values2[n], plain_reference[n]) for n in values2)}


def _init_stack(slipstream, dim: int, count: int):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    with slipstream.zero.Init():
        return Stack(dim, count)


def test_zero_init_shards_during_construction(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs /proc/self/clear_refs to measure the peak RSS of construction")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")  # freed blocks go back to the OS at once
    dim, count = 512, 16  # 16 layers of 1 MiB
    results = run_distributed(init_memory_and_values, world_size=2, tmp_dir=tmp_path, dim=dim, count=count)
    layer_mib = dim * dim * 4 / 2**20
    for out in results:
        assert out["equal"]
        assert out["init_pool"] == 0, "zero.Init's pool lets its gathered memory go once its units are dropped"
        assert out["shard_numel"] == count * dim * dim // 2
        assert out["plain"] >= 0.9 * count * layer_mib, out  # the measurement sees a whole model
        # about this rank's shards (half the model) plus the largest module
        assert out["sharded"] <= count * layer_mib / 2 + 2 * layer_mib + 1.0, out
