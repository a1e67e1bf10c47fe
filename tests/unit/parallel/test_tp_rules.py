"""Tensor-parallel split rules (no process group needed): which layer is split how, head-aware refusals,
partition_config rules, unrecognised layers reported once; the config keys that feed them."""

from __future__ import annotations

import warnings

import pytest
from torch import nn

from slipstream.config import ConfigError, resolve
from slipstream.parallel import TensorParallelError, plan_tensor_parallel, whole_head_widths
from tests.dist.parallel.models import TinyGPT


def test_default_rules_split_a_llama_block() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decisions = plan_tensor_parallel(TinyGPT(layers=1), 2)
    assert decisions == {
        "embed_tokens": "vocab",
        "layers.0.self_attn.q_proj": "column",
        "layers.0.self_attn.k_proj": "column",
        "layers.0.self_attn.v_proj": "column",
        "layers.0.self_attn.o_proj": "row",
        "layers.0.gate_proj": "column",
        "layers.0.up_proj": "column",
        "layers.0.down_proj": "row",
        "lm_head": "gathered",
    }  # norms and the position embedding stay replicated
    reported = [str(w.message) for w in caught if "left these layers replicated" in str(w.message)]
    assert len(reported) == 1 and "layers.0.adapter" in reported[0]


def test_head_counts_the_tp_size_does_not_divide_are_split_by_whole_kv_groups() -> None:
    # 4 query / 4 KV heads of size 8 on 3 ranks: 2 + 1 + 1 heads (16, 8, 8 features); o_proj's inputs alike
    model = TinyGPT(layers=1, heads=4, kv_heads=4)
    widths = whole_head_widths(model, plan_tensor_parallel(model, 3), 3)
    attn = "layers.0.self_attn"
    assert widths == {f"{attn}.{p}": (16, 8, 8) for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
    # grouped: 8 query / 4 KV heads: each rank takes whole KV groups with their 2 query heads each
    model = TinyGPT(layers=1, heads=8, kv_heads=4)
    widths = whole_head_widths(model, plan_tensor_parallel(model, 3), 3)
    assert widths[f"{attn}.q_proj"] == widths[f"{attn}.o_proj"] == (32, 16, 16)
    assert widths[f"{attn}.k_proj"] == widths[f"{attn}.v_proj"] == (16, 8, 8)
    # heads the TP size divides keep torch.chunk's (equal, whole-head) pieces: nothing listed
    model = TinyGPT(layers=1, heads=6, kv_heads=3)
    assert whole_head_widths(model, plan_tensor_parallel(model, 3), 3) == {}


def test_heads_that_cannot_be_split_whole_are_refused_with_both_numbers() -> None:
    # 2 KV heads cannot give each of 3 (or 4) ranks a whole one
    with pytest.raises(TensorParallelError, match=r"'layers.0.self_attn.k_proj' has 2 KV heads .* TP size 3"):
        plan_tensor_parallel(TinyGPT(layers=1), 3)
    with pytest.raises(TensorParallelError, match=r"k_proj' has 2 KV heads .* TP size 4"):
        plan_tensor_parallel(TinyGPT(layers=1), 4)
    # 6 query heads are not whole groups of 4 KV heads
    with pytest.raises(TensorParallelError, match=r"'layers.0.self_attn.q_proj' has 6 attention heads, not a multiple"):
        plan_tensor_parallel(TinyGPT(layers=1, heads=6, kv_heads=4), 3)


def test_partition_config_rules_come_first_and_defaults_can_be_dropped() -> None:
    rules = ((r".*\.adapter\.weight$", "row"), (r".*\.up_proj\.weight$", "skip"))
    decisions = plan_tensor_parallel(TinyGPT(layers=1), 2, rules=rules)
    assert decisions["layers.0.adapter"] == "row" and "layers.0.up_proj" not in decisions
    only = plan_tensor_parallel(TinyGPT(layers=1), 2, rules=((r"q_proj", "column"),), use_default_specs=False)
    assert only == {"layers.0.self_attn.q_proj": "column"}


def test_tied_embedding_and_head_stay_replicated() -> None:
    model = TinyGPT(layers=1)
    model.lm_head.weight = model.embed_tokens.weight
    decisions = plan_tensor_parallel(model, 2)
    assert "lm_head" not in decisions and "embed_tokens" not in decisions


def test_config_keys_become_the_parallel_plan() -> None:
    config = {
        "train_batch_size": 8,
        "sequence_parallel_size": 2,
        "tensor_parallel": {
            "autotp_size": 2,
            "partition_config": {
                "use_default_specs": False,
                "layer_specs": [
                    {"patterns": [r".*\.o_proj\.weight$"], "partition_type": "row"},
                    {"patterns": ["lm_head"], "partition_type": "column", "gather_output": True},
                ],
            },
        },
    }
    plan = resolve(config, world_size=8)
    assert (plan.parallel.tp_size, plan.parallel.sp_size) == (2, 2)
    assert plan.parallel.tp_rules == ((r".*\.o_proj\.weight$", "row"), ("lm_head", "gathered"), (".*", "skip"))
    assert plan.batch.micro_batch_size == 2  # 8 over world / sp = 4: the TP ranks count (DeepSpeed's config)
    with pytest.raises(ConfigError, match=r"autotp_size \(2\) x sequence_parallel_size \(2\) = 4 does not divide"):
        resolve(config, world_size=6)
    bad = {
        "train_batch_size": 2,
        "tensor_parallel": {
            "autotp_size": 2,
            "partition_config": {"layer_specs": [{"patterns": ["x"], "partition_type": "diagonal", "shape": [2, -1]}]},
        },
    }
    with pytest.raises(ConfigError, match=r"shape not implemented.*\n.*expected 'column', 'row' or 'skip'"):
        resolve(bad, world_size=2)


def test_unrecognised_layer_is_left_alone() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.warns(UserWarning, match="left these layers replicated.*: 0"):
        assert plan_tensor_parallel(model, 2) == {}
