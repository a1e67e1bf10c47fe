"""The hybrid engine's tensor-parallel generate (`hybrid_engine.inference_tp_size` 2) of models with LoRA layers,
2 gloo ranks in one spawn, each rank with prompts of its own.

Each LoRA layer is a plain linear in the split inference copy whose slice of the base weight gets the layer's
delta `scaling * B @ A` while the copy is refilled. The greedy tokens equal those of the same engine generating
with `inference_tp_size` 1 (LoRA fused in place for the call) and those of the merged model in one process; the
training model is bit-equal after the call (LoRA weights unfused, base weights unchanged, no layer left fused),
and training afterwards gives the same losses and weights as without the generation.
- A plain torch model (no Transformers) whose up and down projections are DeepSpeed-Chat-shaped LoRA layers
  (split by rows and by columns), at ZeRO-3 with the small LoRA factors in the persistent unit (read in another
  chunk than their base weights) and at ZeRO-1; a second call after a training step refills the same copy.
- A tiny Hugging Face Llama with LoRA q and v projections at ZeRO-3, one unit per refill chunk (when
  transformers is installed), and a PEFT LoRA model of it (when peft is installed); PEFT layers the split copy
  cannot fuse (DoRA, a wrapped embedding) are refused by name.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.dist.inference.test_hybrid_lora import LoraLinear
from tests.dist.inference.test_inference import VOCAB, _held_units
from tests.harness import run_distributed

WIDTH, INNER = 32, 48


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = LoraLinear(nn.Linear(WIDTH, INNER))  # column-parallel in the copy
        self.down_proj = LoraLinear(nn.Linear(INNER, WIDTH))  # row-parallel in the copy

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down_proj(F.gelu(self.up_proj(h)))


class TinyLM(nn.Module):
    """Embedding, two MLP blocks with LoRA projections, LM head; a greedy `generate` without a KV cache (each
    position is computed on its own, so left padding never changes an answer)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed_tokens = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList([_Block() for _ in range(2)])
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(ids)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(h)

    def generate(self, input_ids: torch.Tensor, attention_mask: Any = None, max_new_tokens: int = 5) -> torch.Tensor:
        ids = input_ids
        for _ in range(max_new_tokens):
            ids = torch.cat([ids, self(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
        return ids


def _prompts(rank: int) -> torch.Tensor:
    """Rank 0: 2 prompts of 7 tokens; rank 1: 3 prompts of 5 (the group pads them to one length)."""
    rows, length = (2, 7) if rank == 0 else (3, 5)
    return torch.randint(1, VOCAB, (rows, length), generator=torch.Generator().manual_seed(3 + rank))


def _engine(model: nn.Module, stage: int, threshold: int, **hybrid: object) -> Any:
    import slipstream

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": threshold},
        "hybrid_engine": {"enabled": True, "tp_gather_partition_size": 1, **hybrid},
    }
    engine, *_ = slipstream.initialize(model=model, config=config)
    return engine


def _train(engine: Any, rank: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(100 + step))[rank : rank + 1]
        out = engine(ids)
        logits = out if isinstance(out, torch.Tensor) else out.logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _full(engine: Any) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in engine.iter_full_weights()}


def _merged(model: nn.Module, weights: dict[str, torch.Tensor]) -> nn.Module:
    """`model` holding `weights`, each LoRA layer's `lora_scaling * left.T @ right.T` added into its weight."""
    model.load_state_dict(weights, strict=False)
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, LoraLinear):
                layer.weight += layer.lora_scaling * (layer.lora_left_weight.t() @ layer.lora_right_weight.t())
                layer.fuse_lora = True
    return model.eval()


def _generate(engine: Any, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    engine.eval()
    tokens = engine.generate(ids, max_new_tokens=5, **kwargs)
    engine.train()
    return tokens


def _unchanged(engine: Any, before: dict[str, torch.Tensor], what: str) -> None:
    """Every parameter bit-equal to `before` and no LoRA layer left fused."""
    after = _full(engine)
    changed = [name for name, value in before.items() if not torch.equal(after[name], value)]
    assert not changed, f"{what}: the training model changed across generate: {changed}"
    fused = [n for n, m in engine.module.named_modules() if getattr(m, "fuse_lora", False)]
    assert not fused, f"{what}: LoRA layers left fused: {fused}"


def _check_tiny(rank: int, stage: int) -> None:
    """TP-2 == TP-1 == merged tokens, training model untouched, training unaffected; a second call refills."""
    threshold = 200  # stage 3: the LoRA factors (128 and 192 elements) persistent, the base weights sharded
    straight, single = _engine(TinyLM(0), stage, threshold), _engine(TinyLM(0), stage, threshold)
    engine = _engine(TinyLM(0), stage, threshold, inference_tp_size=2)
    losses = _train(engine, rank, range(2))
    assert losses == _train(single, rank, range(2))
    ids = _prompts(rank)
    before = _full(engine)
    expected = _merged(TinyLM(0), before).generate(ids)
    tokens = _generate(engine, ids)
    assert torch.equal(tokens, expected), (stage, tokens, expected)
    assert torch.equal(_generate(single, ids), expected), (stage, "inference_tp_size 1")
    _unchanged(engine, before, f"stage {stage}")
    if stage == 3:
        assert _held_units(engine) == []
    generator = engine._hybrid_tp_generator
    assert generator.copy.layers[0].up_proj.weight.shape == (INNER // 2, WIDTH)  # a plain linear, half the rows
    assert not any("lora" in name for name, _ in generator.copy.named_parameters())
    losses += _train(engine, rank, range(2, 4))
    assert losses == _train(straight, rank, range(4)), f"stage {stage}: training differs after generate"
    theirs = _full(straight)
    assert all(torch.equal(value, theirs[name]) for name, value in _full(engine).items()), f"stage {stage}"
    before = _full(engine)
    tokens = _generate(engine, ids)  # refilled from the stepped weights
    assert torch.equal(tokens, _merged(TinyLM(0), before).generate(ids)), (stage, "second call", tokens)
    _unchanged(engine, before, f"stage {stage}, second call")


def _check_llama(rank: int) -> None:
    """DeepSpeed-Chat-shaped LoRA q and v projections of a Hugging Face Llama at ZeRO-3."""
    from tests.dist.inference.test_hybrid_lora import _lora_llama

    engine = _engine(_lora_llama(0), 3, 0, inference_tp_size=2)
    single = _engine(_lora_llama(0), 3, 0)
    assert _train(engine, rank, range(2)) == _train(single, rank, range(2))
    ids = _prompts(rank)
    before = _full(engine)
    expected = _merged(_lora_llama(0), before).generate(ids, max_new_tokens=5, do_sample=False)
    tokens = _generate(engine, ids, do_sample=False)
    assert torch.equal(tokens, expected), (tokens, expected)
    assert torch.equal(_generate(single, ids, do_sample=False), expected), "inference_tp_size 1"
    _unchanged(engine, before, "llama")
    assert _held_units(engine) == []
    q_proj = engine._hybrid_tp_generator.copy.model.layers[0].self_attn.q_proj
    assert type(q_proj) is nn.Linear and q_proj.weight.shape == (16, 32), q_proj


def _check_peft(rank: int) -> None:
    """PEFT's LoraLayer (q and v projections) at ZeRO-3: the tokens of the unmerged model in one process."""
    from tests.dist.inference.test_hybrid_lora import _peft_llama

    ids = _prompts(rank)
    expected = _peft_llama().generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    engine = _engine(_peft_llama(), 3, 0, inference_tp_size=2)
    before = _full(engine)
    tokens = _generate(engine, ids, do_sample=False)
    assert torch.equal(tokens, expected), (tokens, expected)
    _unchanged(engine, before, "peft")


def _check_peft_refusals() -> None:
    """PEFT layers the split copy cannot fuse are refused by name: one wrapping an embedding, a DoRA adapter."""
    import peft
    import pytest

    from slipstream.inference.lora import base_parameters, lora_terms

    model = nn.Sequential()
    model.add_module("proj", nn.Linear(6, 8))
    model.add_module("emb", nn.Embedding(10, 6))
    plain = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["proj", "emb"]))
    layers = {n.rsplit(".", 1)[-1]: m for n, m in plain.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert [t.up for t in lora_terms(layers["proj"], "proj")] == [layers["proj"].lora_B["default"].weight]
    with pytest.raises(ValueError, match="PEFT layer emb wraps a Embedding"):
        base_parameters(layers["emb"], "emb")
    config = peft.LoraConfig(r=2, target_modules=["0"], use_dora=True)
    dora = peft.get_peft_model(nn.Sequential(nn.Linear(6, 8)), config)
    layer = next(m for m in dora.modules() if isinstance(m, peft.tuners.lora.LoraLayer))
    with pytest.raises(ValueError, match=r"the PEFT layer 0 \(adapter 'default'\) uses a LoRA variant \(DoRA"):
        lora_terms(layer, "0")


def rank_fn(rank: int, world: int) -> None:
    for stage in (3, 1):
        _check_tiny(rank, stage)
    if importlib.util.find_spec("transformers") is not None:
        _check_llama(rank)
        if importlib.util.find_spec("peft") is not None:
            _check_peft(rank)
            _check_peft_refusals()


def test_tensor_parallel_generate_fuses_lora_into_the_split_copy(tmp_path) -> None:  # type: ignore[no-untyped-def]
    run_distributed(rank_fn, world_size=2, tmp_dir=tmp_path, timeout_s=240)
