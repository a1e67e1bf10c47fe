"""`checkpoint_hf_layers`: a Hugging Face model's layers checkpointed through slipstream.checkpointing, with
activation offload, without changing the model's code: the same loss and gradients as without, and each layer's
input offloaded and brought back once per step."""

from __future__ import annotations

import pytest
import torch

from slipstream.activation import recompute
from slipstream.activation.hf import checkpoint_hf_layers

transformers = pytest.importorskip("transformers")


def _tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def _step(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def test_layers_checkpoint_and_offload_through_slipstream() -> None:
    tokens = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    want_loss, want_grads = _step(_tiny_llama(), tokens)
    model = _tiny_llama()
    try:
        assert checkpoint_hf_layers(model, offload=True) >= 3  # the decoder layers (and the flag of LlamaModel)
        store = recompute.store()
        before = store.stats.offloaded
        loss, grads = _step(model, tokens)
        assert store.stats.offloaded - before >= 3  # each layer's input (and any other saved input) went to the host
        assert store.stats.prefetched + store.stats.fetched_on_demand >= store.stats.offloaded - before
    finally:
        recompute.reset()
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=2e-5)
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)


def test_a_model_without_checkpointable_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="no layer with a gradient_checkpointing flag"):
        checkpoint_hf_layers(torch.nn.Sequential(torch.nn.Linear(2, 2)))
