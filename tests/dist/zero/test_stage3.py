"""ZeRO stage 3 at world size 2 against the single-process reference: parameters after 5 optimizer steps,
with and without accumulation, both backward styles, optimizer and parameter offload, bf16, weight tying
and a block reused in a loop. One spawn runs the whole grid (tests/harness/subtests.py)."""

from __future__ import annotations

import torch

from tests.dist.engine.test_engine_parity import LR, STEPS, global_batches
from tests.dist.zero.stage3_models import CheckpointedTransformer, TiedLoopLM
from tests.harness import run_distributed
from tests.harness.models import TinyMLP, TinyTransformer
from tests.harness.reference import train_reference

MODELS = {"mlp": TinyMLP, "transformer": TinyTransformer, "tied": TiedLoopLM, "checkpointed": CheckpointedTransformer}


def batches(model: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if model == "mlp":
        return global_batches()
    return [MODELS[model]().make_batch(seed=500 + s, batch_size=8) for s in range(STEPS)]


def stage3_config(micro: int, gas: int, *, threshold: int = 0, precision: str = "fp32", **zero: object) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "bf16": {"enabled": precision == "bf16"},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold,
                                  "stage3_prefetch_bucket_size": 2000, **zero}}


def train(rank: int, world: int, *, model: str, micro: int, gas: int, torch_style: bool, stage: int = 3,
          **options: object) -> dict[str, torch.Tensor]:
    import slipstream

    config = stage3_config(micro, gas, **options)  # type: ignore[arg-type]
    config["zero_optimization"]["stage"] = stage
    engine, *_ = slipstream.initialize(model=MODELS[model](), config=config)
    cls = MODELS[model]
    for inputs, targets in batches(model):
        for m in range(gas):
            start = (m * world + rank) * micro
            loss = cls.loss(engine(inputs[start:start + micro]).float(), targets[start:start + micro])
            if torch_style:
                loss.backward()
            else:
                engine.backward(loss)
            engine.step()
    if stage == 3:
        state = engine.zero_model.full_state(only_rank0=False)
    else:
        state = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return {name: value.float() for name, value in state.items()}


CASES = [
    dict(model="mlp", micro=2, gas=2, torch_style=False),
    dict(model="mlp", micro=4, gas=1, torch_style=True),
    dict(model="mlp", micro=2, gas=2, torch_style=True, threshold=20),  # biases persistent
    dict(model="transformer", micro=2, gas=2, torch_style=False, threshold=30),
    dict(model="tied", micro=4, gas=1, torch_style=True),
    dict(model="checkpointed", micro=2, gas=2, torch_style=False, threshold=30),
    dict(model="mlp", micro=2, gas=2, torch_style=False, offload_optimizer={"device": "cpu"}),
    dict(model="mlp", micro=2, gas=2, torch_style=False, stage=1, offload_optimizer={"device": "cpu"}),
    dict(model="mlp", micro=2, gas=2, torch_style=False, stage=2, offload_optimizer={"device": "cpu"}),
    dict(model="mlp", micro=4, gas=1, torch_style=False, offload_optimizer={"device": "cpu", "pin_memory": True},
         offload_param={"device": "cpu", "pin_memory": True}),
    dict(model="mlp", micro=2, gas=2, torch_style=False, precision="bf16"),
]


def grid(rank: int, world: int) -> list[dict[str, torch.Tensor]]:
    return [train(rank, world, **case) for case in CASES]  # type: ignore[arg-type]


def test_stage3_matches_the_reference(tmp_path) -> None:  # type: ignore[no-untyped-def]
    references = {}
    for model in MODELS:
        _, references[model] = train_reference(MODELS[model], batches(model), lr=LR, steps=STEPS, optimizer="adamw",
                                               weight_decay=0.01, grad_clip=1.0)
    per_rank = run_distributed(grid, world_size=2, tmp_dir=tmp_path, timeout_s=240)
    for rank, results in enumerate(per_rank):
        assert len(results) == len(CASES)
        for case, result in zip(CASES, results):
            reference = references[str(case["model"])]
            names = set(reference) - ({"head.weight"} if case["model"] == "tied" else set())
            assert names <= set(result), (case, sorted(set(reference) - set(result)))
            bf16 = case.get("precision") == "bf16"
            for name in names:
                got, want = result[name], reference[name]
                if name.endswith("qkv.bias"):  # the key bias gets a zero gradient (softmax is shift-invariant), so
                    keep = torch.ones_like(want, dtype=torch.bool)  # Adam amplifies rounding noise there: skip it
                    keep[want.numel() // 3: 2 * want.numel() // 3] = False
                    got, want = got[keep], want[keep]
                torch.testing.assert_close(got, want, rtol=3e-2 if bf16 else 2e-5,
                                           atol=3e-2 if bf16 else 2e-6,
                                           msg=lambda m, case=case, name=name, rank=rank: f"rank {rank} {case} {name}: {m}")
