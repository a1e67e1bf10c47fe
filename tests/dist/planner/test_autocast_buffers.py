"""The planner against the engine under `torch_autocast` with its default safe modules (Linear): at world size 2
and ZeRO 0-3, the per-rank bytes by role equal `engine.optimizer.owned_bytes()` within 5%, the communication
buffers included, which then hold the staging and receive buffers of both reduce dtypes (bf16 for the Linear
layers' gradients, fp32 for the embeddings' and layer norms'; [Note: reduction buffers by dtype] in
slipstream/planner/reduce_buffers.py)."""

from __future__ import annotations

import pytest

from tests.harness import run_distributed

ROLES = ("params", "master", "grads", "optimizer_state", "host_buffers", "comm_buffers")


CASES = [(0, True, False), (1, True, False), (2, True, False), (3, True, False), (3, False, False), (2, True, True),
         (3, True, True)]
"""(stage, overlap_comm, offload_optimizer): without overlap a ZeRO-3 unit's split buffers go back to the pool at
once; with CPU offload the buffers are the same."""


def _config(stage: int, overlap: bool, offload: bool) -> dict:
    zero: dict = {"offload_optimizer": {"device": "cpu", "pin_memory": False}} if offload else {}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "torch_autocast": {"enabled": True, "dtype": "bfloat16"},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 300, "stage3_param_persistence_threshold": 40,
                                  "stage3_prefetch_bucket_size": 5000, "overlap_comm": overlap, **zero}}


def grid(rank: int, world: int) -> list[dict]:
    import slipstream
    from slipstream.planner import estimate
    from tests.harness.models import TinyTransformer

    results = []
    for stage, overlap, offload in CASES:
        model = TinyTransformer()
        config = _config(stage, overlap, offload)
        predicted = estimate(model=model, ds_config=config, gpus_per_node=world).estimate_for("config")
        plain = {**config}
        plain.pop("torch_autocast")
        without = estimate(model=model, ds_config=plain, gpus_per_node=world).estimate_for("config")
        engine, *_ = slipstream.initialize(model=model, config=config)
        for seed in range(2):  # stage 3 sizes its pools from the second step on
            inputs, targets = model.make_batch(seed=seed, batch_size=2)
            engine.backward(TinyTransformer.loss(engine(inputs).float(), targets))
            engine.step()
        results.append({"case": (stage, overlap, offload), "owned": dict(engine.optimizer.owned_bytes()),
                        "predicted": dict(predicted.owned), "without": without.owned["comm_buffers"]})
        engine.destroy()
    return results


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_distributed(grid, world_size=2, tmp_dir=tmp_path_factory.mktemp("autocast"), timeout_s=240)[0]


@pytest.mark.parametrize("stage,overlap,offload", CASES)
def test_roles_match_owned_bytes(measured: list[dict], stage: int, overlap: bool, offload: bool) -> None:
    case = next(c for c in measured if tuple(c["case"]) == (stage, overlap, offload))
    owned, predicted = case["owned"], case["predicted"]
    print(f"ZeRO-{stage} overlap_comm {overlap} offload {offload}: " + ", ".join(f"{r} {predicted[r]}/{owned[r]}" for r in ROLES))
    for role in ROLES:
        assert predicted[role] == pytest.approx(owned[role], rel=0.05), (role, predicted[role], owned[role])
    assert owned["comm_buffers"] > 0
    # the bf16 buffers are what the autocast row adds: without torch_autocast the planner counts fewer
    assert predicted["comm_buffers"] != case["without"]
