"""ZeRO++ quantized weights at stage 3 on two ranks (zero/quantized.py): with `zero_quantized_weights` the
forward's all-gathers carry about a quarter of the bytes and the weights the forward sees are within half a
quantization step of the exact ones (not equal: they did travel quantized), training stays within a bound of
the exact run, and the exact gathers (GatheredParameters) stay exact; with `zero_quantized_nontrainable_weights`
only the frozen layer's gathers are quantized. One spawn runs every case."""

from __future__ import annotations

import torch

from tests.harness import run_distributed, run_subtests
from tests.harness.models import TinyMLP

MICRO = 4
CASES = [{"mode": "exact"}, {"mode": "weights"}, {"mode": "frozen"}]


def _engine(mode: str):  # type: ignore[no-untyped-def]
    import slipstream

    model = TinyMLP(hidden=300)  # 3900 x 4-byte weights per shard: several blocks, a partial last one
    if mode == "frozen":
        model.layers[0].requires_grad_(False)
    zero = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "zero_quantized_weights": mode == "weights",
        "zero_quantized_nontrainable_weights": mode == "frozen",
    }
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0, "zero_optimization": zero}
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = slipstream.initialize(model=model, optimizer=torch.optim.AdamW(params, lr=1e-3), config=config)
    return engine


def quantized_case(rank: int, world: int, *, mode: str) -> dict:
    import slipstream
    from slipstream.comm import count_collectives

    engine = _engine(mode)
    layers = list(engine.module.layers)
    with slipstream.zero.GatheredParameters(list(engine.module.parameters())):
        exact_initial = [layer.weight.detach().clone() for layer in layers]
    seen: list[torch.Tensor] = []
    hooks = [layer.register_forward_pre_hook(lambda m, a: seen.append(m.weight.detach().clone())) for layer in layers]
    losses, gathered = [], 0
    for step in range(3):
        x, y = TinyMLP(hidden=300).make_batch(seed=10 * step + rank, batch_size=MICRO)
        with count_collectives() as counter:
            loss = TinyMLP.loss(engine(x), y)
        gathered += counter.bytes["all_gather"] if step == 0 else 0
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    for hook in hooks:
        hook.remove()
    engine.destroy()
    return {"exact_initial": exact_initial, "first_forward": seen[:3], "losses": losses, "gathered": gathered}


def grid(rank: int, world: int) -> list[dict]:
    return run_subtests(CASES, lambda **case: quantized_case(rank, world, **case))


def _within_half_a_step(seen: torch.Tensor, exact: torch.Tensor) -> bool:
    """Every element within half a quantization step of a block holding at most the tensor's largest magnitude."""
    return bool(((seen - exact).abs() <= exact.abs().max() / 255 * (1 + 1e-4)).all())


def test_quantized_weight_gathers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    reference = TinyMLP(hidden=300)
    for rank, (exact, weights, frozen) in enumerate(run_distributed(grid, world_size=2, tmp_dir=tmp_path)):
        for case in (exact, weights, frozen):  # the exact gathers are exact whatever the mode
            for got, layer in zip(case["exact_initial"], reference.layers):
                assert torch.equal(got, layer.weight.detach()), f"rank {rank}: GatheredParameters was not exact"
        for seen, layer in zip(exact["first_forward"], reference.layers):
            assert torch.equal(seen, layer.weight.detach())
        for index, (seen, layer) in enumerate(zip(weights["first_forward"], reference.layers)):
            want = layer.weight.detach()
            assert not torch.equal(seen, want), f"rank {rank} layer {index}: the gather was not quantized"
            assert _within_half_a_step(seen, want), f"rank {rank} layer {index}: off by more than half a step"
        assert weights["gathered"] < 0.3 * exact["gathered"], (weights["gathered"], exact["gathered"])
        torch.testing.assert_close(weights["losses"], exact["losses"], rtol=2e-2, atol=0)
        assert weights["losses"] != exact["losses"]
        first, *rest = frozen["first_forward"]
        assert not torch.equal(first, reference.layers[0].weight.detach()), "the frozen layer's gather was exact"
        assert _within_half_a_step(first, reference.layers[0].weight.detach())
        for seen, layer in zip(rest, reference.layers[1:]):
            assert torch.equal(seen, layer.weight.detach()), f"rank {rank}: a trainable layer's gather was quantized"
