"""Lightning's DeepSpeed strategy on CPU: Lightning 2.6 refuses it on any accelerator but CUDA, before
DeepSpeed is called, so it cannot run here with DeepSpeed or with Slipstream (docs/deepspeed-compat.md). This test
pins that fact: when a Lightning release lifts the refusal it fails, and a real 2-rank Lightning test belongs here
(on a GPU machine: `strategy="deepspeed_stage_2"` with `import deepspeed` giving Slipstream)."""

from __future__ import annotations

import pytest

from tests.compat_hf import hf_common as H

pytestmark = pytest.mark.skipif(
    bool(H.missing_packages("lightning")),
    reason=(H.missing_packages("lightning") or "").replace(H.INSTALL_HINT, "pip install lightning"),
)


def test_lightning_deepspeed_strategy_refuses_cpu() -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(stage=2)  # finds `deepspeed` (Slipstream) by its distribution metadata
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_checkpointing=False)
    with pytest.raises(RuntimeError, match="only supported on CUDA GPUs"):
        trainer.strategy.setup_environment()
