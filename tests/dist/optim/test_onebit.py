"""The 1-bit optimizers and their compressed all-reduce on gloo, 2 ranks, in one spawn.

- The all-reduce (comm/compressed/onebit.py) equals its definition, written out here independently (signs, one
  scale per chunk, worker and server errors), bit for bit over three calls, and the bytes it hands the
  collectives are counted.
- During warm-up OneBitAdam and ZeroOneAdam equal uncorrected Adam (UncorrectedAdamW below) through
  the engine: same parameters on every rank.
- A compressed step gets the rank's own gradient (its norm), and no gradient all-reduce.
- After warm-up a short run's loss stays within a bound of Adam's, and the ranks' parameters stay equal; bf16 and
  fp16 train through compressed steps.
- optimizer.state_dict() carries the error buffers and their world size; an engine checkpoint resumes exactly.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from tests.harness import run_distributed
from tests.harness.models import TinyMLP

WARMUP_STEPS = 12
STEPS = 36
LR = 5e-3


def reference_all_reduce(
    values: list[torch.Tensor], worker: list[torch.Tensor], server: list[torch.Tensor]
) -> torch.Tensor:
    """The 1-bit error-compensated mean of `values` (one tensor per rank), updating the errors in place."""
    world, numel = len(values), values[0].numel()
    padded = math.ceil(numel / (8 * world)) * 8 * world
    chunk = padded // world
    sent = []
    for rank in range(world):
        x = torch.zeros(padded)
        x[:numel] = values[rank]
        rows = (x + worker[rank]).view(world, chunk)
        scale = torch.linalg.vector_norm(rows, dim=1, keepdim=True) / math.sqrt(chunk)
        signs = torch.where(rows >= 0, 1.0, -1.0)
        worker[rank].copy_((rows - scale * signs).view(-1))
        sent.append(scale * signs)
    out = []
    for j in range(world):
        y = torch.stack([sent[rank][j] for rank in range(world)]).mean(dim=0) + server[j]
        scale = torch.linalg.vector_norm(y.view(1, -1), dim=1, keepdim=True).view(1) / math.sqrt(chunk)
        signs = torch.where(y >= 0, 1.0, -1.0)
        server[j].copy_(y - scale * signs)
        out.append(scale * signs)
    return torch.cat(out)[:numel]


def check_all_reduce(rank: int, world: int) -> None:
    from slipstream.comm import count_collectives
    from slipstream.comm.compressed import OneBitAllReduce, Scratch, padded_numel

    # 37 is padded to 48 at world 2 (3 bytes of signs and 4 of scale per chunk); 48 needs no padding, and the
    # result is written straight into the tensor. Both share one Scratch, their calls interleaved.
    scratch = Scratch.allocate(padded_numel(48, world), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="given a Scratch of 48 torch.float32.*Scratch.allocate"):
        OneBitAllReduce(49, dtype=torch.float32, device=torch.device("cpu"), scratch=scratch)
    cases = {}
    for numel in (37, 48):
        reduce = OneBitAllReduce(numel, dtype=torch.float32, device=torch.device("cpu"), scratch=scratch)
        cases[numel] = (
            reduce,
            [torch.zeros(reduce.padded_numel) for _ in range(world)],
            [torch.zeros(reduce.chunk_numel) for _ in range(world)],
        )
    for call in range(3):
        for numel, (reduce, worker, server) in cases.items():
            values = [torch.randn(numel, generator=torch.Generator().manual_seed(10 * call + r)) for r in range(world)]
            expected = reference_all_reduce(values, worker, server)
            mine = values[rank].clone()
            with count_collectives() as counted:
                reduce(mine)
            assert torch.equal(mine, expected), f"{numel} elements, call {call}: {mine} != {expected}"
            assert torch.equal(reduce.worker_error, worker[rank]), f"{numel} elements, call {call}: worker error"
            assert torch.equal(reduce.server_error, server[rank]), f"{numel} elements, call {call}: server error"
            row_bytes = reduce.chunk_numel // 8 + 4
            assert dict(counted.bytes) == {"all_to_all": world * row_bytes, "all_gather": world * row_bytes}
            assert reduce.wire_bytes() == 2 * world * row_bytes


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    model = TinyMLP()
    return [model.make_batch(seed=200 + step, batch_size=8) for step in range(STEPS)]


class UncorrectedAdamW(torch.optim.Optimizer):
    """Adam as 1-bit Adam's warm-up defines it: m / (sqrt(v) + eps) + weight_decay * p, no bias correction."""

    def __init__(self, params: object, lr: float, weight_decay: float = 0.01) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "betas": (0.9, 0.999), "eps": 1e-8})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["m"], state["v"] = torch.zeros_like(p), torch.zeros_like(p)
                state["m"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["v"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                update = state["m"] / (state["v"].sqrt() + group["eps"]) + group["weight_decay"] * p
                p.sub_(update, alpha=group["lr"])


def train(rank: int, world: int, optimizer: dict | None, *, steps: int, precision: dict | None = None) -> dict:
    """`steps` engine steps of TinyMLP at ZeRO 0 (4 rows per rank) with the config's `optimizer`, or
    UncorrectedAdamW when None; the losses, the final parameters, and the collectives of the last step."""
    import slipstream
    from slipstream.comm import count_collectives

    config = {"train_micro_batch_size_per_gpu": 4, **(precision or {})}
    client = None
    if optimizer is None:
        config["zero_allow_untested_optimizer"] = True
        client = lambda params: UncorrectedAdamW(params, lr=LR)  # noqa: E731
    else:
        config["optimizer"] = optimizer
    engine, _, _, _ = slipstream.initialize(model=TinyMLP(), optimizer=client, config=config)
    losses, norms = [], []
    for inputs, targets in batches()[:steps]:
        x, y = inputs[4 * rank : 4 * rank + 4], targets[4 * rank : 4 * rank + 4]
        with count_collectives() as counted:
            engine.backward(TinyMLP.loss(engine(x), y))
            engine.step()
        losses.append(engine.last_loss)
        norms.append(engine.get_global_grad_norm())
    params = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
    engine.destroy()
    return {"losses": losses, "norms": norms, "params": params, "last_step": dict(counted.bytes)}


def onebit(kind: str, **params: object) -> dict:
    return {"type": kind, "params": {"lr": LR, "weight_decay": 0.01, "comm_backend_name": "gloo", **params}}


def check_warmup(rank: int, world: int) -> None:
    """Within warm-up both equal uncorrected Adam, and the gradients are all-reduced as Adam's are."""
    reference = train(rank, world, None, steps=WARMUP_STEPS)
    for kind, params in (("OneBitAdam", {"freeze_step": 100}), ("ZeroOneAdam", {"var_freeze_step": 100})):
        mine = train(rank, world, onebit(kind, **params), steps=WARMUP_STEPS)
        torch.testing.assert_close(mine["params"], reference["params"], rtol=1e-6, atol=1e-7, msg=kind)
        assert mine["losses"] == reference["losses"], kind
        assert mine["last_step"] == reference["last_step"], kind


def check_local_gradients(rank: int, world: int) -> None:
    """A compressed step gets this rank's own gradient: its norm is that of the rank's rows alone."""
    model = TinyMLP()
    inputs, targets = batches()[0]
    TinyMLP.loss(model(inputs[4 * rank : 4 * rank + 4]), targets[4 * rank : 4 * rank + 4]).backward()
    local = float(torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in model.parameters()])))
    norms = train(rank, world, onebit("OneBitAdam", freeze_step=0), steps=1)["norms"]
    assert math.isclose(norms[0], local, rel_tol=1e-5), (norms, local)


def check_after_warmup(rank: int, world: int) -> None:
    """Compressed steps: the loss follows Adam's within a bound; no gradient all-reduce, 1-bit bytes only."""
    import torch.distributed as dist

    reference = train(rank, world, None, steps=STEPS)
    runs = {
        "OneBitAdam": onebit("OneBitAdam", freeze_step=WARMUP_STEPS),
        "ZeroOneAdam": onebit(
            "ZeroOneAdam", var_freeze_step=WARMUP_STEPS, var_update_scaler=4, local_step_scaler=4, local_step_clipper=4
        ),
    }
    for kind, optimizer in runs.items():
        mine = train(rank, world, optimizer, steps=STEPS)
        first, last, adam_last = mine["losses"][0], mine["losses"][-1], reference["losses"][-1]
        bound = 1.5 if kind == "OneBitAdam" else 3.0  # 0/1 Adam's stale variance costs more on a model this small
        assert last < 0.5 * first and last < bound * adam_last, f"{kind}: losses {mine['losses']} vs Adam's {adam_last}"
        grad_bytes = sum(p.numel() * 4 for p in TinyMLP().parameters())
        assert mine["last_step"].get("all_reduce", 0) < 64, f"{kind}: {mine['last_step']}"  # the loss only
        assert 0 < mine["last_step"].get("all_to_all", 0) < grad_bytes / 16, f"{kind}: {mine['last_step']}"
        if kind == "OneBitAdam":  # every rank holds the same momentum and variance: the same parameters
            gathered = [torch.empty_like(mine["params"]) for _ in range(world)]
            dist.all_gather(gathered, mine["params"])
            assert torch.equal(gathered[0], gathered[1])


def check_low_precision(rank: int, world: int) -> None:
    """bf16 and fp16 (loss scaling) train through the compressed steps too."""
    for precision, kind, params in (
        ({"bf16": {"enabled": True}}, "OneBitAdam", {"freeze_step": WARMUP_STEPS}),
        ({"fp16": {"enabled": True, "initial_scale_power": 8}}, "ZeroOneAdam", {"var_freeze_step": 4}),
    ):
        losses = train(rank, world, onebit(kind, **params), steps=STEPS, precision=precision)["losses"]
        assert all(math.isfinite(x) for x in losses) and losses[-1] < 0.5 * losses[0], (kind, precision, losses)


def compressed_steps(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter, *, rank: int, steps: int) -> None:
    for step in range(steps):
        param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(100 * step + rank))
        optimizer.step()


def check_error_buffers_in_state_dict(rank: int, world: int) -> None:
    """state_dict holds the errors: a copy loaded at the same world size steps exactly as the original; loaded
    with another world size recorded, its errors restart from zero (and a line is logged)."""
    import logging

    from slipstream.optim.onebit import OneBitAdam
    from slipstream.utils.logging import get_logger

    def fresh() -> tuple[OneBitAdam, torch.nn.Parameter]:
        param = torch.nn.Parameter(torch.linspace(-1, 1, 29))
        optimizer = OneBitAdam([param], lr=0.01, freeze_step=1, comm_backend_name="gloo")
        optimizer.takes_over_reduction(None)
        return optimizer, param

    original, param = fresh()
    compressed_steps(original, param, rank=rank, steps=4)
    saved = copy.deepcopy(original.state_dict())  # its tensors are the optimizer's own, as torch's are
    assert (
        saved["onebit_errors"]["world_size"] == world
        and saved["onebit_errors"]["buffers"]["0.0.worker"].abs().sum() > 0
    )
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())  # type: ignore[method-assign]
    get_logger().addHandler(handler)
    try:
        for recorded_world, same in ((world, True), (world + 1, False)):
            loaded, copied = fresh()
            with torch.no_grad():
                copied.copy_(param)
            saved["onebit_errors"]["world_size"] = recorded_world
            loaded.load_state_dict(copy.deepcopy(saved))
            reference, ref_param = (original, param) if same else fresh()
            if not same:
                reference.load_state_dict(copy.deepcopy({k: v for k, v in saved.items() if k != "onebit_errors"}))
                with torch.no_grad():
                    ref_param.copy_(param)
            compressed_steps(loaded, copied, rank=rank, steps=1)
            compressed_steps(reference, ref_param, rank=rank, steps=1)
            assert torch.equal(copied, ref_param), f"world {recorded_world}"
    finally:
        get_logger().removeHandler(handler)
    assert len([m for m in logged if "start again from zero" in m]) == 1, logged


def check_engine_checkpoint(rank: int, world: int, *, directory: str, runs: dict | None = None) -> None:
    """An engine checkpoint taken in the compressed phase resumes: moments, counters and this rank's compression
    errors come back (1-bit Adam exactly: with zeroed errors its next steps differ). `runs`: kind -> optimizer
    section (1-bit Adam and 0/1 Adam when None)."""
    import slipstream

    def engine_for(optimizer: dict):
        config = {"train_micro_batch_size_per_gpu": 4, "optimizer": optimizer}
        return slipstream.initialize(model=TinyMLP(), config=config)[0]

    def steps(engine, first: int, count: int) -> torch.Tensor:
        for inputs, targets in batches()[first : first + count]:
            engine.backward(TinyMLP.loss(engine(inputs[4 * rank : 4 * rank + 4]), targets[4 * rank : 4 * rank + 4]))
            engine.step()
        return torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])

    runs = runs or {
        "OneBitAdam": onebit("OneBitAdam", freeze_step=2),
        "ZeroOneAdam": onebit("ZeroOneAdam", var_freeze_step=2, var_update_scaler=1, local_step_scaler=2),
    }
    for kind, optimizer in runs.items():
        first = engine_for(optimizer)
        steps(first, 0, 6)
        first.save_checkpoint(directory, tag=kind)
        expected = steps(first, 6, 3)
        first.destroy()
        second = engine_for(optimizer)
        second.load_checkpoint(directory, tag=kind)
        resumed = steps(second, 6, 3)
        if kind != "ZeroOneAdam":
            assert torch.equal(resumed, expected), kind
        else:  # 0/1 Adam's local steps leave each rank's parameters a little apart; a checkpoint holds one
            torch.testing.assert_close(resumed, expected, rtol=1e-5, atol=1e-6, msg=kind)
        second.destroy()


def run_all(rank: int, world: int, directory: str) -> None:
    check_all_reduce(rank, world)
    check_error_buffers_in_state_dict(rank, world)
    check_warmup(rank, world)
    check_local_gradients(rank, world)
    check_after_warmup(rank, world)
    check_low_precision(rank, world)
    check_engine_checkpoint(rank, world, directory=directory)


def test_onebit_all_reduce_and_optimizers(tmp_path: Path) -> None:
    run_distributed(run_all, world_size=2, timeout_s=240, directory=str(tmp_path))
