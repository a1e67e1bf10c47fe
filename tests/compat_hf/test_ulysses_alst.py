"""DeepSpeed's ALST recipe for Hugging Face models, run unchanged on Slipstream (`import deepspeed`): a tiny
Llama with `UlyssesSPAttentionHF.register_with_transformers` at SP=2 on 2 gloo ranks, batches from
`UlyssesSPDataLoaderAdapter`, the tutorial's weighted all-gather of the ranks' losses, ZeRO 2 and 3, SGD.

Checked against one process training the same model on the whole sequences, in the order the adapter serves
them: every step's loss and every parameter's gradient (before the step), and the parameters after 4 steps.
The sequences are 11 tokens long, so the ranks' slices differ in length (6 and 5; DeepSpeed refuses that). The
adapter's slices and shifted labels are checked exactly, and a model with one KV head (repeated to the group
size) against its single-process logits and gradients, also with `head_chunks=1`; with `disable_in_eval`, a
model in eval mode on whole sequences gives the single-process logits.

SGD, not AdamW: the first gradients agree to 2.5e-7 of the largest element, but AdamW's first step moves every
element by about lr * sign(g), so elements whose gradient is at the noise level (the summation order differs
between the sequence-split attention and one process) move by up to 2 lr in different directions (measured:
parameters 2e-3 apart after 4 AdamW steps at lr 1e-2; with SGD, 1.2e-7). With SGD the trajectory checks the
gradients themselves. Gradient clipping is on (the engine's default, 1.0), so the global norm over the
sequence-parallel ranks is checked too."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.compat_hf import hf_common as H
from tests.harness import run_distributed

SEQ, SAMPLES, LR, CLIP = 11, 4, 0.5, 1.0
pytestmark = pytest.mark.skipif(H.missing_packages("transformers") is not None, reason="transformers not installed")


def llama(kv_heads: int = 2, seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def samples(n: int = SAMPLES, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(1, 61, (n, seq), generator=torch.Generator().manual_seed(3))


def _batches(ids: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": row[None], "labels": row[None].clone()} for row in ids]


def reference(kv_heads: int = 2) -> dict[str, Any]:
    """One process, whole sequences, the same order: sample 0 (rank 0's first), 1 (rank 1's first), 2, 3."""
    model = llama(kv_heads)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for batch in _batches(samples()):
        loss = model(**batch).loss
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)  # the engine's default gradient_clipping
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def train_sp(rank: int, world: int, stage: int) -> dict[str, Any]:
    H.use_slipstream_as_deepspeed()
    import deepspeed
    import torch.distributed.nn.functional as dist_nn
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from deepspeed.runtime.utils import move_to_device
    from deepspeed.utils import groups, safe_get_full_grad

    model = llama()
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=2,
        micro_batch_size=1,
        seq_length=SEQ,
        seq_length_is_variable=True,
    )
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "steps_per_print": 1000,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "zero_optimization": {"stage": stage},
        "sequence_parallel_size": 2,
    }
    engine, *_ = deepspeed.initialize(config=config, model=model, model_parameters=model.parameters(), mpu=mpu)
    sp_group = groups._get_sequence_parallel_group()
    sp_rank, sp_size = groups._get_sequence_parallel_rank(), groups._get_sequence_parallel_world_size()
    mine = _batches(samples()[rank::world])  # each rank reads its own samples (a distributed sampler's split)
    dl = UlyssesSPDataLoaderAdapter(mine, sp_rank=sp_rank, sp_group=sp_group, sp_world_size=sp_size, device="cpu")
    losses, grads, served = [], [], []
    for batch in dl:
        batch = move_to_device(batch, engine.device)
        served.append(batch["input_ids"].clone())
        outputs = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        shift_labels = batch["shift_labels"]
        loss = engine.module.loss_function(
            logits=outputs.logits, labels=None, shift_labels=shift_labels, vocab_size=engine.module.config.vocab_size
        )
        # the tutorial's differentiable weighted per-slice loss aggregation across the group
        losses_per_rank = dist_nn.all_gather(loss, group=sp_group)
        good = (shift_labels != -100).view(-1).sum()
        good_per_rank = dist_nn.all_gather(good, group=sp_group)
        total = sum(losses_per_rank[r] * good_per_rank[r] for r in range(sp_size))
        loss = total / max(sum(good_per_rank), 1)
        engine.backward(loss)
        grads.append({n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()})
        engine.step()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params, "served": served, "len": len(dl)}


@pytest.mark.parametrize("stage", [2, 3])
def test_ulysses_hf_training_equals_one_process(stage: int) -> None:
    expected = reference()
    results = run_distributed(train_sp, world_size=2, timeout_s=300, stage=stage)
    ids = samples()
    for rank, out in enumerate(results):
        assert out["len"] == SAMPLES
        lo, hi = (0, 6) if rank == 0 else (6, 11)
        assert [t.tolist() for t in out["served"]] == [ids[i : i + 1, lo:hi].tolist() for i in range(SAMPLES)]
        assert out["losses"] == pytest.approx(expected["losses"], rel=1e-5, abs=1e-6)
        for step, (got, want) in enumerate(zip(out["grads"], expected["grads"])):
            assert set(got) == set(want)
            for name in want:
                torch.testing.assert_close(
                    got[name], want[name], rtol=1e-5, atol=1e-6, msg=lambda m, s=step, n=name: f"step {s} {n}: {m}"
                )
        for name, value in expected["params"].items():
            torch.testing.assert_close(
                out["params"][name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )


def loader_and_one_kv_head(rank: int, world: int) -> dict[str, Any]:
    """The adapter's slices of two rounds (a 7-token sequence: slices of 4 and 3, and non-tensor values), and
    one forward + backward of a model with one KV head (repeated to 2 for the group) on 12 tokens."""
    H.use_slipstream_as_deepspeed()
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter

    model = llama(kv_heads=1)
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1)
    group = mpu.get_sequence_parallel_group()
    base = torch.tensor([[1, 10, 11, 12, 13, 2, 3]]) + 100 * rank
    mine = [
        {"input_ids": base, "labels": base.clone(), "name": f"rank{rank}"},
        {"input_ids": base[:, :4], "labels": base[:, :4].clone(), "position_ids": torch.tensor([[0, 1, 0, 1]])},
    ]
    dl = UlyssesSPDataLoaderAdapter(mine, sp_rank=rank, sp_group=group, sp_world_size=2, device="cpu")
    served = list(dl)
    runs = []
    for head_chunks in (None, 1):  # 1: DistributedAttention's recomputing path (one chunk of the local heads)
        if head_chunks is not None:
            model = llama(kv_heads=1)
            UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1, head_chunks=head_chunks)
        ids = samples(1, 12)
        half = slice(0, 6) if rank == 0 else slice(6, 12)
        logits = model(input_ids=ids[:, half], position_ids=torch.arange(12)[None, half]).logits
        logits.sum().backward()
        summed = {}
        for name, p in model.named_parameters():  # the group's gradient: the sum of the ranks' (each saw its tokens)
            grad = p.grad.clone()
            torch.distributed.all_reduce(grad, group=group)
            summed[name] = grad
        runs.append({"logits": logits.detach(), "grads": summed})
    # a padding mask cannot be honoured after the swap: it is dropped, with a warning (not silently)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        padded = torch.ones(1, 6, dtype=torch.int64)
        padded[0, :2] = 0
        model(input_ids=ids[:, half], attention_mask=padded)
    mask_warned = any("drops the attention mask" in str(w.message) for w in caught)
    # disable_in_eval: a module in eval mode calls the original attention, each rank on whole sequences
    model = llama(kv_heads=1).eval()
    UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1, disable_in_eval=True)
    with torch.no_grad():
        whole = model(input_ids=samples(1, 12)).logits
    import deepspeed

    try:  # the config's size must agree with the mpu's groups
        deepspeed.initialize(model=model, config={"train_batch_size": 1, "sequence_parallel_size": 4}, mpu=mpu)
        mismatch = ""
    except ValueError as exc:
        mismatch = str(exc)
    return {"served": served, "runs": runs, "mismatch": mismatch, "eval_whole": whole, "mask_warned": mask_warned}


def test_loader_adapter_slices_and_one_kv_head() -> None:
    results = run_distributed(loader_and_one_kv_head, world_size=2, timeout_s=300)
    for rank, out in enumerate(results):
        assert "sequence_parallel_size=4 but the mpu's sequence groups have 2 ranks" in out["mismatch"]
        assert out["mask_warned"], "a padding mask was dropped without a warning"
        served = out["served"]
        assert len(served) == 4  # rank 0's batch, rank 1's, then the second round
        for source in range(2):
            ids = torch.tensor([[1, 10, 11, 12, 13, 2, 3]]) + 100 * source
            shifted = (
                torch.tensor([[10, 11, 12, 13, 2, 3, -100]])
                + torch.tensor([[100, 100, 100, 100, 100, 100, 0]]) * source
            )
            part = slice(0, 4) if rank == 0 else slice(4, 7)
            batch = served[source]
            assert set(batch) == {"input_ids", "shift_labels", "position_ids", "name"}
            assert torch.equal(batch["input_ids"], ids[:, part]), batch
            assert torch.equal(batch["shift_labels"], shifted[:, part]), batch  # the boundary label crosses
            assert torch.equal(batch["position_ids"], torch.arange(7)[None, part]), batch
            assert batch["name"] == f"rank{source}"
            second = served[2 + source]
            ids2 = ids[:, :4]
            shifted2 = torch.cat([ids2[:, 1:], torch.tensor([[-100]])], dim=1)
            part2 = slice(0, 2) if rank == 0 else slice(2, 4)
            assert torch.equal(second["input_ids"], ids2[:, part2])
            assert torch.equal(second["shift_labels"], shifted2[:, part2])
            assert torch.equal(second["position_ids"], torch.tensor([[0, 1, 0, 1]])[:, part2])  # kept as given
    model = llama(kv_heads=1)
    logits = model(input_ids=samples(1, 12)).logits
    logits.sum().backward()
    for out in results:
        torch.testing.assert_close(out["eval_whole"], logits.detach(), rtol=1e-6, atol=1e-6)
    for run in range(2):
        got = torch.cat([r["runs"][run]["logits"] for r in results], dim=1)
        torch.testing.assert_close(got, logits.detach(), rtol=1e-5, atol=1e-6)
        for name, p in model.named_parameters():
            scale = float(p.grad.abs().max())  # logits.sum() gives gradients up to ~50: float32 noise scales so
            got_grad = results[0]["runs"][run]["grads"][name]
            torch.testing.assert_close(got_grad, p.grad, rtol=1e-5, atol=1e-6 * scale, msg=f"run {run} {name}")


def test_initialize_takes_only_the_alst_mpu() -> None:
    import types

    import slipstream

    with pytest.raises(NotImplementedError, match="a Megatron-style mpu is not supported"):
        slipstream.initialize(model=torch.nn.Linear(2, 2), config={"train_batch_size": 1}, mpu=types.SimpleNamespace())


def test_register_refuses_what_it_cannot_honour() -> None:
    """Checked in one process (no group is built before the checks fail)."""
    H.use_slipstream_as_deepspeed()
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    assert UlyssesSPAttentionHF.register_with_transformers(llama(), "sdpa", 1, 1) is None
    with pytest.raises(ValueError, match="does not match model config attn_implementation='sdpa'"):
        UlyssesSPAttentionHF.register_with_transformers(llama(), "flash_attention_2", 2, 1)
    with pytest.raises(ValueError, match="seq_length_is_variable=True, or seq_length"):
        UlyssesSPAttentionHF.register_with_transformers(llama(), "sdpa", 2, 1, seq_length_is_variable=False)
    from slipstream.sequence import hf

    for name in ("eager", "flex_attention"):
        with pytest.raises(ValueError, match=f"cannot wrap attn_implementation '{name}'"):
            hf.install(name, lambda core: pytest.fail("refused before the wrapper is built"))
