"""What both sides of bench/precision.py share: the rows' configs (one DeepSpeed JSON per row and stage), the
timed training loop, and the bytes of every tensor a rank holds. Imports torch only: Slipstream's side
(bench/precision.py) and DeepSpeed's (bench/_precision_peer.py, in .bench-venv) pass their `initialize`."""

from __future__ import annotations

import gc
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
from _two_ranks import make_mlp

ROWS: dict[str, dict] = {
    "fp32": {},
    "bf16": {"bf16": {"enabled": True}},
    "autocast": {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}},
    "bf16_masters": {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
}
MICRO_BATCH = 16
Initialize = Callable[..., tuple]


def row_config(row: str, stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": stage},
        **ROWS[row],
    }


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage alive in this process (parameters, masters, gradients, optimizer
    states, communication buffers): the same count for either library, unlike RSS."""
    gc.collect()
    storages: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() on a deprecated module attribute warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
                    storage = obj.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, ReferenceError):
                continue
    return sum(storages.values())


def time_row(initialize: Initialize, row: str, stage: int, *, layers: int, width: int, steps: int) -> dict:
    """`steps` timed steps (after two warm-up steps) of one row on this rank: median step time and CPU time of
    this process (all its threads; less sensitive than the step time to other work on the machine), the bytes of
    live tensors after the last step less those before the engine was built, the last loss."""
    before = live_tensor_bytes()
    model = make_mlp(layers, width)
    engine, *_ = initialize(model=model, model_parameters=list(model.parameters()), config=row_config(row, stage))
    gen = torch.Generator().manual_seed(dist.get_rank())
    low = torch.bfloat16 if "bf16" in ROWS[row] else torch.float32
    times, cpu = [], []
    for step in range(steps + 2):
        x = torch.randn(MICRO_BATCH, width, generator=gen).to(low)
        started, cpu_started = time.perf_counter(), time.process_time()
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        if step >= 2:
            times.append(time.perf_counter() - started)
            cpu.append(time.process_time() - cpu_started)
    del x
    result = {
        "step_s": statistics.median(times),
        "cpu_s": statistics.median(cpu),
        "live": float(live_tensor_bytes() - before),
        "loss": float(loss),
    }
    if hasattr(engine, "destroy"):
        engine.destroy()
    del engine, model, loss
    dist.barrier()
    return result
