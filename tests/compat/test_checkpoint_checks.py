"""A checkpoint that does not fit the engine is refused before anything is copied.

One process, world of one: a bigger layer at stages 0, 2 and 3, a transposed shape in the manifest, wrong
scalar types, an integer buffer fed floats, and names on one side only (allowed with load_module_strict=False,
which never lets a shape mismatch through)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import slipstream
from slipstream.checkpoint.errors import CheckpointError


def _engine(model: nn.Module, stage: int) -> Any:
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine, *_ = slipstream.initialize(model=model, config=config)
    return engine


def _saved(root: Path, model: nn.Module, stage: int) -> Path:
    engine = _engine(model, stage)
    engine.backward(engine(torch.randn(2, 64)).float().sum())
    engine.step()
    engine.save_checkpoint(root, tag="t")
    engine.destroy()
    return root


def _values(engine: Any) -> dict[str, torch.Tensor]:
    if engine.zero_model is not None:
        return engine.zero_model.full_state(only_rank0=False)
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _edit_manifest(root: Path, edit: Any) -> None:
    path = root / "t" / "manifest.json"
    document = json.loads(path.read_text())
    edit(document)
    path.write_text(json.dumps(document))


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_bigger_layer_is_refused_at_every_stage(tmp_path: Path, stage: int) -> None:
    root = _saved(tmp_path, nn.Sequential(nn.Linear(64, 16)), stage)
    engine = _engine(nn.Sequential(nn.Linear(64, 8)), stage)
    before = _values(engine)
    for strict in (True, False):  # load_module_strict=False never lets a shape mismatch through
        with pytest.raises(CheckpointError, match=r"module/0\.weight: the checkpoint has shape \[16, 64\] fp32, "
                                                  r"the model's parameter '0\.weight' has shape \[8, 64\]") as info:
            engine.load_checkpoint(root, load_module_strict=strict)
        assert "optimizer/0.bias/exp_avg" in str(info.value) and "nothing was loaded" in str(info.value)
    after = _values(engine)
    assert all(torch.equal(before[name], after[name]) for name in before)
    engine.destroy()


def test_a_transposed_shape_in_the_manifest_is_refused(tmp_path: Path) -> None:
    root = _saved(tmp_path, nn.Sequential(nn.Linear(64, 8)), 3)

    def transpose(document: dict) -> None:
        for record in document["tensors"].values():
            if record["shape"] == [8, 64]:
                record["shape"] = [64, 8]

    _edit_manifest(root, transpose)
    engine = _engine(nn.Sequential(nn.Linear(64, 8)), 3)
    with pytest.raises(CheckpointError, match=r"module/0\.weight: the checkpoint has shape \[64, 8\] fp32, the "
                                              r"model's parameter '0\.weight' has shape \[8, 64\]"):
        engine.load_checkpoint(root)
    assert engine.global_steps == 0
    engine.destroy()


@pytest.mark.parametrize("where,value,message", [
    (("engine", "global_steps"), "abc", r"scalars\.engine\.global_steps is 'abc' \(str\); expected a non-negative"),
    (("engine", "micro_steps"), 1.5, r"scalars\.engine\.micro_steps is 1\.5 \(float\)"),
    (("optimizer", "state_scalars"), [{"step": "2"}], r"scalars\.optimizer\.state_scalars\[0\]\.step is '2'"),
    (("lr_scheduler",), "warm", r"scalars\.lr_scheduler is 'warm' \(str\); expected an object"),
])
def test_a_scalar_of_the_wrong_type_is_refused(tmp_path: Path, where: tuple[str, ...], value: Any,
                                               message: str) -> None:
    root = _saved(tmp_path, nn.Sequential(nn.Linear(64, 8)), 2)

    def corrupt(document: dict) -> None:
        target = document["scalars"]
        for key in where[:-1]:
            target = target[key]
        target[where[-1]] = value

    _edit_manifest(root, corrupt)
    engine = _engine(nn.Sequential(nn.Linear(64, 8)), 2)
    with pytest.raises(CheckpointError, match=message):
        engine.load_checkpoint(root)
    if where[0] == "engine":  # the weights alone can still be taken
        path, _ = engine.load_checkpoint(root, load_module_only=True)
        assert path is not None and engine.global_steps == 0
    engine.destroy()


class _Counted(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 8)
        self.register_buffer("seen", torch.arange(3).to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_an_integer_buffer_is_not_filled_with_floats(tmp_path: Path) -> None:
    root = _saved(tmp_path, _Counted(torch.float32), 0)
    engine = _engine(_Counted(torch.int64), 0)
    with pytest.raises(CheckpointError, match=r"buffer/seen: the checkpoint has shape \[3\] fp32, the model's "
                                              r"buffer 'seen' has shape \[3\] int64"):
        engine.load_checkpoint(root)
    engine.destroy()


class _Wider(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 8)
        self.extra = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.extra(self.fc(x))


def test_names_on_one_side_need_load_module_strict_false(tmp_path: Path) -> None:
    root = _saved(tmp_path, _Counted(torch.float32), 2)
    engine = _engine(_Wider(), 2)
    with pytest.raises(CheckpointError, match=r"missing \['extra\.bias', 'extra\.weight'\].*load_module_strict=False"):
        engine.load_checkpoint(root)
    with pytest.warns(UserWarning, match="skipped parameters"):
        path, _ = engine.load_checkpoint(root, load_module_strict=False)
    assert path is not None
    with slipstream.checkpoint.CheckpointReader(root / "t") as reader:
        assert torch.equal(engine.module.fc.weight.detach(), reader.read("module/fc.weight"))
    engine.destroy()
