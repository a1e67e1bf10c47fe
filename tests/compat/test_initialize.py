"""`initialize()` as DeepSpeed users call it: signature, config sources and precedence, single process."""

from __future__ import annotations

import argparse
import base64
import inspect
import json
from pathlib import Path

import pytest
import torch

import slipstream
from tests.harness.models import TinyMLP

CONFIG = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}



def test_signature_matches_deepspeed() -> None:
    names = list(inspect.signature(slipstream.initialize).parameters)
    assert names[:13] == ["args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler",
                          "distributed_port", "mpu", "dist_init_required", "collate_fn", "config", "mesh_param",
                          "config_params"]


def _check(engine: slipstream.SlipstreamEngine) -> None:
    assert engine.world_size == 1 and engine.global_rank == 0
    assert engine.train_batch_size() == 4 and engine.gradient_accumulation_steps() == 1
    x, y = TinyMLP().make_batch(seed=0, batch_size=4)
    engine.backward(TinyMLP.loss(engine(x), y))
    engine.step()
    assert engine.global_steps == 1 and engine.get_global_grad_norm() is not None
    assert engine.optimizer_name() == "adamw"  # DeepSpeed's "Adam" means AdamW unless adam_w_mode is false
    engine.destroy()


def test_dict_path_base64_and_args_sources(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CONFIG))
    encoded = base64.urlsafe_b64encode(json.dumps(CONFIG).encode()).decode()
    parser = slipstream.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    for kwargs in ({"config": CONFIG}, {"config": str(path)}, {"config": encoded}, {"config_params": CONFIG},
                   {"args": args}):
        engine, optimizer, loader, scheduler = slipstream.initialize(model=TinyMLP(), **kwargs)
        # stage 0 in fp32: DeepSpeed returns the basic optimizer itself (FusedAdam for "Adam"), not a wrapper
        assert optimizer is engine.basic_optimizer and loader is None and scheduler is None
        _check(engine)


def test_config_given_twice_or_never(tmp_path: Path) -> None:
    args = argparse.Namespace(deepspeed_config=str(tmp_path / "x.json"))
    with pytest.raises(ValueError, match="config was given twice"):
        slipstream.initialize(args=args, model=TinyMLP(), config=CONFIG)
    with pytest.raises(ValueError, match="no config given"):
        slipstream.initialize(model=TinyMLP())
    with pytest.raises(ValueError, match="needs model="):
        slipstream.initialize(config=CONFIG)


def test_config_errors_surface_through_initialize() -> None:
    bad = {**CONFIG, "gradient_clipp1ng": 1.0, "zero_optimization": {"stage": 1, "reduce_bucket_sz": 5}}
    with pytest.raises(slipstream.ConfigError) as info:
        slipstream.initialize(model=TinyMLP(), config=bad)
    text = str(info.value)
    assert "gradient_clipp1ng" in text and "gradient_clipping" in text
    assert "zero_optimization.reduce_bucket_sz" in text and "reduce_bucket_size" in text


def test_training_data_gives_a_sharded_loader() -> None:
    data = torch.utils.data.TensorDataset(torch.randn(10, 13), torch.randn(10, 5))
    engine, _, loader, _ = slipstream.initialize(model=TinyMLP(), config={**CONFIG, "dataloader_drop_last": True},
                                                 training_data=data)
    batches = list(loader)
    assert len(batches) == 2 and all(b[0].shape == (4, 13) for b in batches)
    engine.destroy()


def test_client_optimizer_and_scheduler_callables() -> None:
    config = {"train_batch_size": 4}
    engine, optimizer, _, scheduler = slipstream.initialize(
        model=TinyMLP(), config=config, optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    x, y = TinyMLP().make_batch(seed=1, batch_size=4)
    engine.backward(TinyMLP.loss(engine(x), y))
    engine.step()
    assert engine.get_lr() == [0.05]
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
    engine.destroy()
