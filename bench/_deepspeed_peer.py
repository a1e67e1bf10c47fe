"""DeepSpeed's side of bench/zero_step.py; runs only in the peer environment (.bench-venv), never imported.

    .bench-venv/bin/python bench/_deepspeed_peer.py --serve RANK STORE SPEC_JSON deepspeed0,deepspeed1

Owns the DeepSpeed rows: `deepspeed.initialize` with the same JSON config as Slipstream's rows, hosted by
the shared rank server of `_zero_common` (same model, data, timing and memory figures; see [Note: rank
servers] there). The drivers, bench/zero_step.py (deepspeed0-2) and bench/zero3_step.py (deepspeed3,
deepspeed3_offload), start one process per rank with this command line. The stage-3 rows count their
all-gathers by wrapping the torch.distributed all-gather functions (`_zero_common.ALL_GATHERS`).
Slipstream never imports this file, and nothing here imports slipstream.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
BENCH_DIR = Path(__file__).resolve().parent
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))

import torch
from _zero_common import ALL_GATHERS, BenchSpec, Factory, Runner, ds3_config, ds_config, serve_main
from torch import nn


def make_deepspeed(stage: int) -> Factory:
    def factory(spec: BenchSpec, model: nn.Module) -> Runner:
        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=ds_config(spec, stage=stage)
        )

        def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = engine(inputs, targets)
            engine.backward(loss)
            engine.step()
            return loss.detach()

        return Runner(step=step, model=model, owned_bytes=lambda: None)

    return factory


def make_deepspeed3(*, offload_optimizer: bool) -> Factory:
    def factory(spec: BenchSpec, model: nn.Module) -> Runner:
        import deepspeed

        ALL_GATHERS.install()  # before deepspeed.initialize: its comm backend keeps the function it finds
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        config = ds3_config(spec, offload_optimizer=offload_optimizer)
        engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )

        def step(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = engine(inputs, targets)
            engine.backward(loss)
            engine.step()
            return loss.detach()

        return Runner(
            step=step, model=model, owned_bytes=lambda: None, count_step=ALL_GATHERS.count_step(step)
        )

    return factory


FACTORIES: dict[str, Factory] = {
    **{f"deepspeed{stage}": make_deepspeed(stage) for stage in (0, 1, 2)},
    "deepspeed3": make_deepspeed3(offload_optimizer=False),
    "deepspeed3_offload": make_deepspeed3(offload_optimizer=True),
}

if __name__ == "__main__":
    if "--serve" not in sys.argv:
        sys.exit(__doc__)
    serve_main(FACTORIES, sys.argv)
