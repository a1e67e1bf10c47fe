"""Known pains of DeepSpeed users under Transformers, each on 2 gloo ranks with a tiny GPT-2:
a PEFT/LoRA adapter saved by the Trainer at ZeRO-3 holds the trained adapter weights (DeepSpeed users report
empty adapters); the batch triple has one authority; generate() at ZeRO-3 with different prompt lengths per
rank finishes; a Trainer checkpoint resumes at another world size."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.compat_hf import hf_common as H
from tests.harness import run_distributed

pytestmark = pytest.mark.skipif(
    bool(H.missing_packages("transformers", "accelerate")),
    reason=H.missing_packages("transformers", "accelerate") or "",
)


def _setup(rank: int, world: int) -> None:
    H.rank_env(rank, world)
    H.use_slipstream_as_deepspeed()
    H.cpu_partial_state()


def _zero3_model() -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(H.tiny_gpt2_config())


# ---- PEFT / LoRA at ZeRO-3 ----
def lora_run(rank: int, world: int, *, out: str) -> dict[str, Any]:
    _setup(rank, world)
    from peft import LoraConfig, get_peft_model
    from transformers import Trainer

    args = H.training_args(out, world=world, ds=H.ds_config(3), steps=2)
    model = get_peft_model(
        _zero3_model(), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True, lora_dropout=0.0)
    )
    trainer = Trainer(model=model, args=args, train_dataset=H.TokenDataset())
    trainer.train()
    trainer.save_model(os.path.join(out, "adapter"))
    trained = H.full_state(trainer.model)
    return {n: t for n, t in trained.items() if "lora_" in n}


@pytest.mark.skipif(bool(H.missing_packages("peft")), reason=H.missing_packages("peft") or "")
def test_lora_adapter_saved_at_zero3_is_the_trained_adapter(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    trained = run_distributed(lora_run, world_size=2, timeout_s=300, out=str(tmp_path))[0]
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert len(saved) == len(trained) == 4, f"adapter tensors: saved {sorted(saved)}, trained {sorted(trained)}"
    by_suffix = {n.split("base_model.model.", 1)[-1].replace(".default", ""): t for n, t in trained.items()}
    for name, tensor in saved.items():
        key = name.split("base_model.model.", 1)[-1]
        assert tensor.numel() > 0, f"{name} saved empty"
        assert torch.equal(tensor.float(), by_suffix[key]), f"{name} is not the trained adapter weight"
    assert any(t.abs().sum() > 0 for n, t in saved.items() if "lora_B" in n), "lora_B never trained (all zero)"


# ---- the batch triple ----
def batch_run(rank: int, world: int, *, out: str) -> dict[str, Any]:
    _setup(rank, world)
    from transformers import Trainer

    result: dict[str, Any] = {}
    ds = {
        **H.ds_config(2),
        "train_micro_batch_size_per_gpu": 1,
        "train_batch_size": 8,
        "gradient_accumulation_steps": 4,
    }
    try:  # the DeepSpeed config says micro 1 x accumulation 4, the Trainer says 2 x 2
        H.training_args(out, world=world, ds=ds, steps=1)
        Trainer(
            model=H.tiny_gpt2(), args=H.training_args(out, world=world, ds=ds, steps=1), train_dataset=H.TokenDataset()
        ).train()
    except ValueError as exc:
        result["mismatch"] = str(exc)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=False)
    trainer = Trainer(
        model=H.tiny_gpt2(),
        args=H.training_args(out, world=world, ds=H.ds_config(2), steps=1, global_micro=6, gas=3),
        train_dataset=H.TokenDataset(),
    )
    trainer.train()
    result["auto"] = trainer.model_wrapped.get_batch_info()
    return result


def test_batch_triple_has_one_authority(tmp_path: Path) -> None:
    """ "auto" takes the Trainer's values; a DeepSpeed value that disagrees is named, not silently used."""
    result = run_distributed(batch_run, world_size=2, timeout_s=300, out=str(tmp_path))[0]
    assert result["auto"] == (18, 3, 3), f"engine (train_batch, micro, accumulation) = {result['auto']}"
    message = result.get("mismatch", "")
    for named in ("train_micro_batch_size_per_gpu=1", "per_device_train_batch_size=2", "gradient_accumulation_steps=4"):
        assert named in message, f"the mismatch error does not name {named!r}: {message!r}"


# ---- generate() at ZeRO-3 ----
def generate_run(rank: int, world: int, *, out: str) -> dict[str, Any]:
    _setup(rank, world)
    H.training_args(out, world=world, ds=H.ds_config(3), steps=1)  # makes Transformers see ZeRO-3
    from transformers import Trainer

    trainer = Trainer(
        model=_zero3_model(),
        args=H.training_args(out, world=world, ds=H.ds_config(3), steps=1),
        train_dataset=H.TokenDataset(),
    )
    trainer.train()
    model = trainer.model_wrapped
    full = H.full_state(trainer.model)
    prompt = torch.arange(1, 4 + 5 * rank).unsqueeze(0)  # rank 0: 3 tokens, rank 1: 8 tokens
    new = 3 + 6 * rank  # and a different number of new tokens: rank 0 finishes first
    model.eval()
    with torch.no_grad():
        output = trainer.model.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)
    return {"prompt": prompt, "output": output, "new": new, "state": full}


def test_generate_zero3_different_prompt_lengths_does_not_hang(tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    results = run_distributed(generate_run, world_size=2, timeout_s=180, out=str(tmp_path))
    reference = GPT2LMHeadModel(H.tiny_gpt2_config())
    reference.load_state_dict(results[0]["state"], strict=False)
    reference.eval()
    for r in results:
        assert r["output"].shape[1] == r["prompt"].shape[1] + r["new"]
        expected = reference.generate(
            r["prompt"], max_new_tokens=r["new"], do_sample=False, pad_token_id=0, eos_token_id=None
        )
        assert torch.equal(r["output"], expected), "ZeRO-3 greedy generation differs from the gathered model's"


# ---- resume at another world size ----
def save_run(rank: int, world: int, *, out: str) -> None:
    _setup(rank, world)
    from transformers import Trainer

    args = H.training_args(out, world=world, ds=H.ds_config(2), steps=4, save_strategy="steps", save_steps=2)
    Trainer(model=H.tiny_gpt2(), args=args, train_dataset=H.TokenDataset()).train()


def resume_run(rank: int, world: int, *, out: str, checkpoint: str) -> dict[str, torch.Tensor]:
    _setup(rank, world)
    from transformers import Trainer

    trainer = Trainer(
        model=H.tiny_gpt2(),
        args=H.training_args(out, world=world, ds=H.ds_config(2), steps=4),
        train_dataset=H.TokenDataset(),
    )
    trainer.train(resume_from_checkpoint=checkpoint)
    return H.full_state(trainer.model)


def test_resume_trainer_checkpoint_at_another_world_size(tmp_path: Path) -> None:
    """Saved by 2 ranks at step 2 (ZeRO-2), resumed by 1 rank with the same global batch: the end state equals
    the uninterrupted single-process Trainer run."""
    from tests.compat_hf.test_trainer import reference_in_parent

    run_distributed(save_run, world_size=2, timeout_s=300, out=str(tmp_path / "two"))
    resumed = run_distributed(
        resume_run,
        world_size=1,
        timeout_s=300,
        out=str(tmp_path / "one"),
        checkpoint=str(tmp_path / "two" / "checkpoint-2"),
    )[0]
    reference = reference_in_parent(tmp_path / "reference")
    for name, ref in reference.items():
        torch.testing.assert_close(resumed[name], ref, atol=2e-5, rtol=0, msg=f"resumed at world 1: {name}")
