"""The host reduce-scatter of slipstream.comm.collectives: a caller's `input` is left as it was unless the
caller says it is scratch, and then the sum is taken in it with no copy; `output` gets this rank's chunk of the
sum either way, synchronous or asynchronous."""

from __future__ import annotations

import torch

from tests.harness import run_distributed


def reduce_scatter_cases(rank: int, world: int) -> dict[str, list[list[float]]]:
    from slipstream.comm import collectives

    out: dict[str, list[list[float]]] = {}
    for scratch in (False, True):
        for async_op in (False, True):
            given = torch.arange(2.0 * world) * (rank + 1)
            received = torch.zeros(2)
            work = collectives.reduce_scatter(received, given, async_op=async_op, input_is_scratch=scratch)
            if async_op:
                work.wait()
            out[f"scratch={scratch} async={async_op}"] = [received.tolist(), given.tolist()]
    return out


def test_reduce_scatter_sums_in_place_only_in_scratch_input(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = run_distributed(reduce_scatter_cases, world_size=2, tmp_dir=tmp_path, timeout_s=60)
    total = torch.arange(4.0) * 3  # ranks 0 and 1 give arange * 1 and arange * 2
    for rank, result in enumerate(results):
        own = torch.arange(4.0) * (rank + 1)
        for case, (received, given) in result.items():
            assert received == total[2 * rank : 2 * rank + 2].tolist(), (rank, case, received)
            expected_input = total if case.startswith("scratch=True") else own
            assert given == expected_input.tolist(), (rank, case, given)
