"""Random-LTD: the kept-token schedule against hand-computed counts, the wrapper against the full layer applied
to the gathered tokens (decoder and encoder masks, both hidden-state orders, the gradient), the config rules,
and training through the engine: the wrapped layers see the scheduled count at each step, the layers not named
by random_ltd_layer_id see every token, and a checkpoint keeps the scheduler's state."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import slipstream
from slipstream.config import ConfigError, resolve
from slipstream.config.random_ltd_plan import RandomLTDPlan
from slipstream.data.random_ltd import RandomLTDScheduler
from slipstream.data.random_ltd_layer import (
    RandomLayerTokenDrop,
    attach_random_ltd,
    convert_to_random_ltd,
    remove_random_ltd_state_dict,
    save_without_random_ltd,
)

BASE = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.05}}}


def _schedule(low: int, high: int) -> dict[str, object]:
    """A fixed_linear schedule from `low` to `high` kept tokens over 5 steps, in multiples of 4."""
    return {"min_value": low, "max_value": high, "schedule_config": {"require_steps": 5, "seq_per_step": 4}}


def _section(**changes: object) -> dict[str, object]:
    section: dict[str, object] = {
        "enabled": True,
        "model_name": "tiny",
        "model_type": "decoder",
        "hidden_state_order": "batch_seq_dim",
        "random_ltd_layer_num": 2,
        "random_ltd_layer_id": [1, 2],
        "model_mask_name": "attention_mask",
        "total_layer_num": 3,
        "random_ltd_schedule": {**_schedule(5, 17), "schedule_type": "fixed_linear"},
    }
    section.update(changes)
    return {"data_efficiency": {"enabled": True, "data_routing": {"enabled": True, "random_ltd": section}}}


def _plan(**changes: object) -> RandomLTDPlan:
    plan = resolve({**BASE, **_section(**changes)}, world_size=1).schedules.random_ltd
    assert plan is not None
    return plan


# By hand, min 5, max 17, require_steps 5, seq_per_step 4: m = floor(g / 5 * 12 + 5), kept = m - m % 4, at most 17:
# g=0: 5 -> 4; g=1: 7.4 -> 4; g=2: 9.8 -> 8; g=3: 12.2 -> 12; g=4: 14.6 -> 12; g=5: 17 -> 16; g=6: 19.4 -> 16.
KEPT = [4, 4, 8, 12, 12, 16, 16]


def test_the_schedule_gives_the_hand_computed_counts_and_tokens() -> None:
    scheduler = RandomLTDScheduler(_plan(), train_batch_size=2)
    assert [scheduler.get_value(g) for g in range(7)] == KEPT
    assert scheduler.get_current_seq() == 5  # min_value until the first update
    assert [scheduler.update_seq(g) for g in range(4)] == KEPT[:4]
    scheduler.update_seq(3)  # the same step again: counted once
    # per step: global batch 2 x (kept x 2 dropping layers + 17 x 1 full layer)
    assert scheduler.state_dict()["consumed_layer_tokens"] == sum(2 * (k * 2 + 17) for k in KEPT[:4])
    full = RandomLTDScheduler(_plan(random_ltd_schedule=_schedule(8, 8)), train_batch_size=1)
    full.set_current_seq(8)
    assert full.update_seq(0) == 8 and full.get_value(0) == 8


def test_config_rules() -> None:
    plan = resolve({**BASE, **_section()}, world_size=1)
    assert plan.schedules.random_ltd is not None and plan.schedules.random_ltd.random_ltd_layer_id == (1, 2)
    assert [k for k in plan.unimplemented if "random_ltd" in k] == [
        "data_efficiency.data_routing.random_ltd.model_name"
    ]
    lr = resolve({**BASE, **_section(layer_token_lr_schedule={"enabled": True})}, world_size=1)
    assert "data_efficiency.data_routing.random_ltd.layer_token_lr_schedule" in lr.unimplemented
    with pytest.raises(ConfigError, match=r"random_ltd_layer_num is 3 but random_ltd_layer_id lists 2"):
        resolve({**BASE, **_section(random_ltd_layer_num=3)}, world_size=1)
    with pytest.raises(ConfigError, match=r"random_ltd.total_layer_num is not set"):
        resolve({**BASE, **_section(total_layer_num=None)}, world_size=1)
    with pytest.raises(ConfigError, match=r"min_value 3 is below seq_per_step 4"):
        resolve({**BASE, **_section(random_ltd_schedule=_schedule(3, 8))}, world_size=1)
    assert resolve(BASE, world_size=1).schedules.random_ltd is None


class Attention(nn.Module):
    """One-head self-attention with a residual; records the sequence length it ran on. Returns a tuple when
    `as_tuple` (the layer's first output is the hidden states)."""

    def __init__(self, width: int, *, batch_first: bool = True, as_tuple: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.batch_first, self.as_tuple = batch_first, as_tuple
        self.lengths: list[int] = []

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> object:
        x = x if self.batch_first else x.transpose(0, 1)
        self.lengths.append(x.shape[1])
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(x.shape[-1])
        if attention_mask is not None:
            scores = scores.masked_fill(~attention_mask[:, 0], float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v + x
        out = out if self.batch_first else out.transpose(0, 1)
        return (out, "extra") if self.as_tuple else out


def _dropping(layer: nn.Module, plan: RandomLTDPlan) -> tuple[RandomLayerTokenDrop, RandomLTDScheduler]:
    scheduler = RandomLTDScheduler(plan, train_batch_size=3)
    wrapper = RandomLayerTokenDrop(layer)
    wrapper.init_config(plan, scheduler, 0)
    scheduler.update_seq(2)  # 8 kept
    return wrapper, scheduler


def _causal(batch: int, seq: int) -> torch.Tensor:
    return torch.ones(seq, seq, dtype=torch.bool).tril().expand(batch, 1, seq, seq)


@pytest.mark.parametrize("order", ["batch_seq_dim", "seq_batch_dim"])
@pytest.mark.parametrize("as_tuple", [False, True])
def test_the_kept_tokens_go_through_the_layer_and_the_others_pass(order: str, as_tuple: bool) -> None:
    batch_first = order == "batch_seq_dim"
    layer = Attention(6, batch_first=batch_first, as_tuple=as_tuple)
    wrapper, scheduler = _dropping(layer, _plan(hidden_state_order=order))
    hidden = torch.randn(3, 12, 6, requires_grad=True)  # [batch, seq, width]
    given = hidden if batch_first else hidden.transpose(0, 1)
    output = wrapper(given, attention_mask=_causal(3, 12))
    if as_tuple:
        assert isinstance(output, tuple) and output[1] == "extra"
        output = output[0]
    assert isinstance(output, torch.Tensor)
    output = output if batch_first else output.transpose(0, 1)
    assert scheduler.draw is not None
    rows = scheduler.draw.indices[0]
    assert rows.shape == (3, 8) and layer.lengths == [8]
    for b in range(3):
        kept = rows[b]
        assert kept.tolist() == sorted(set(kept.tolist()))  # distinct and in order
        alone = Attention(6, as_tuple=False)
        alone.load_state_dict(layer.state_dict())
        expected = alone(hidden[b : b + 1, kept], attention_mask=_causal(1, 8))  # the causal mask of 8 tokens
        torch.testing.assert_close(output[b, kept], expected[0])
        dropped = [i for i in range(12) if i not in kept.tolist()]
        torch.testing.assert_close(output[b, dropped], hidden[b, dropped])
    output.sum().backward()  # a dropped token's gradient is the output's: 1 everywhere
    assert hidden.grad is not None
    dropped_mask = torch.ones(3, 12, dtype=torch.bool)
    dropped_mask[torch.arange(3)[:, None], rows] = False
    torch.testing.assert_close(hidden.grad[dropped_mask], torch.ones(int(dropped_mask.sum()), 6))


def test_an_encoder_gets_the_kept_rows_and_columns_of_its_mask() -> None:
    layer = Attention(4)
    wrapper, scheduler = _dropping(layer, _plan(model_type="encoder"))
    hidden = torch.randn(3, 12, 4)
    padding = torch.ones(3, 1, 12, 12, dtype=torch.bool)
    padding[0, :, :, 9:] = False  # sample 0 has 3 padding tokens
    padding[2, :, :, 5:] = False
    output = wrapper(hidden, attention_mask=padding)
    assert scheduler.draw is not None
    for b in range(3):
        kept = scheduler.draw.indices[0, b]
        mask = padding[b : b + 1][:, :, kept][:, :, :, kept]
        alone = Attention(4)
        alone.load_state_dict(layer.state_dict())
        torch.testing.assert_close(output[b, kept], alone(hidden[b : b + 1, kept], attention_mask=mask)[0])
    with pytest.raises(ValueError, match="model_type 'encoder' needs the attention mask"):
        wrapper(hidden)


def test_eval_a_full_count_and_unnamed_wrappers_run_the_whole_sequence() -> None:
    layer = Attention(4)
    wrapper, scheduler = _dropping(layer, _plan())
    hidden = torch.randn(2, 12, 4)
    wrapper.eval()
    torch.testing.assert_close(wrapper(hidden), layer(hidden))
    wrapper.train()
    scheduler.set_current_seq(12)
    torch.testing.assert_close(wrapper(hidden), layer(hidden))
    plain = RandomLayerTokenDrop(layer)  # never configured: not a dropping layer
    torch.testing.assert_close(plain(hidden), layer(hidden))
    assert layer.lengths == [12] * 6


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList(Attention(8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x)
        mask = _causal(x.shape[0], x.shape[1])
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask)
        return hidden.pow(2).mean()


def _engine(seed: int = 0) -> tuple[slipstream.DeepSpeedEngine, Stack]:
    torch.manual_seed(seed)
    model = Stack()
    engine, *_ = slipstream.initialize(model=model, config={**BASE, **_section()})
    convert_to_random_ltd(engine, Attention)
    return engine, model


def _train(engine: slipstream.DeepSpeedEngine, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = engine(torch.randn(2, 20, 4))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_training_through_the_engine_follows_the_schedule(tmp_path: Path) -> None:
    engine, model = _engine()
    assert [type(layer) for layer in model.layers] == [RandomLayerTokenDrop] * 3
    first = model.layers[0].random_ltd_layer.qkv.weight
    before = first.detach().clone()
    losses = _train(engine, 4)
    assert all(math.isfinite(loss) for loss in losses) and not torch.equal(before, first.detach())
    lengths = [layer.random_ltd_layer.lengths for layer in model.layers]
    assert lengths == [[20] * 4, KEPT[:4], KEPT[:4]]  # layer 0 is not among random_ltd_layer_id [1, 2]
    scheduler = engine.random_ltd_scheduler
    assert scheduler is not None and scheduler.get_state()["consumed_layer_tokens"] == sum(
        2 * (k * 2 + 17) for k in KEPT[:4]
    )
    engine.eval()
    engine(torch.randn(2, 20, 4))
    assert [layer.random_ltd_layer.lengths[-1] for layer in model.layers] == [20, 20, 20]
    engine.train()
    engine.save_checkpoint(str(tmp_path))
    resumed, resumed_model = _engine(seed=1)
    resumed.load_checkpoint(str(tmp_path))
    assert resumed.random_ltd_scheduler.state_dict() == scheduler.state_dict()
    torch.testing.assert_close(resumed_model.layers[0].random_ltd_layer.qkv.weight, first)
    _train(resumed, 1)
    assert resumed_model.layers[1].random_ltd_layer.lengths == [KEPT[4]]
    plain, *_ = slipstream.initialize(model=Stack(), config=BASE)  # names are saved without the wrapper's level
    plain.load_checkpoint(str(tmp_path))
    torch.testing.assert_close(plain.module.layers[1].qkv.weight, model.layers[1].random_ltd_layer.qkv.weight)


def test_the_ids_name_whole_components_of_the_module_names() -> None:
    gpt2 = nn.Module()
    gpt2.h = nn.ModuleList(RandomLayerTokenDrop(nn.Identity()) for _ in range(3))
    model = nn.Module()
    model.gpt2 = gpt2  # "gpt2.h.0" has the digit 2 in it, yet only "gpt2.h.2" is layer 2
    plan = _plan(random_ltd_layer_num=1, random_ltd_layer_id=[2])
    assert attach_random_ltd(model, plan, RandomLTDScheduler(plan, train_batch_size=1)) == 1
    assert [wrapper.random_ltd_layer_id for wrapper in gpt2.h] == [-1, -1, 0]


def test_state_dict_helpers_and_a_missing_layer() -> None:
    engine, model = _engine()
    keys = list(save_without_random_ltd(engine))
    assert "layers.1.qkv.weight" in keys and not any("random_ltd_layer" in key for key in keys)
    assert list(remove_random_ltd_state_dict({"a.random_ltd_layer.b": torch.zeros(1)})) == ["a.b"]
    torch.manual_seed(0)
    other, *_ = slipstream.initialize(model=Stack(), config={**BASE, **_section(random_ltd_layer_id=[1, 7])})
    with pytest.raises(ValueError, match=r"only 1 wrapped layers match random_ltd_layer_id \[1, 7\]"):
        convert_to_random_ltd(other, Attention)
    plain, *_ = slipstream.initialize(model=Stack(), config=BASE)
    with pytest.raises(RuntimeError, match="random-LTD is off"):
        convert_to_random_ltd(plain, Attention)
