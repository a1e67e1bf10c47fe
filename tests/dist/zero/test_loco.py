"""ZeRO++ LoCo (`zeropp_loco_param`): qgZ's quantizations error-compensated (zero/stage3/loco.py).

The reducer (zero/stage3/quantized_reduce.py with a KeptErrors) against LoCo's definition, written out here in plain
torch, over REDUCTIONS reductions of changing gradients: per rank and piece sent to another rank, c = x + e, send
quantize(c), keep e <- int8(b e + (1 - b)(c - dequantize(quantize(c)))), e zeroed before every reset_T-th
reduction; a rank's piece for itself is exact and keeps no error. At 2 ranks
(one node: the int4 phase) and at 4 ranks as 2 nodes x 2 (both phases; run in test_mics_hierarchical.py's spawn).
Each reduction stays within qgZ's bound of the fp32 sum (the quantization's half-scale of c, plus the kept error
that c carries); the error accumulated over the reductions is measured with and without LoCo and must be smaller
with it. Through the engine at 2 ranks: the first step equals plain qgZ's (nothing is kept yet), later ones do
not, the losses stay within 2% of the exact run's, and the kept errors are the bytes the planner counts.
"""

from __future__ import annotations

import os

import torch

from tests.dist.zero.test_quantized_reduce import _dequantized, _in_order_sum
from tests.harness import run_distributed
from tests.harness.models import TinyMLP

WIDTH, REDUCTIONS, BETA, RESET = 300, 7, 0.8, 3
DRIFT_REDUCTIONS = 16
"""The drift is measured over this many reductions with reset_T 1024 (no reset among them)."""
MICRO, LR, HIDDEN, STEPS = 4, 0.05, 300, 3


def gradients(rank: int, world: int, step: int) -> torch.Tensor:
    """Rank `rank`'s staging rows at reduction `step`: a fixed pattern plus a smaller part that changes."""
    fixed = torch.randn(world * WIDTH, generator=torch.Generator().manual_seed(rank))
    moving = torch.randn(world * WIDTH, generator=torch.Generator().manual_seed(100 * step + rank + 7))
    return fixed + 0.3 * moving


def reduce_with(rank: int, world: int, reset: int | None, count: int) -> list[torch.Tensor]:
    """`count` reductions through the reducer, with LoCo resetting every `reset` (None: plain qgZ)."""
    from slipstream.config.plan import LocoPlan
    from slipstream.zero.stage3.loco import KeptErrors
    from slipstream.zero.stage3.pool import BufferPool
    from slipstream.zero.stage3.quantized_reduce import QuantizedReduceScatter, node_levels

    pool = BufferPool(torch.device("cpu"))
    kept = None if reset is None else KeptErrors(LocoPlan(err_beta=BETA, reset_every=reset), pool)
    reducer = QuantizedReduceScatter(node_levels(None), pool, kept)
    out = []
    for step in range(count):
        receive = torch.full((WIDTH,), float("nan"))
        reducer.launch(receive, gradients(rank, world, step)).wait()
        out.append(receive)
    return out


def reducer_case(rank: int, world: int) -> dict:
    return {
        "loco": reduce_with(rank, world, RESET, REDUCTIONS),
        "drift": reduce_with(rank, world, 1024, DRIFT_REDUCTIONS),
        "plain": reduce_with(rank, world, None, DRIFT_REDUCTIONS),
    }


class Definition:
    """LoCo by its definition: each rank's kept error per (phase, sender, piece)."""

    def __init__(self) -> None:
        self.kept: dict[tuple[str, int, int], torch.Tensor] = {}

    def send(
        self, key: tuple[str, int, int], x: torch.Tensor, bits: int, step: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What the sender sends for a piece, dequantize(quantize(x + e)) with e updated, and how far it may be
        from x: half a quantization step of c's block (absmax / (2 L)) plus the kept error it carried."""
        e = self.kept.get(key, torch.zeros_like(x))
        if step % RESET == 0:
            e = torch.zeros_like(x)
        c = x + e
        sent = _dequantized(c, bits)
        self.kept[key] = _dequantized(e * BETA + (1 - BETA) * (c - sent), 8)
        return sent, _half_step(c, bits) + e.abs()


def _half_step(c: torch.Tensor, bits: int) -> torch.Tensor:
    """Per element: half the quantization step of its block of 256 (the block's absmax / (2^bits - 1))."""
    flat = torch.zeros(-(-c.numel() // 256) * 256)
    flat[: c.numel()] = c.reshape(-1).abs()
    blocks = flat.view(-1, 256).amax(dim=1, keepdim=True).expand(-1, 256) / (2.0**bits - 1)
    return blocks.reshape(-1)[: c.numel()].view(c.shape) * (1 + 1e-4) + 1e-7


def expected(world: int, local: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Every reduction's (result, bound on its distance from the fp32 sum) on every rank, by the definition
    (rows as in test_quantized_reduce.expected; the bounds add up each sender's)."""
    nodes, loco, out = world // local, Definition(), []
    for step in range(REDUCTIONS):
        rows = [gradients(r, world, step).view(nodes, local, WIDTH) for r in range(world)]
        inner = {}
        for m in range(nodes):
            for pos in range(local):
                pieces = [(rows[m * local + s][:, pos], torch.zeros(nodes, WIDTH)) for s in range(local)]
                if local > 1:
                    pieces = [
                        (p, b) if s == pos else loco.send(("within", m * local + s, pos), p, 4, step)
                        for s, (p, b) in enumerate(pieces)
                    ]
                inner[(m, pos)] = (_in_order_sum([p for p, _ in pieces]), sum(b for _, b in pieces))
        results = []
        for rank in range(world):
            m, pos = divmod(rank, local)
            pieces = [(inner[(src, pos)][0][m], inner[(src, pos)][1][m]) for src in range(nodes)]
            if nodes > 1:
                sent = [
                    (p, torch.zeros_like(p)) if src == m else loco.send(("across", src * local + pos, m), p, 8, step)
                    for src, (p, _) in enumerate(pieces)
                ]
                pieces = [(value, bound + pieces[src][1]) for src, (value, bound) in enumerate(sent)]
            results.append((_in_order_sum([p for p, _ in pieces]), sum(b for _, b in pieces)))
        out.append(results)
    return out


def check_reducer(world: int, local: int, results: list[dict]) -> None:
    want = expected(world, local)
    for step in range(REDUCTIONS):
        exact = sum(gradients(r, world, step).view(world, WIDTH) for r in range(world))
        for rank, result in enumerate(results):
            got, (defined, bound) = result["loco"][step], want[step][rank]
            case = f"{world} ranks, {local} per node, rank {rank}, reduction {step}"
            assert torch.allclose(got, defined, rtol=0, atol=1e-6), f"{case}: {(got - defined).abs().max()} off"
            assert bool(((got - exact[rank]).abs() <= bound).all()), f"{case}: past the bound"
    drift = {"drift": torch.zeros(world, WIDTH), "plain": torch.zeros(world, WIDTH)}
    for step in range(DRIFT_REDUCTIONS):  # the sums' error accumulated over the reductions, as SGD accumulates it
        exact = sum(gradients(r, world, step).view(world, WIDTH) for r in range(world))
        for rank, result in enumerate(results):
            for name, total in drift.items():
                total[rank] += result[name][step] - exact[rank]
    loco, plain = float(drift["drift"].norm()), float(drift["plain"].norm())
    assert loco < 0.6 * plain, f"{world} ranks, {local} per node: accumulated error {loco} with LoCo, {plain} without"


def engine_case(rank: int, world: int) -> dict:
    from slipstream.zero.stage3.loco import KeptErrors

    out: dict = {}
    for name, zero in (
        ("exact", {}),
        ("qgz", {"zero_quantized_gradients": True}),
        ("loco", {"zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": BETA, "reset_T": 1024}}),
    ):
        engine = _engine(zero)
        params, losses = [], []
        for step in range(STEPS):
            x, y = TinyMLP(hidden=HIDDEN).make_batch(seed=10 * step + rank, batch_size=MICRO)
            loss = TinyMLP.loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
            params.append(engine.zero_model.full_state(only_rank0=False))
        reducers = [u.quantized_reduce for u in engine.zero_model.units if u.quantized_reduce is not None]
        kept = sum(r.loco.nbytes for r in reducers if isinstance(r.loco, KeptErrors))
        owned = engine.zero_model.owned_bytes()["comm_buffers"] - engine.zero_model.pool.allocated_bytes
        out[name] = {"losses": losses, "params": params, "kept_bytes": kept, "owned_kept": owned}
        engine.destroy()
    return out


def _engine(zero: dict):  # type: ignore[no-untyped-def]
    import slipstream

    model = TinyMLP(hidden=HIDDEN)
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }
    engine, *_ = slipstream.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), config=config)
    return engine


def two_ranks(rank: int, world: int) -> dict:
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    return {"reducer": reducer_case(rank, world), "engine": engine_case(rank, world)}


def planned_kept_bytes(world: int) -> int:
    """What LoCo adds to the planner's stage-3 comm buffers for the test's model (fp32, one node)."""
    from slipstream.config.plan import LocoPlan
    from slipstream.config.zero_plans import default_stage3_plan
    from slipstream.planner.shapes import from_module
    from slipstream.planner.types import Settings
    from slipstream.planner.zero_bytes import stage3_bytes

    units = from_module(TinyMLP(hidden=HIDDEN)).units(0, (), (), ())
    comm = []
    for loco in (None, LocoPlan(err_beta=BETA, reset_every=1024)):
        stage3 = default_stage3_plan(persistence_threshold=0, quantized_gradients=True, loco=loco)
        figures, _ = stage3_bytes(
            units, world=world, settings=Settings(dtype="fp32", stage3=stage3), offload=False, offload_param=False
        )
        comm.append(figures.owned["comm_buffers"])
    return comm[1] - comm[0]


def test_loco_equals_its_definition_and_drifts_less_than_qgz(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = run_distributed(two_ranks, world_size=2, tmp_dir=tmp_path, timeout_s=240)
    check_reducer(2, 2, [r["reducer"] for r in results])
    for rank, result in enumerate(results):
        exact, qgz, loco = result["engine"]["exact"], result["engine"]["qgz"], result["engine"]["loco"]
        for name, value in qgz["params"][0].items():  # nothing kept before the first reduction
            assert torch.equal(loco["params"][0][name], value), f"rank {rank} {name}: LoCo's first step is not qgZ's"
        assert any(not torch.equal(loco["params"][-1][n], v) for n, v in qgz["params"][-1].items())
        torch.testing.assert_close(loco["losses"], exact["losses"], rtol=2e-2, atol=0)
        assert qgz["kept_bytes"] == 0
        assert loco["kept_bytes"] == planned_kept_bytes(2) > 0, (loco["kept_bytes"], planned_kept_bytes(2))
        assert loco["owned_kept"] == loco["kept_bytes"]  # owned_bytes() counts them with the comm buffers
