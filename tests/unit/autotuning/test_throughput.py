"""The ranking's estimate from the model's profile (autotuning/throughput.py) on synthetic per-block times."""

from __future__ import annotations

import pytest

from slipstream.autotuning.profile import REST, ModelProfile
from slipstream.autotuning.space import Candidate
from slipstream.autotuning.throughput import CPU_LINKS, ProfiledEstimate

MS = 1e-3
NUMEL = 1_000_000  # 4 MB of fp32 parameters: at CPU_LINKS' 1 GB/s a ring all-gather on 2 ranks takes 2 ms


def _candidate(stage: int, **keys: object) -> Candidate:
    fields: dict[str, object] = {"offload_optimizer": False, "micro_batch": 4, "grad_accum": 1, **keys}
    return Candidate(stage=stage, **fields)  # type: ignore[arg-type]


def _estimate(block_ms: float, *, rest_ms: float = 1.0, step_ms: float = 0.0, micro: int = 4) -> ProfiledEstimate:
    profile = ModelProfile(
        micro_batch=micro,
        grad_accum=1,
        block_forward_s={"layers.0": block_ms * MS, REST: rest_ms * MS},
        step_s=step_ms * MS,
        flops_per_sample=None,
        numel=NUMEL,
        param_bytes=4,
    )
    return ProfiledEstimate(profile=profile, profiled=_candidate(0), world=2, ranks_per_node=2, links=CPU_LINKS)


def test_a_slower_block_makes_recomputing_it_cost_more_than_stage_3s_gathers() -> None:
    # stage 0 with checkpointing: 3 forwards + the block once more + 4 ms of gradient all-reduce per step;
    # stage 3 without: 3 forwards + 6 ms of gathers and reduce-scatter per micro step
    checkpointed, gathered = _candidate(0, activation_checkpointing=True), _candidate(3, activation_checkpointing=False)
    fast_block = _estimate(1.5)
    assert fast_block(checkpointed) > fast_block(gathered)  # recomputing 1.5 ms beats 2 ms more communication
    slow_block = _estimate(3.0)  # the block's time doubled
    assert slow_block(checkpointed) < slow_block(gathered)
    # the rest of the forward (embeddings, head) is not recomputed: doubling it keeps the first order
    assert _estimate(1.5, rest_ms=2.0)(checkpointed) > _estimate(1.5, rest_ms=2.0)(gathered)


def test_the_estimate_is_samples_per_second_from_the_modelled_step() -> None:
    estimate = _estimate(2.0)
    # stage 0, micro 4, 2 ranks: 3 x 3 ms of compute and 4 ms of all-reduce for 8 samples
    assert estimate(_candidate(0)) == pytest.approx(8 / (9 * MS + 4 * MS))
    # micro 8 doubles the compute, not the per-step all-reduce
    assert estimate(_candidate(0, micro_batch=8)) == pytest.approx(16 / (18 * MS + 4 * MS))


def test_the_measured_step_beyond_the_model_is_a_fixed_cost_that_larger_micro_batches_amortise() -> None:
    small, large = _candidate(1), _candidate(1, micro_batch=16)
    modelled = _estimate(2.0)
    slow_step = _estimate(2.0, step_ms=100.0)  # the profiled step took 87 ms beyond the model
    assert slow_step.fixed() == pytest.approx(100 * MS - modelled.modelled_step(modelled.profiled))
    assert slow_step(large) / slow_step(small) > modelled(large) / modelled(small)


def test_offload_charges_the_host_link_and_the_host_step() -> None:
    estimate = _estimate(2.0)
    plain, offloaded = _candidate(2), _candidate(2, offload_optimizer=True)
    shard = NUMEL / 2
    extra = shard * (4 + 4) / CPU_LINKS.host + shard / CPU_LINKS.host_step
    assert 8 / estimate(offloaded) - 8 / estimate(plain) == pytest.approx(extra)
    params = _candidate(3, offload_param=True)
    fetches = 2 * shard * 4 / CPU_LINKS.host  # the forward's and the backward's, per micro step
    assert 8 / estimate(params) - 8 / estimate(_candidate(3)) == pytest.approx(fetches)
    nvme = _candidate(3, offload_optimizer=True, offload_device="nvme")
    assert estimate(nvme) < estimate(_candidate(3, offload_optimizer=True))
