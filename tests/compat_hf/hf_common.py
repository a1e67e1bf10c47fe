"""Shared pieces of the Transformers / Accelerate end-to-end tests: the `deepspeed` name, the rank environment,
a tiny GPT-2 built from a config, a deterministic dataset, and DeepSpeed configs."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

SHIM_DIR = str(Path(__file__).with_name("shim"))
INSTALL_HINT = 'pip install -e ".[compat-hf]" (or: make compat-hf)'


def missing_packages(*names: str) -> str | None:
    """A skip reason naming the absent packages and the install command, or None."""
    absent = [n for n in names if importlib.util.find_spec(n) is None]
    return f"{', '.join(absent)} not installed; install with: {INSTALL_HINT}" if absent else None


def use_slipstream_as_deepspeed() -> None:
    """Make `import deepspeed` give Slipstream: the installed compat distribution if there is one, otherwise the
    same file from shim/. Refuses a real DeepSpeed. Nothing is filled in: a name Slipstream lacks fails."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or (spec.origin and spec.origin.startswith(SHIM_DIR)):
        if SHIM_DIR not in sys.path:
            sys.path.insert(0, SHIM_DIR)
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SHIM_DIR, os.environ.get("PYTHONPATH")) if p)
        importlib.invalidate_caches()
    import deepspeed

    if not getattr(deepspeed, "__slipstream__", False):
        raise RuntimeError(
            f"`import deepspeed` gives {deepspeed.__file__}, not Slipstream; these tests need Slipstream"
        )


def rank_env(rank: int, world: int) -> None:
    """The launcher variables Accelerate reads (the harness's ranks meet through a FileStore and have none)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        ACCELERATE_USE_DEEPSPEED="true",
        TOKENIZERS_PARALLELISM="false",
        WANDB_DISABLED="true",
    )


def cpu_partial_state() -> Any:
    """On a machine without an accelerator, Accelerate finds no distributed backend for DeepSpeed and counts one
    process (Transformers does not pass `ddp_backend` when `deepspeed=` is set); the shared state made here first,
    with gloo, is the one TrainingArguments and Accelerator then reuse. A user on CPU writes the same line."""
    from accelerate.state import PartialState

    return PartialState(backend="gloo")


def allow_cpu_bf16() -> None:
    """TrainingArguments(bf16=True) is refused on a machine without a bf16 GPU unless use_cpu=True, and use_cpu
    turns DeepSpeed off, so a Trainer cannot ask for DeepSpeed bf16 on CPU (with DeepSpeed or Slipstream; a bare
    "bfloat16" section is overridden by the "bf16": false that Accelerate then writes). The CPU tests lift that
    device check; on a GPU it is not needed."""
    import transformers.training_args

    transformers.training_args.is_torch_bf16_gpu_available = lambda *a, **k: True


def tiny_gpt2_config() -> Any:
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=61,
        n_positions=32,
        n_embd=24,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def tiny_gpt2(seed: int = 0) -> Any:
    import torch
    from transformers import GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(tiny_gpt2_config())


class TokenDataset:
    """`n` deterministic sequences of `length` tokens; labels are the inputs (causal LM)."""

    def __init__(self, n: int = 32, length: int = 16, seed: int = 7) -> None:
        import torch

        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, 61, (n, length), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def ds_config(stage: int, *, offload: bool = False, bf16: bool = False, **extra: Any) -> dict:
    """A Trainer-style config: the batch triple and clipping "auto" (the Trainer fills them), no optimizer or
    scheduler section (the Trainer's AdamW and linear schedule, as in the single-process reference)."""
    zero: dict[str, Any] = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_gather_16bit_weights_on_model_save=True)
    cfg: dict[str, Any] = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero,
    }
    if bf16:
        cfg["bf16"] = {"enabled": "auto"}  # TrainingArguments(bf16=True) fills it (see allow_cpu_bf16)
    cfg.update(extra)
    return cfg


def training_args(
    out: str, *, world: int, ds: dict | None, steps: int = 4, global_micro: int = 4, gas: int = 2, **extra: Any
) -> Any:
    """The same run at any world size: `global_micro` samples per micro-step across the ranks."""
    from transformers import TrainingArguments

    kwargs: dict[str, Any] = dict(
        output_dir=out,
        per_device_train_batch_size=global_micro // world,
        gradient_accumulation_steps=gas,
        max_steps=steps,
        learning_rate=1e-2,
        warmup_steps=0,
        lr_scheduler_type="linear",
        seed=0,
        data_seed=0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    if ds is None:
        kwargs["use_cpu"] = True
    else:
        kwargs.update(deepspeed=ds, accelerator_config={"use_configured_state": True})
    kwargs.update(extra)
    return TrainingArguments(**kwargs)


def full_state(model: Any) -> dict[str, Any]:
    """Every parameter in full (gathered at ZeRO-3), fp32, on CPU, by name."""
    import deepspeed
    import torch

    params = dict(model.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
        return {n: p.detach().to(torch.float32).clone() for n, p in params.items()}
