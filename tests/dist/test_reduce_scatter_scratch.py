"""The host reduce-scatter of slipstream.comm.collectives: a caller's `input` is left as it was unless the
caller says it is scratch; `output` gets this rank's chunk of the sum either way, synchronous or asynchronous,
also when `output` is this rank's chunk of `input` itself (stage 1's in-bucket piece). On two ranks a scratch
input with a separate output goes by point-to-point exchange, with no all-reduce; on three, by the all-reduce."""

from __future__ import annotations

import torch

from tests.harness import run_distributed


def reduce_scatter_cases(rank: int, world: int) -> dict[str, list]:
    import torch.distributed as dist

    from slipstream.comm import collectives

    all_reduces = [0]
    real_all_reduce = dist.all_reduce

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        all_reduces[0] += 1
        return real_all_reduce(*args, **kwargs)

    dist.all_reduce = counted
    out: dict[str, list] = {}
    for case in ("copy", "scratch", "scratch, output in input"):
        for async_op in (False, True):
            given = torch.arange(2.0 * world) * (rank + 1)
            received = given[2 * rank : 2 * rank + 2] if case.endswith("in input") else torch.zeros(2)
            before = all_reduces[0]
            scratch = case.startswith("scratch")
            work = collectives.reduce_scatter(received, given, async_op=async_op, input_is_scratch=scratch)
            if async_op:
                work.wait()
            out[f"{case} async={async_op}"] = [received.tolist(), given.tolist(), all_reduces[0] - before]
    dist.all_reduce = real_all_reduce
    return out


def _check(results: list[dict[str, list]], world: int) -> None:
    total = torch.arange(2.0 * world) * sum(range(1, world + 1))  # rank r gives arange * (r + 1)
    for rank, result in enumerate(results):
        own = torch.arange(2.0 * world) * (rank + 1)
        for case, (received, given, all_reduces) in result.items():
            assert received == total[2 * rank : 2 * rank + 2].tolist(), (world, rank, case, received)
            if case.startswith("copy"):
                assert given == own.tolist(), (world, rank, case, given)  # the caller's input is untouched
            assert all_reduces == (0 if world == 2 and case.split(" async")[0] == "scratch" else 1), (
                world, rank, case, all_reduces)  # fmt: skip


def test_reduce_scatter_keeps_a_callers_input_and_exchanges_on_two_ranks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for world in (2, 3):
        _check(run_distributed(reduce_scatter_cases, world_size=world, tmp_dir=tmp_path / str(world), timeout_s=60), world)
