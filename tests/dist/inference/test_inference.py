"""init_inference and the hybrid engine's generate on a tiny Hugging Face Llama built offline, on 2 gloo ranks in
one spawn.

fp32 logits equal the plain model's (2e-5) and greedy generate gives the same tokens at tensor_parallel.tp_size 1
and 2 (at 2 the attention and MLP projections hold half their rows or columns); `checkpoint` loads a Hugging Face
safetensors folder (save_pretrained, sharded into several files) and a Slipstream checkpoint (save_checkpoint of
a ZeRO-1 engine) into a model built with other weights, which then answers as the saved one; dtype casts the
parameters; a prompt over max_out_tokens is refused by name.
Hybrid engine (`hybrid_engine.enabled`, ZeRO-3): `engine.eval(); engine.generate(...)` all-gathers each unit
once for the whole call (without it the hooks gather per layer and token), gives the tokens of the plain model
holding the engine's weights, leaves nothing gathered, and training goes on bit-equal to a run without it.
Inside that generate the parameters are plain and the ZeRO-3 hooks idle (restored after, also when it raised),
and Hugging Face's per-token rank sync (synced_gpus, on under its ZeRO-3 integration) is off unless asked for;
`hybrid_engine.max_out_tokens` refuses prompt plus new tokens beyond it before gathering anything.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_distributed

VOCAB = 64


def _llama(seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         pad_token_id=0, eos_token_id=None)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def _answers(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
    return logits, tokens


def _check(engine: Any, expected: tuple[torch.Tensor, torch.Tensor], ids: torch.Tensor, what: str) -> None:
    logits, tokens = _answers(engine, ids)
    torch.testing.assert_close(logits, expected[0], rtol=0, atol=2e-5, msg=lambda m: f"{what} logits: {m}")
    assert torch.equal(tokens, expected[1]), f"{what}: generated {tokens.tolist()}, expected {expected[1].tolist()}"


def _checkpoints(rank: int, folder: Path) -> tuple[str, str]:
    import slipstream

    hf_dir, ours = folder / "hf", folder / "ours"
    if rank == 0:
        _llama(1).save_pretrained(hf_dir, safe_serialization=True, max_shard_size="40KB")
    engine, *_ = slipstream.initialize(model=_llama(2), config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    engine.save_checkpoint(str(ours), tag="t")
    dist.barrier()
    assert len(list(hf_dir.glob("*.safetensors"))) > 1  # shards: read one file at a time
    return str(hf_dir), str(ours)


def _zero3(hybrid: bool, **settings: object) -> Any:
    import slipstream

    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "hybrid_engine": {"enabled": hybrid, **settings}}
    engine, *_ = slipstream.initialize(model=_llama(0), config=config)
    return engine


def _train(engine: Any, rank: int, steps: range) -> None:
    for step in steps:
        ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(100 + step))[rank:rank + 1]
        engine.backward(engine(ids, labels=ids).loss)
        engine.step()


def _generate_gathers(engine: Any, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    from slipstream.comm import count_collectives

    engine.eval()
    with count_collectives() as counter:
        tokens = engine.generate(ids, max_new_tokens=6, do_sample=False)
    engine.train()
    return tokens, counter.calls["all_gather"]


def _held_units(engine: Any) -> list[int]:
    """The ZeRO-3 units still gathered (their storage not empty; the pool may keep the memory for the next
    gathers, zero/stage3/pool.py)."""
    return [u.uid for u in engine.zero_model.units if not u.persistent and u.full.untyped_storage().nbytes()]


def _check_hybrid(rank: int, ids: torch.Tensor) -> None:
    straight, engine = _zero3(True), _zero3(True)
    _train(straight, rank, range(4))
    _train(engine, rank, range(2))
    plain = _llama(0)
    plain.load_state_dict({name: value.clone() for name, value in engine.iter_full_weights()}, strict=False)
    tokens, gathers = _generate_gathers(engine, ids)
    assert torch.equal(tokens, _answers(plain, ids)[1]), tokens
    units = [u for u in engine.zero_model.units if u.params]
    assert gathers == len(units), (gathers, len(units))
    assert _held_units(engine) == []
    _, per_token = _generate_gathers(_zero3(False), ids)
    assert per_token > 3 * gathers, (per_token, gathers)  # without the hybrid engine: per layer, per token
    _train(engine, rank, range(2, 4))
    theirs = dict(straight.iter_full_weights())
    for name, value in engine.iter_full_weights():
        assert torch.equal(value, theirs[name]), f"{name} differs after generate"


def _check_generate_runs_plain(engine: Any, ids: torch.Tensor) -> None:
    """Inside the hybrid generate the parameters are of their plain type and the ZeRO-3 hooks do nothing; after
    it, also after a generate that raised, they are sharded parameters again and the hooks are back."""
    from torch import nn

    from slipstream.zero.stage3.sharded_param import ShardedParameter

    coordinator, seen, calls = engine.zero_model.coordinator, [], []
    pre_forward = coordinator.pre_forward
    coordinator.pre_forward = lambda unit: (calls.append(unit.uid), pre_forward(unit))
    layers = engine.module.model.layers
    watch = layers[0].register_forward_pre_hook(lambda m, a: seen.append(type(m.mlp.up_proj.weight)))
    engine.eval()
    engine.generate(ids, max_new_tokens=3, do_sample=False)
    assert seen and set(seen) == {nn.Parameter} and not calls, (set(seen), calls)
    weight = layers[0].mlp.up_proj.weight
    assert isinstance(weight, ShardedParameter) and not coordinator.paused

    def boom(*_: object) -> None:
        raise RuntimeError("boom")

    failing = layers[1].register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        engine.generate(ids, max_new_tokens=3, do_sample=False)
    failing.remove()
    watch.remove()
    assert isinstance(weight, ShardedParameter) and not coordinator.paused
    assert _held_units(engine) == []
    engine(ids)  # a forward outside generate: the hooks gather again
    assert calls, "the ZeRO-3 hooks stayed paused after generate"
    coordinator.pre_forward = pre_forward
    engine.train()


def _check_no_sync_per_token(engine: Any, ids: torch.Tensor) -> None:
    """Under Hugging Face's DeepSpeed ZeRO-3 integration (Trainer, TRL) generate syncs the ranks with an
    all-reduce after every token unless told otherwise; the hybrid generate, with nothing to gather, turns it off."""
    import transformers.generation.utils as hf_generation

    reduces, all_reduce = [], dist.all_reduce
    engine.eval()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hf_generation, "is_deepspeed_zero3_enabled", lambda: True)
        patch.setattr(dist, "all_reduce", lambda *a, **k: (reduces.append(1), all_reduce(*a, **k))[1])
        tokens = engine.generate(ids, max_new_tokens=3, do_sample=False)
        assert not reduces, f"{len(reduces)} all-reduces in a hybrid generate of 3 tokens"
        engine.generate(ids, max_new_tokens=3, do_sample=False, synced_gpus=True)  # asked for: kept
        assert reduces, "synced_gpus=True given to the hybrid generate was overridden"
    assert tokens.shape[1] == ids.shape[1] + 3
    engine.train()


def _check_max_out_tokens(ids: torch.Tensor) -> None:
    """hybrid_engine.max_out_tokens bounds prompt plus new tokens: a call beyond it is refused before anything
    is gathered; one at the bound runs."""
    from slipstream.comm import count_collectives

    engine = _zero3(True, max_out_tokens=ids.shape[1] + 3)
    engine.eval()
    with count_collectives() as counter, pytest.raises(ValueError, match="hybrid_engine.max_out_tokens"):
        engine.generate(ids, max_new_tokens=4, do_sample=False)
    assert counter.calls["all_gather"] == 0, counter.calls
    assert engine.generate(ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3


def rank_fn(rank: int, world: int, *, folder: str) -> None:
    import slipstream as deepspeed

    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    expected = _answers(_llama(0), ids)
    for tp in (1, 2):
        engine = deepspeed.init_inference(_llama(0), dtype=torch.float32, tensor_parallel={"tp_size": tp})
        q_rows = engine.module.model.layers[0].self_attn.q_proj.weight.shape[0]
        assert q_rows == 32 // tp, q_rows
        _check(engine, expected, ids, f"tp {tp}")
    hf_dir, ours = _checkpoints(rank, Path(folder))
    engine = deepspeed.init_inference(_llama(0), config={"dtype": "fp32", "checkpoint": hf_dir}, tp={"tp_size": 2})
    _check(engine, _answers(_llama(1), ids), ids, "Hugging Face folder")
    engine = deepspeed.init_inference(_llama(0), dtype=torch.float32, checkpoint=ours)
    _check(engine, _answers(_llama(2), ids), ids, "Slipstream checkpoint")
    engine = deepspeed.init_inference(_llama(0), dtype="bf16", max_tokens=5, replace_with_kernel_inject=True)
    assert {p.dtype for p in engine.parameters()} == {torch.bfloat16}
    with pytest.raises(RuntimeError, match="max_out_tokens"):
        engine.generate(ids, max_new_tokens=2)
    _check_hybrid(rank, ids)
    engine = _zero3(True)
    _check_generate_runs_plain(engine, ids)
    _check_no_sync_per_token(engine, ids)
    _check_max_out_tokens(ids)


def test_init_inference_matches_the_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("transformers")
    run_distributed(rank_fn, world_size=2, tmp_dir=tmp_path, timeout_s=180, folder=str(tmp_path))
