"""Accelerate on Slipstream, unchanged: `Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=...))`
with Accelerate's ZeRO-2 and ZeRO-3 + offload templates (tests/fixtures/accelerate/; "auto" filled by Accelerate),
a custom loop with `accelerator.accumulate` over 2 micro-batches (Accelerate drives the accumulation boundary
itself: set_gradient_accumulation_boundary, backward() without step()), 2 gloo ranks, a tiny GPT-2. The trained
weights equal a single-process loop over the same global batches (AdamW, the config's WarmupDecayLR, clipping)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.compat_hf import hf_common as H
from tests.harness import run_distributed

pytestmark = pytest.mark.skipif(
    bool(H.missing_packages("accelerate", "transformers")),
    reason=H.missing_packages("accelerate", "transformers") or "",
)

TEMPLATES = Path(__file__).resolve().parents[1] / "fixtures" / "accelerate"
STEPS, GAS, MICRO, LR, WARMUP, CLIP = 4, 2, 2, 1e-2, 2, 1.0


def template(name: str) -> dict:
    config = json.loads((TEMPLATES / name).read_text())
    config["gradient_accumulation_steps"] = GAS  # the templates say 1; a user edits this line
    return config


def accelerate_run(rank: int, world: int, *, name: str) -> dict[str, Any]:
    H.rank_env(rank, world)
    H.use_slipstream_as_deepspeed()
    H.cpu_partial_state()
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.utils import DummyOptim, DummyScheduler

    plugin = DeepSpeedPlugin(
        hf_ds_config=template(name),
        gradient_accumulation_steps=GAS,
        gradient_clipping=CLIP,
        zero3_save_16bit_model=True,
    )
    accelerator = Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=GAS)
    model = H.tiny_gpt2()
    optimizer = DummyOptim(model.parameters(), lr=LR, weight_decay=0.0)
    # Accelerate divides total_num_steps by the number of processes before writing it into the config
    scheduler = DummyScheduler(optimizer, total_num_steps=STEPS * world, warmup_num_steps=WARMUP)
    loader = torch.utils.data.DataLoader(H.TokenDataset(n=STEPS * GAS * MICRO * world), batch_size=MICRO)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    losses = []
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(float(loss))
    return {
        "state": H.full_state(accelerator.unwrap_model(model)),
        "steps": model.global_steps,
        "batch": model.get_batch_info(),
    }


def reference(world: int) -> dict[str, torch.Tensor]:
    """The same loop in one process without DeepSpeed: batches of MICRO * world, the config's schedule."""
    from slipstream.engine.lr_schedules import WarmupDecayLR

    model = H.tiny_gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    schedule = WarmupDecayLR(
        optimizer, total_num_steps=STEPS, warmup_min_lr=0.0, warmup_max_lr=LR, warmup_num_steps=WARMUP
    )
    loader = torch.utils.data.DataLoader(H.TokenDataset(n=STEPS * GAS * MICRO * world), batch_size=MICRO * world)
    for i, batch in enumerate(loader):
        (model(**batch).loss / GAS).backward()
        if (i + 1) % GAS == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["zero_stage2_config.json", "zero_stage3_offload_config.json"])
def test_accelerate_template_with_accumulation(name: str) -> None:
    results = run_distributed(accelerate_run, world_size=2, timeout_s=300, name=name)
    assert results[0]["steps"] == STEPS and results[0]["batch"] == (MICRO * GAS * 2, MICRO, GAS)
    expected = reference(world=2)
    for key, ref in expected.items():
        torch.testing.assert_close(results[0]["state"][key], ref, atol=2e-5, rtol=0, msg=f"{name}: {key}")
        assert torch.equal(results[1]["state"][key], results[0]["state"][key]), f"{name}: ranks disagree on {key}"
    assert not math.isnan(float(expected["transformer.wte.weight"].sum()))
