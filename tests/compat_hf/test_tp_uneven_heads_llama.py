"""A Hugging Face `LlamaForCausalLM` with 4 attention heads at TP=3: its heads are split 2 + 1 + 1 by whole
heads (the TP size does not divide them) and it trains like the same model in one process (losses to 1e-5,
every global parameter to 2e-5 after 3 SGD steps, clipped by the default gradient_clipping of 1.0: the global
norm over uneven shards must be right)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.compat_hf import hf_common as H
from tests.harness import run_distributed

STEPS, LR, VOCAB = 3, 0.5, 96
# SGD, not Adam: Adam's update lr * g / (|g| + eps) on elements whose gradient is near eps turns the last bits of
# the gradient into a large fraction of lr (tests/dist/parallel/test_tp_sp_training.py, EPS); with SGD
# every element must match, which checks the gradients themselves


def _model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(step))


def train(rank: int, world: int) -> dict[str, Any]:
    import slipstream

    config = {
        "train_micro_batch_size_per_gpu": 2,  # train_batch_size counts the TP ranks (DeepSpeed's rule): 6
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "tensor_parallel": {"autotp_size": 3},
        "zero_optimization": {"stage": 1},
    }
    engine, *_ = slipstream.initialize(model=_model(), config=config)
    attn = engine.module.model.layers[0].self_attn
    widths = [attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0], attn.o_proj.weight.shape[1]]
    losses = []
    for step in range(STEPS):
        loss = engine(input_ids=_ids(step), labels=_ids(step)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = engine._zero3_consolidated_16bit_state_dict()
    engine.destroy()
    return {"losses": losses, "widths": widths, "params": params if rank == 0 else None}


def test_llama_heads_split_2_1_1_at_tp3_train_like_one_process() -> None:
    if H.missing_packages("transformers") is not None:
        pytest.skip(H.missing_packages("transformers") or "")
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        loss = model(input_ids=_ids(step), labels=_ids(step)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DeepSpeed's default gradient_clipping (1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    ranks = run_distributed(train, world_size=3, timeout_s=240)
    assert [r["widths"] for r in ranks] == [[32, 32, 32], [16, 16, 16], [16, 16, 16]]  # head size 16
    assert ranks[0]["losses"] == pytest.approx(losses, rel=1e-5), (ranks[0]["losses"], losses)
    got = ranks[0]["params"]
    for name, value in model.named_parameters():
        torch.testing.assert_close(got[name], value.detach(), rtol=2e-5, atol=2e-6, msg=lambda m, n=name: f"{n}: {m}")
