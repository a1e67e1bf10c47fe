"""ZenFlow (zero_optimization.zenflow) on 2 gloo ranks against a single-process ZenFlow written out plainly below:
the same parameters after every case's steps. Also: topk_ratio 1 with update_interval 1 is plain AdamW, and the
combinations ZenFlow does not run are refused by name. One spawn runs every case."""

from __future__ import annotations

import math

import pytest
import torch

from tests.harness import run_distributed, run_subtests
from tests.harness.models import TinyMLP
from tests.harness.reference import reference_run

LR, DECAY, BETAS, EPS = 1e-2, 0.01, (0.9, 0.999), 1e-8
BATCH = 8
CASES = [
    # select every 6 steps after 2 warm-up rounds; CPU updates every 3 (2 windows per selection)
    {"stage": 1, "steps": 11, "zenflow": {"topk_ratio": 0.3, "select_strategy": "step", "select_interval": 6,
                                          "update_interval": 3, "full_warm_up_rounds": 2}},
    # selection every 5 steps with updates every 2: a selection forces an update one step early; clipped
    {"stage": 2, "steps": 10, "clip": 0.05,
     "zenflow": {"topk_ratio": 0.25, "select_strategy": "step", "select_interval": 5, "update_interval": 2}},
    # "auto" selection without a data loader selects once; selective moments in host buffers
    {"stage": 2, "steps": 9, "zenflow": {"topk_ratio": 0.5, "update_interval": 4, "offload": True}},
    # overlap_step: each CPU update reaches the parameters one window late; selections wait for it
    {"stage": 2, "steps": 13, "clip": 0.05,
     "zenflow": {"topk_ratio": 0.3, "select_strategy": "step", "select_interval": 6, "update_interval": 2,
                 "full_warm_up_rounds": 1, "overlap_step": True}},
    {"stage": 1, "steps": 9, "zenflow": {"topk_ratio": 0.2, "update_interval": 2, "overlap_step": True}},
    # gradient accumulation still accumulates: 2 micro-batches per rank make one ZenFlow step
    {"stage": 1, "steps": 7, "gas": 2, "zenflow": {"topk_ratio": 0.3, "update_interval": 3}},
    # select_strategy "epoch": 32 samples are 4 loader batches of 4 per rank, so one epoch is 4 steps
    {"stage": 2, "steps": 9, "samples": 32,
     "zenflow": {"topk_ratio": 0.3, "select_strategy": "epoch", "select_interval": 1, "update_interval": 2}},
    # bf16 parameters (fp32 masters): the selective update runs in bf16, as in DeepSpeed; so does the reference's
    {"stage": 2, "steps": 7, "bf16": True, "zenflow": {"topk_ratio": 0.3, "update_interval": 3}},
]
# every column, a CPU update after every step, one selection (a new one would zero the selective moments)
PLAIN = {"stage": 2, "steps": 6, "zenflow": {"topk_ratio": 1.0, "update_interval": 1}}


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [TinyMLP().make_batch(seed=500 + s, batch_size=BATCH) for s in range(steps)]


# ---- the reference: ZenFlow on one process, full batches, no sharding ----
def _adamw(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: int) -> None:
    p.mul_(1 - LR * DECAY)
    m.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
    v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
    denom = v.sqrt() / math.sqrt(1 - BETAS[1] ** t) + EPS
    p.sub_(LR / (1 - BETAS[0] ** t) * m / denom)


def _selective_adamw(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, t: int) -> None:
    """The selective update in the parameters' dtype (bf16 rounds every operation), in torch.optim.AdamW's order
    of operations, which the engine's ZenFlowSelectiveAdamW follows, so that the two round alike."""
    g = g.to(p.dtype)
    p.mul_(1 - LR * DECAY)
    m.lerp_(g, 1 - BETAS[0])
    v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
    denom = (v.sqrt() / math.sqrt(1 - BETAS[1] ** t)).add_(EPS)
    p.addcdiv_(m, denom, value=-LR / (1 - BETAS[0] ** t))


def _step_grads(model: TinyMLP, inputs: torch.Tensor, targets: torch.Tensor, interval: int,
                dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """This step's gradient divided by the update interval. In fp32 the full batch's; in bf16 each rank's half
    batch backwards on its own (bf16 rounds each one's gradients) and their fp32 sum is scaled once by
    1 / (world * interval), as the engine's fp32 gradient buffers do."""
    model.zero_grad()
    if dtype == torch.float32:
        TinyMLP.loss(model(inputs), targets).backward()
        return {n: p.grad.detach() / interval for n, p in model.named_parameters()}
    per_rank = BATCH // 2
    sums = {n: torch.zeros(p.shape) for n, p in model.named_parameters()}
    for rank in range(2):
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        TinyMLP.loss(model(inputs[rows].to(dtype)), targets[rows]).backward()
        for n, p in model.named_parameters():
            sums[n] += p.grad.float()
            p.grad = None
    return {n: g.mul_(1.0 / (2 * interval)) for n, g in sums.items()}


def zenflow_reference(steps: int, zenflow: dict, clip: float = 0.0, steps_per_epoch: int = 0,
                      norms: list[float] | None = None, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The final parameters (in `dtype`, the optimizers' masters and CPU moments in fp32); `norms` gets each
    step's global gradient norm."""
    model = TinyMLP().to(dtype)
    params = dict(model.named_parameters())
    ratio, interval = zenflow["topk_ratio"], zenflow["update_interval"]
    warm_up = zenflow.get("full_warm_up_rounds", 0)
    every = zenflow.get("select_interval", 0) if zenflow.get("select_strategy") == "step" else 0
    if zenflow.get("select_strategy") == "epoch":
        every = zenflow["select_interval"] * steps_per_epoch
    overlap = zenflow.get("overlap_step", False)
    unpublished = False  # overlap: the masters hold an update the parameters have not received
    master = {n: p.detach().float().clone() for n, p in params.items()}
    cpu_m = {n: torch.zeros_like(p) for n, p in master.items()}
    cpu_v = {n: torch.zeros_like(p) for n, p in master.items()}
    pending = {n: torch.zeros_like(p) for n, p in master.items()}
    chosen: dict[str, torch.Tensor] = {}
    sel_m: dict[str, torch.Tensor] = {}
    sel_v: dict[str, torch.Tensor] = {}
    sel_t: dict[str, int] = {}

    def cpu_update(grads: dict[str, torch.Tensor], t: int, publish: bool = True) -> None:
        if clip > 0:
            norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
            if norm > clip:
                grads = {n: g * (clip / (norm + 1e-6)) for n, g in grads.items()}
        for n in master:
            _adamw(master[n], grads[n], cpu_m[n], cpu_v[n], t)
            if publish:
                params[n].data.copy_(master[n])

    def columns(n: str) -> torch.Tensor | slice:
        return chosen[n] if params[n].dim() == 2 else slice(None)

    for m, (inputs, targets) in enumerate(batches(steps)):
        grads = _step_grads(model, inputs, targets, interval, dtype)
        if norms is not None:
            norms.append(interval * math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values())))
        if m < warm_up:
            cpu_update(grads, m + 1)
            continue
        if m == warm_up or (every and m % every == 0):
            if unpublished:  # the pending update reaches the parameters, but not their selected columns
                with torch.no_grad():
                    kept = {n: (p[:, chosen[n]] if p.dim() == 2 else p).clone()
                            for n, p in params.items() if p.dim() != 2 or n in chosen}
                    for n, p in params.items():
                        p.copy_(master[n])
                    for n, value in kept.items():
                        if params[n].dim() == 2:
                            params[n][:, chosen[n]] = value
                        else:
                            params[n].copy_(value)
                unpublished = False
            if m > 0:
                for n in master:
                    master[n].copy_(params[n].detach())
            for n, p in params.items():
                if p.dim() == 2:
                    k = int(ratio * p.shape[1])
                    chosen[n] = torch.topk(grads[n].abs().sum(0), k).indices.sort().values
                shape = p[:, chosen[n]].shape if p.dim() == 2 else p.shape
                sel_m[n], sel_v[n] = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        for n in master:
            pending[n] += grads[n]
        with torch.no_grad():
            for n, p in params.items():  # the selective update, columns only
                sel_t[n] = sel_t.get(n, 0) + 1
                cols = columns(n)
                value = p[:, cols].clone() if p.dim() == 2 else p.detach().clone()
                grad = grads[n][:, cols] if p.dim() == 2 else grads[n]
                _selective_adamw(value, grad, sel_m[n], sel_v[n], sel_t[n])
                if p.dim() == 2:
                    p[:, cols] = value
                else:
                    p.copy_(value)
            if (m + 1 - warm_up) % interval == 0 or (every and (m + 1) % every == 0):
                kept = {n: (p[:, columns(n)] if p.dim() == 2 else p).clone() for n, p in params.items()}
                if overlap:  # the previous window's update arrives; this window's waits for the next boundary
                    if unpublished:
                        for n, p in params.items():
                            p.copy_(master[n])
                    cpu_update(dict(pending), m + 1, publish=False)
                    unpublished = True
                else:
                    cpu_update(dict(pending), m + 1)
                for n, p in params.items():
                    if p.dim() == 2:
                        p[:, columns(n)] = kept[n]
                    else:
                        p.copy_(kept[n])
                for g in pending.values():
                    g.zero_()
    return {n: p.detach().clone() for n, p in params.items()}


# ---- the engine on 2 ranks ----
def zenflow_run(rank: int, world: int, *, stage: int, steps: int, zenflow: dict, clip: float = 0.0, gas: int = 1,
                bf16: bool = False, samples: int = 0) -> dict:
    import slipstream

    micro = BATCH // world // gas
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
              "bf16": {"enabled": bf16},
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": DECAY, "betas": list(BETAS),
                                                        "eps": EPS}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 700,
                                    "offload_optimizer": {"device": "cpu"}, "zenflow": zenflow}}
    data = None
    if samples:  # only its length matters: the "epoch" strategy counts the engine loader's batches
        data = torch.utils.data.TensorDataset(torch.zeros(samples, 13), torch.zeros(samples, 5))
    engine, *_ = slipstream.initialize(model=TinyMLP(), config=config, training_data=data)
    norms = []
    assert type(engine.optimizer).__name__ == f"ZenFlowStage{stage}Optimizer"
    for inputs, targets in batches(steps):
        for m in range(gas):  # the window's micro-batches make one ZenFlow step
            lo = (m * world + rank) * micro
            engine.backward(TinyMLP.loss(engine(inputs[lo:lo + micro]), targets[lo:lo + micro]))
            engine.step()
        norms.append(engine.get_global_grad_norm())
    assert engine.global_steps == steps
    selected = {n: p.selected_indices.tolist() for n, p in engine.module.named_parameters()
                if hasattr(p, "selected_indices")}
    return {"params": {n: p.detach().clone() for n, p in engine.module.named_parameters()}, "selected": selected,
            "norms": norms}


def checkpoint_round_trip(rank: int, world: int, directory: str) -> bool:
    """Saved in the middle of a background update (overlap_step): the save waits for it; a new engine loads
    the same masters and Adam state."""
    import slipstream
    from tests.harness.checks import owned_state

    config = {"train_micro_batch_size_per_gpu": BATCH // world,
              "optimizer": {"type": "AdamW", "params": {"lr": LR}},
              "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"},
                                    "zenflow": {"topk_ratio": 0.3, "update_interval": 2, "overlap_step": True}}}
    engine, *_ = slipstream.initialize(model=TinyMLP(), config=config)
    per_rank = BATCH // world
    for inputs, targets in batches(4):
        engine.backward(TinyMLP.loss(engine(inputs[rank * per_rank:(rank + 1) * per_rank]),
                                     targets[rank * per_rank:(rank + 1) * per_rank]))
        engine.step()
    assert engine.optimizer._background is not None  # the update of steps 2-3 is under way
    engine.save_checkpoint(directory, tag="zf")
    saved = owned_state(engine, ("exp_avg", "exp_avg_sq"))
    other, *_ = slipstream.initialize(model=TinyMLP(seed=1), config=config)
    other.load_checkpoint(directory, tag="zf")
    loaded = owned_state(other, ("exp_avg", "exp_avg_sq"))
    return all(torch.equal(a[3], b[3]) for key in saved for a, b in zip(saved[key], loaded[key]))


def refused(rank: int, world: int) -> list[str]:
    import slipstream

    messages = []
    for zenflow in ({"update_interval": "auto"},):
        config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
                  "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}, "zenflow": zenflow}}
        try:
            slipstream.initialize(model=TinyMLP(), config=config)
        except NotImplementedError as error:
            messages.append(str(error))
    return messages


def grid(rank: int, world: int, directory: str) -> list:
    results = run_subtests(CASES + [PLAIN], lambda **case: zenflow_run(rank, world, **case))
    return results + [checkpoint_round_trip(rank, world, directory), refused(rank, world)]


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory: pytest.TempPathFactory) -> list[list]:
    directory = str(tmp_path_factory.mktemp("zenflow-checkpoint"))
    return run_distributed(grid, world_size=2, tmp_dir=tmp_path_factory.mktemp("zenflow"), timeout_s=240,
                           directory=directory)


@pytest.mark.parametrize("number", range(len(CASES)))
def test_zenflow_matches_single_process_zenflow(per_rank: list[list], number: int) -> None:
    case = CASES[number]
    epoch = case.get("samples", 0) // BATCH
    norms: list[float] = []
    bf16 = bool(case.get("bf16"))
    expected = zenflow_reference(case["steps"], case["zenflow"], case.get("clip", 0.0), steps_per_epoch=epoch,
                                 norms=norms, dtype=torch.bfloat16 if bf16 else torch.float32)
    first, second = per_rank[0][number], per_rank[1][number]
    assert first["selected"] == second["selected"] and first["selected"], case
    # Training moves these weights by about 0.1, a step by up to LR. bf16: the reference rounds as the engine
    # does and matched it bit for bit when this was written; the tolerance is one bf16 step at these weights'
    # size (2**-9), and a run with its last step skipped is off by more than twice that in 359 of 2114 elements.
    tolerance = 2e-3 if bf16 else 1e-5
    torch.testing.assert_close(first["norms"], norms, rtol=1e-4, atol=0)  # each step's own gradient
    for name, value in expected.items():
        for rank, result in enumerate((first, second)):
            torch.testing.assert_close(result["params"][name].float(), value.float(), rtol=0 if bf16 else tolerance,
                                       atol=tolerance,
                                       msg=lambda m, name=name, rank=rank: f"case {number} rank {rank} {name}: {m}")


def test_the_reference_is_not_plain_adamw() -> None:
    """The ZenFlow cases differ from plain AdamW by far more than the tolerance (so the test above can fail)."""
    case = CASES[1]
    plain = reference_run(TinyMLP, batches(case["steps"]), lr=LR, steps=case["steps"], weight_decay=DECAY)
    zenflow = zenflow_reference(case["steps"], case["zenflow"], case.get("clip", 0.0))
    assert max(float((plain.params[n] - zenflow[n]).abs().max()) for n in zenflow) > 1e-3


def test_every_column_every_step_is_plain_adamw(per_rank: list[list]) -> None:
    reference = reference_run(TinyMLP, batches(PLAIN["steps"]), lr=LR, steps=PLAIN["steps"], weight_decay=DECAY)
    for rank in (0, 1):
        for name, value in per_rank[rank][len(CASES)]["params"].items():
            torch.testing.assert_close(value, reference.params[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name, rank=rank: f"rank {rank} {name}: {m}")


def test_a_checkpoint_waits_for_the_background_update(per_rank: list[list]) -> None:
    assert per_rank[0][-2] and per_rank[1][-2]


def test_what_zenflow_does_not_run_is_refused_by_name(per_rank: list[list]) -> None:
    (auto,) = per_rank[0][-1]
    assert "zenflow.update_interval" in auto and '"auto"' in auto
