"""The hybrid engine's LoRA fuse and `pin_parameters`, on a tiny Hugging Face Llama whose q and v projections are
DeepSpeed-Chat-shaped LoRA layers, 2 gloo ranks in one spawn.

ZeRO-3 with `hybrid_engine.enabled`: `generate` runs with the LoRA deltas fused (no LoRA path is computed) and
gives the tokens of the unfused model computing base + LoRA; the shards are bit-equal afterwards (the fuse
worked on gathered copies) and training goes on bit-equal to a run without the generation. `pin_parameters:
false` leaves the gathers to the hooks (more all-gathers, same tokens). `engine.fuse_lora_weight()` writes the
fused weights into the shards and `unfuse_lora_weight()` takes them out within fp32 rounding
(`eps * (|w| + |delta|)` per element). At ZeRO-1 the hybrid generate fuses and unfuses the live weights
within that bound. PEFT's LoraLayer (when peft is installed) is merged for the ZeRO-3 hybrid generate and
gives the unmerged model's tokens. TRL's `unwrap_model_for_generation` (when trl is installed) drives the ZeRO-3
engine with one all-gather per unit. (With `inference_tp_size` above 1: test_hybrid_tp_lora.py.)
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist.inference.test_inference import VOCAB, _llama, _train
from tests.harness import run_distributed


class LoraLinear(nn.Module):
    """DeepSpeed-Chat's LinearLayer_LoRA shape: base weight plus `x @ right @ left * scaling` unless fused."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.weight, self.bias = base.weight, base.bias
        self.lora_right_weight = nn.Parameter(torch.randn(base.in_features, rank) * 0.2)
        self.lora_left_weight = nn.Parameter(torch.randn(rank, base.out_features) * 0.2)
        self.lora_scaling = 0.5
        self.fuse_lora = False
        self.lora_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.fuse_lora:
            return out
        self.lora_calls += 1
        return out + (x @ self.lora_right_weight @ self.lora_left_weight) * self.lora_scaling


def _lora_llama(seed: int) -> Any:
    model = _llama(seed)
    torch.manual_seed(seed + 10)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoraLinear(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoraLinear(layer.self_attn.v_proj)
    return model


def _engine(stage: int, **hybrid: object) -> Any:
    import slipstream

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "hybrid_engine": {"enabled": True, **hybrid},
    }
    engine, *_ = slipstream.initialize(model=_lora_llama(0), config=config)
    return engine


def _lora_calls(engine: Any) -> int:
    return sum(m.lora_calls for m in engine.module.modules() if isinstance(m, LoraLinear))


def _generate(engine: Any, ids: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    from slipstream.comm import count_collectives

    calls = _lora_calls(engine)
    engine.eval()
    with count_collectives() as counter:
        tokens = engine.generate(ids, max_new_tokens=5, do_sample=False)
    engine.train()
    return tokens, counter.calls["all_gather"], _lora_calls(engine) - calls


def _full(engine: Any) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in engine.iter_full_weights()}


def _within_rounding(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor], engine: Any) -> None:
    """Every LoRA base weight within eps * (|w| + |delta|) of `before`, everything else bit-equal."""
    deltas = {
        f"{n}.weight": m.lora_scaling * (before[f"{n}.lora_left_weight"].t() @ before[f"{n}.lora_right_weight"].t())
        for n, m in engine.module.named_modules()
        if isinstance(m, LoraLinear)
    }
    for name, value in after.items():
        if name not in deltas:
            assert torch.equal(value, before[name]), f"{name} changed"
            continue
        bound = torch.finfo(value.dtype).eps * (before[name].abs() + deltas[name].abs())
        assert ((value - before[name]).abs() <= bound).all(), f"{name}: off by more than fp32 rounding"


def _check_zero3(rank: int, ids: torch.Tensor) -> None:
    straight, engine = _engine(3), _engine(3)
    _train(straight, rank, range(4))
    _train(engine, rank, range(2))
    before = _full(engine)
    plain = _lora_llama(0)
    plain.load_state_dict(before, strict=False)
    expected = plain.generate(ids, max_new_tokens=5, do_sample=False)
    tokens, gathers, lora_calls = _generate(engine, ids)
    assert torch.equal(tokens, expected), (tokens, expected)
    assert lora_calls == 0, f"the LoRA path ran {lora_calls} times in a fused generate"
    after = _full(engine)
    assert all(torch.equal(after[n], before[n]) for n in before), "a shard changed across generate"
    _train(engine, rank, range(2, 4))
    theirs = _full(straight)
    assert all(torch.equal(v, theirs[n]) for n, v in _full(engine).items()), "training differs after generate"
    unpinned = _engine(3, pin_parameters=False)
    _train(unpinned, rank, range(2))
    tokens, per_layer, lora_calls = _generate(unpinned, ids)
    assert torch.equal(tokens, expected) and lora_calls > 0 and per_layer > 3 * gathers, (per_layer, gathers)


def _check_methods(rank: int, ids: torch.Tensor) -> None:
    for stage in (3, 1):
        engine = _engine(stage)
        _train(engine, rank, range(1))
        before = _full(engine)
        logits = engine(ids).logits.detach()
        engine.fuse_lora_weight()
        calls = _lora_calls(engine)
        torch.testing.assert_close(engine(ids).logits.detach(), logits, rtol=0, atol=2e-5)
        assert _lora_calls(engine) == calls, f"stage {stage}: the LoRA path ran with the deltas fused"
        fused = _full(engine)
        name = "model.layers.0.self_attn.q_proj.weight"
        assert not torch.equal(fused[name], before[name]), f"stage {stage}: fuse_lora_weight changed nothing"
        engine.unfuse_lora_weight()
        _within_rounding(_full(engine), before, engine)
        _, _, lora_calls = _generate(engine, ids)
        assert lora_calls == 0, f"stage {stage}: the hybrid generate did not fuse"
        _within_rounding(_full(engine), before, engine)


def _peft_llama() -> Any:
    from peft import LoraConfig, get_peft_model

    model = _llama(0)
    torch.manual_seed(5)  # init_lora_weights=False: B is random, not zero, so the delta is not nothing
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return get_peft_model(model, config)


def _check_peft(ids: torch.Tensor) -> None:
    """PEFT's LoraLayer at ZeRO-3: merged for the hybrid generate (its lora_A never runs), same tokens as the
    unmerged model, shards bit-equal after."""
    import slipstream

    expected = _peft_llama().generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "hybrid_engine": {"enabled": True},
    }
    engine, *_ = slipstream.initialize(model=_peft_llama(), config=config)
    calls = []
    for name, module in engine.module.named_modules():
        if name.endswith("lora_A.default"):
            module.register_forward_hook(lambda *_: calls.append(1))
    before = _full(engine)
    engine.eval()
    tokens = engine.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(tokens, expected) and not calls, (tokens, expected, len(calls))
    after = _full(engine)
    assert all(torch.equal(after[n], before[n]) for n in before), "a shard changed across generate"


def _check_trl(ids: torch.Tensor) -> None:
    """TRL's own `unwrap_model_for_generation` (through the `deepspeed` shim) on a ZeRO-3 engine: one all-gather
    per unit for the whole generate, the tokens of the plain model holding the engine's weights."""
    import types

    from trl.models.utils import unwrap_model_for_generation

    from slipstream.comm import count_collectives

    engine = _engine(3)
    plain = _lora_llama(0)
    plain.load_state_dict(_full(engine), strict=False)
    state = types.SimpleNamespace(deepspeed_plugin=types.SimpleNamespace(zero_stage=3))
    accelerator = types.SimpleNamespace(state=state, unwrap_model=lambda model: model.module)
    with count_collectives() as counter, unwrap_model_for_generation(engine, accelerator) as model:
        tokens = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(tokens, plain.generate(ids, max_new_tokens=5, do_sample=False)), tokens
    units = [u for u in engine.zero_model.units if u.params]
    assert counter.calls["all_gather"] == len(units), (counter.calls, len(units))


def rank_fn(rank: int, world: int) -> None:

    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    _check_zero3(rank, ids)
    _check_methods(rank, ids)
    if importlib.util.find_spec("peft") is not None:
        _check_peft(ids)
    if importlib.util.find_spec("trl") is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "compat_hf" / "shim"))  # `import deepspeed`
        _check_trl(ids)


def test_hybrid_engine_fuses_lora_for_generate(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    run_distributed(rank_fn, world_size=2, tmp_dir=tmp_path, timeout_s=180)
