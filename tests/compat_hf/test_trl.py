"""TRL's DPO and GRPO trainers on Slipstream at ZeRO-3, unchanged: 2 gloo ranks on CPU, a tiny Llama and a tiny
word-level tokenizer built and saved locally (no downloads). DPO builds its reference model with `from_pretrained`
while ZeRO-3 is on (so under zero.Init) and wraps it in a second engine with no optimizer (TRL's
`prepare_deepspeed`); GRPO generates its completions with `unwrap_model_for_generation` (no vLLM). Each run
trains a few steps to finite losses, and the policy's weights move while the reference model's stay as loaded.
Skips, naming the install command, when trl, transformers or accelerate is absent."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest

from tests.compat_hf import hf_common as H
from tests.harness import run_distributed

pytestmark = pytest.mark.skipif(
    bool(H.missing_packages("trl", "transformers", "accelerate", "datasets")),
    reason=H.missing_packages("trl", "transformers", "accelerate", "datasets") or "",
)

WORDS = [f"w{i}" for i in range(40)]
STEPS = 2


def save_tiny_llama(path: str) -> None:
    """A 2-layer Llama and a word-level tokenizer over WORDS, saved to `path` (what TRL loads by name)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{w: i + 4 for i, w in enumerate(WORDS)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,  # from_pretrained ties the head to the embedding under ZeRO-3
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def _sentence(gen: Any, n: int) -> str:
    return " ".join(WORDS[int(i)] for i in gen.integers(0, len(WORDS), n))


def preference_data(n: int = 16) -> Any:
    import numpy as np
    from datasets import Dataset

    gen = np.random.default_rng(0)
    rows = [{"prompt": _sentence(gen, 4), "chosen": _sentence(gen, 3), "rejected": _sentence(gen, 3)} for _ in range(n)]
    return Dataset.from_list(rows)


def prompt_data(n: int = 16) -> Any:
    import numpy as np
    from datasets import Dataset

    gen = np.random.default_rng(1)
    return Dataset.from_list([{"prompt": _sentence(gen, 4)} for _ in range(n)])


def word_sum(completions: list[str], **_: Any) -> list[float]:
    """GRPO's reward: the sum of the completion's word numbers ('w7' counts 7), so two sampled completions
    almost never tie and every group has an advantage to learn from."""
    return [float(sum(int(w[1:]) for w in c.split() if w[1:].isdigit())) for c in completions]


def _common_args(out: str) -> dict[str, Any]:
    ds = H.ds_config(3)
    return dict(
        output_dir=out,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        max_steps=STEPS,
        learning_rate=1e-2,
        seed=0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        dataloader_pin_memory=False,
        bf16=False,
        deepspeed=ds,
        accelerator_config={"use_configured_state": True},
    )


def dpo_run(rank: int, world: int, *, model_dir: str, out: str) -> dict[str, Any]:
    H.rank_env(rank, world)
    H.use_slipstream_as_deepspeed()
    H.cpu_partial_state()
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(**_common_args(out), max_length=16, beta=0.1)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = DPOTrainer(model=model_dir, args=args, train_dataset=preference_data(), processing_class=tokenizer)
    ref = trainer.ref_model  # TRL's prepare_deepspeed: an engine with no optimizer
    ref_before, policy_before = H.full_state(ref.module), H.full_state(trainer.model)
    trainer.train()
    return {
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "ref_engine": ref.optimizer is None and ref.module is not trainer.model,
        "ref_sharded": all(getattr(p, "ds_numel", None) is not None for p in ref.module.parameters()),
        "ref_unchanged": _same(ref_before, H.full_state(ref.module)),
        "ref_loaded": _same(ref_before, policy_before) and _holds_checkpoint(ref_before, model_dir),
        "policy_moved": not _same(policy_before, H.full_state(trainer.model)),
        "tied": trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight,
    }


def grpo_run(rank: int, world: int, *, model_dir: str, out: str) -> dict[str, Any]:
    H.rank_env(rank, world)
    H.use_slipstream_as_deepspeed()
    H.cpu_partial_state()
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        **_common_args(out), num_generations=2, max_completion_length=4, beta=0.1, use_vllm=False, temperature=1.0
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    trainer = GRPOTrainer(
        model=model_dir, reward_funcs=word_sum, args=args, train_dataset=prompt_data(), processing_class=tokenizer
    )
    policy_before = H.full_state(trainer.model)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {
        "losses": losses,
        "has_ref": trainer.ref_model is not None,
        "policy_moved": not _same(policy_before, H.full_state(trainer.model)),
    }


def _holds_checkpoint(state: dict[str, Any], model_dir: str) -> bool:
    """Every tensor saved in `model_dir` is the model's (from_pretrained under ZeRO-3 loaded it on every rank)."""
    import torch
    from safetensors.torch import load_file

    saved = load_file(os.path.join(model_dir, "model.safetensors"))
    return bool(saved) and all(torch.equal(state[k], v.float()) for k, v in saved.items())


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    save_tiny_llama(path)
    return path


def _check_losses(results: list[dict[str, Any]]) -> None:
    for result in results:
        assert len(result["losses"]) == STEPS, result
        assert all(math.isfinite(x) for x in result["losses"]), result
        assert result["policy_moved"], result


def test_dpo_zero3_reference_model(model_dir: str, tmp_path: Path) -> None:
    results = run_distributed(dpo_run, world_size=2, timeout_s=240, model_dir=model_dir, out=str(tmp_path / "dpo"))
    _check_losses(results)
    for result in results:
        assert result["ref_engine"] and result["ref_sharded"] and result["ref_unchanged"], result
        assert result["ref_loaded"] and result["tied"], result


def test_grpo_zero3(model_dir: str, tmp_path: Path) -> None:
    results = run_distributed(grpo_run, world_size=2, timeout_s=240, model_dir=model_dir, out=str(tmp_path / "grpo"))
    _check_losses(results)
    assert all(r["has_ref"] for r in results)
