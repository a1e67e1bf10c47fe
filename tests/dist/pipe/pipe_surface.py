"""The pipeline engine as DeepSpeed's engine: `isinstance(engine, DeepSpeedEngine)` through Slipstream's
deepspeed paths, and the DeepSpeed engine and pipeline methods on 2 stages (run inside test_pipeline.py's
2-rank spawn): set_train_batch_size, is_gradient_accumulation_boundary, set_dataiterator / set_dataloader,
set_has_attention_mask, get_pipeline_parallel_rank, module_state_dict, save_16bit_model (the whole model on
rank 0), deepspeed_io (its sampler over the data-parallel replicas)."""

from __future__ import annotations

import torch

from tests.dist.pipe import pipe_models as pm

PIPELINE_METHODS = (
    "train_batch",
    "eval_batch",
    "set_dataiterator",
    "set_dataloader",
    "set_batch_fn",
    "set_has_attention_mask",
    "is_first_stage",
    "is_last_stage",
    "get_pipeline_parallel_rank",
    "is_gradient_accumulation_boundary",
    "set_train_batch_size",
    "module_state_dict",
    "load_module_state_dict",
    "zero_optimization_stage",
    "save_16bit_model",
    "get_data_parallel_rank",
    "get_global_grad_norm",
    "get_additional_losses",
    "reset_activation_shape",
    "log_for_device",
    "tput_log",
)
"""DeepSpeed 0.19's PipelineEngine methods, its own and those of DeepSpeedEngine a pipeline client calls."""


class _BoundaryAtStep:
    """A scheduler that records engine.is_gradient_accumulation_boundary() when the optimizer step calls it."""

    def __init__(self, engine: object) -> None:
        self.engine = engine
        self.seen: list[bool] = []

    def step(self, **_: object) -> None:
        self.seen.append(self.engine.is_gradient_accumulation_boundary())  # type: ignore[attr-defined]


def surface_case(rank: int, world: int, *, path: str, config: dict) -> dict:
    """The pipeline engine is DeepSpeed's engine (through Slipstream's deepspeed paths), and the DeepSpeed
    engine and pipeline methods work on 2 stages: batch size, boundary, data, state dicts, 16-bit save."""
    from slipstream.runtime.engine import DeepSpeedEngine
    from slipstream.runtime.pipe.engine import PipelineEngine

    import slipstream
    from slipstream.pipe import PipelineModule
    from slipstream.zero.build import STAGES

    module = PipelineModule(pm.specs(), num_stages=2, loss_fn=pm.loss_fn, seed_layers=True)
    engine, *_ = slipstream.initialize(model=module, config=config)
    assert isinstance(engine, DeepSpeedEngine) and type(engine) is PipelineEngine
    assert isinstance(engine.optimizer, STAGES[1]), type(engine.optimizer)  # type: ignore[attr-defined]
    missing = [name for name in PIPELINE_METHODS if not callable(getattr(engine, name, None))]
    assert not missing, missing
    assert engine.get_pipeline_parallel_rank() == rank and engine.zero_optimization_stage() == 1  # type: ignore[attr-defined]
    assert (engine.get_data_parallel_rank(), engine.get_data_parallel_world_size()) == (0, 1)  # type: ignore[attr-defined]
    assert engine.mpu is engine.grid and engine.get_additional_losses() is None  # type: ignore[attr-defined]
    engine.reset_activation_shape()  # type: ignore[attr-defined]
    engine.log_for_device("surface")  # type: ignore[attr-defined]
    engine.tput_log("surface")  # type: ignore[attr-defined]
    engine.set_has_attention_mask(True)  # type: ignore[attr-defined]
    assert engine.has_attention_mask is True  # type: ignore[attr-defined]
    try:
        engine.set_has_attention_mask("yes")  # type: ignore[attr-defined]
        raise AssertionError("set_has_attention_mask('yes') must raise")
    except TypeError as exc:
        assert "'yes'" in str(exc), exc
    recorder = engine.lr_scheduler = _BoundaryAtStep(engine)  # type: ignore[attr-defined]
    engine.set_train_batch_size(6)  # type: ignore[attr-defined] - 2 micro-batches of 3
    assert (engine.gradient_accumulation_steps(), engine.micro_batches) == (2, 2)  # type: ignore[attr-defined]
    batches = iter([pm.micro_batch(0, 0, m) for m in range(2)])  # exactly 2: a third read would stop
    loss = engine.train_batch(batches)  # type: ignore[attr-defined]
    loader = [pm.micro_batch(1, 0, m) for m in range(2)]
    engine.set_dataloader(loader)  # type: ignore[attr-defined]
    assert engine.training_dataloader is loader  # type: ignore[attr-defined]
    engine.train_batch()  # type: ignore[attr-defined]
    engine.set_dataiterator(iter([pm.micro_batch(2, 0, m) for m in range(2)]))  # type: ignore[attr-defined]
    assert engine.training_dataloader is None  # type: ignore[attr-defined] - the iterator replaces the loader
    last = engine.train_batch()  # type: ignore[attr-defined]
    sampler = engine.deepspeed_io(pm.dataset()).sampler  # type: ignore[attr-defined]
    assert (sampler.num_replicas, sampler.rank) == (1, 0), (sampler.num_replicas, sampler.rank)  # one replica
    state = engine.module_state_dict()  # type: ignore[attr-defined]
    engine.load_module_state_dict({"module": state})  # type: ignore[attr-defined]
    saved = engine.save_16bit_model(path)  # type: ignore[attr-defined]
    out = {
        "loss": float(loss),
        "last": (float(last), engine.last_loss),  # type: ignore[attr-defined]
        "boundary": [*recorder.seen, engine.is_gradient_accumulation_boundary()],  # type: ignore[attr-defined]
        "counters": (engine.global_steps, engine.global_samples, engine.micro_steps),  # type: ignore[attr-defined]
        "state": sorted(state),
        "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},  # type: ignore[attr-defined]
        "saved": saved,
    }
    engine.destroy()  # type: ignore[attr-defined]
    return out


def check_surface(results: list[dict], path: str) -> None:
    """Both ranks: the counters and boundaries of 3 batches of 2 micro-batches, the parameters against one
    process trained on the same 3 batches; rank 0's 16-bit file holds both stages' parameters."""
    whole = torch.load(f"{path}/pytorch_model.bin")
    ref = pm.reference_on("plain", [[pm.micro_batch(step, 0, m) for m in range(2)] for step in range(3)])
    names = set()
    for result in results:
        assert abs(result["loss"] - ref["losses"][0]) <= 2e-5 * abs(ref["losses"][0]), (result["loss"], ref["losses"])
        for name, value in result["params"].items():
            torch.testing.assert_close(value, ref["params"][name], rtol=2e-5, atol=1e-6)
        assert result["saved"] is True and result["boundary"] == [True, True, True, False], result["boundary"]
        assert result["counters"] == (3, 18, 6), result["counters"]  # 3 batches of 2 micro-batches x 3 samples
        assert result["loss"] == results[1]["loss"] and result["last"] == results[1]["last"], (result, results[1])
        assert abs(result["last"][0] - result["last"][1]) <= 1e-6 * abs(result["last"][1]), result["last"]
        assert result["state"] == sorted(result["params"]), result["state"]
        for name, value in result["params"].items():
            torch.testing.assert_close(whole[name], value, rtol=0, atol=0)
        names |= set(result["params"])
    assert set(whole) == names, sorted(set(whole) ^ names)
