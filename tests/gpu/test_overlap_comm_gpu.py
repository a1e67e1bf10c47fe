"""overlap_comm on a real GPU: the reductions launched on the engine's communication stream (zero/comm_stream.py)
give the same parameters, bit for bit, as the same training with overlap_comm off, at stages 2 and 3. One rank
(NCCL with one process per GPU): stage 3 still packs and delivers each unit through the staging ring on the
communication stream, so a missing wait between the two streams shows as different parameters. Run it on its own
(tools/gpu_check.sh does): `pytest -m gpu tests/gpu/test_overlap_comm_gpu.py`."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.gpu.test_cuda_training import build, config, masters, train

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("stage", [2, 3])
def test_overlap_comm_on_the_comm_stream_is_bit_equal_to_off(stage: int) -> None:
    results = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        engine = build(config(stage, overlap_comm=overlap))
        train(engine)
        ring = engine.optimizer._ring
        assert (ring.comm.stream is not None) == overlap, (
            f"stage {stage}: overlap_comm {overlap} stream {ring.comm.stream}"
        )
        results[overlap] = masters(engine)
        del engine
        gc.collect()
    for name, off in results[False].items():
        assert torch.equal(off, results[True][name]), f"stage {stage}: {name} differs with overlap_comm on"
