"""The communication stream of overlap_comm (zero/comm_stream.py) and the staging ring's use of it, with an
accelerator double that has streams and records every stream call: the communication stream waits for the
current one before each launch, the launch runs under it, the current stream waits for it before a result is
read, and a slot is never refilled before that wait. Stage 3's gathers likewise: launched under the stream, joined
before the gathered buffer is read or handed back to the pool, on the one stream the engine's ring made. On the
CPU accelerator it holds no stream at all."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

import slipstream
from slipstream.accelerator.cpu import CpuAccelerator
from slipstream.zero import comm_stream
from slipstream.zero.comm_stream import CommStream
from slipstream.zero.stage3 import secondary as secondary_module
from slipstream.zero.stage3 import unit as unit_module
from slipstream.zero.stage3.pool import BufferPool
from slipstream.zero.stage3.secondary import SecondaryShard
from slipstream.zero.stage3.unit import Unit, UnitMemory
from slipstream.zero.stage3.units import UnitSpec
from slipstream.zero.staging import StagingRing


class _Stream:
    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self._log = name, log

    def wait_stream(self, other: _Stream) -> None:
        self._log.append(f"{self.name}.wait({other.name})")


class _StreamedAccelerator(CpuAccelerator):
    """The CPU accelerator with streams: `Stream()` makes "comm", `current_stream()` is "main" (or "comm" inside
    `stream(comm)`); every call is logged."""

    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log
        self._main = _Stream("main", log)
        self._current = self._main

    def has_streams(self) -> bool:
        return True

    @property
    def Stream(self) -> type:  # type: ignore[override]
        return lambda: _Stream("comm", self.log)

    def current_stream(self, device_index: int | None = None) -> _Stream:  # type: ignore[override]
        return self._current

    @contextlib.contextmanager
    def stream(self, stream: object) -> Iterator[None]:  # type: ignore[override]
        assert isinstance(stream, _Stream)
        self.log.append(f"enter({stream.name})")
        self._current = stream
        yield
        self._current = self._main
        self.log.append(f"exit({stream.name})")


class _Work:
    def __init__(self, log: list[str], slot: int) -> None:
        self._log, self._slot = log, slot

    def wait(self) -> None:
        self._log.append(f"wait-work{self._slot}")


class _Kept:
    def __init__(self, log: list[str]) -> None:
        self._log = log

    def record_stream(self, stream: _Stream) -> None:
        self._log.append(f"record({stream.name})")


def _run_ring(log: list[str], launches: int) -> None:
    accelerator = _StreamedAccelerator(log)
    ring = StagingRing(
        {torch.float32: (8, 4)}, device=None, overlap=True, comm=CommStream(enabled=True, accelerator=accelerator)
    )
    for n in range(launches):
        slot, staging, receive = ring.take(8, 4)
        staging.fill_(n)
        log.append(f"fill{slot}")
        with ring.launching(keep=[_Kept(log)]):  # type: ignore[list-item]
            log.append(f"launch{slot}:{accelerator.current_stream().name}")
        ring.launched(slot, _Work(log, slot), receive, lambda _r, s=slot: log.append(f"read{s}"))
    ring.finish_all()


def test_launch_waits_for_the_current_stream_and_runs_on_the_comm_stream() -> None:
    log: list[str] = []
    _run_ring(log, 3)
    for i, entry in enumerate(log):
        if entry.startswith("launch"):
            assert entry.endswith(":comm"), log
            assert log[i - 2 : i] == ["comm.wait(main)", "enter(comm)"], log
            assert log[i + 1 : i + 3] == ["exit(comm)", "record(comm)"], log


def test_results_are_read_and_slots_refilled_only_after_the_current_stream_waits() -> None:
    log: list[str] = []
    _run_ring(log, 5)
    reads = [i for i, entry in enumerate(log) if entry.startswith("read")]
    assert len(reads) == 5, log
    for i in reads:  # the join, then the work's wait, then the read
        assert log[i - 2 : i] == ["main.wait(comm)", f"wait-work{log[i][4:]}"], log
    for slot in (0, 1):
        fills = [i for i, entry in enumerate(log) if entry == f"fill{slot}"]
        slot_reads = [i for i in reads if log[i] == f"read{slot}"]
        for refill, previous_read in zip(fills[1:], slot_reads):
            assert previous_read < refill, log  # the slot's last use was waited for before it is written again


def test_no_stream_on_the_cpu_or_without_overlap() -> None:
    assert CommStream(enabled=True, accelerator=CpuAccelerator()).stream is None
    log: list[str] = []
    off = CommStream(enabled=False, accelerator=_StreamedAccelerator(log))
    with off.launching(keep=[_Kept(log)]):  # type: ignore[list-item]
        pass
    off.join()
    assert off.stream is None and log == []


class _Manager:
    def check_tags(self, tags: torch.Tensor, tag: float, name: str) -> None:
        return None


def _gathering_unit(log: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[Unit, _StreamedAccelerator]:
    """A unit of two ranks whose all_gather is logged (with the stream it is launched on) and fills the other
    rank's row with this rank's values; its pool logs each buffer handed back."""
    accelerator = _StreamedAccelerator(log)

    def all_gather(buffer: torch.Tensor, own: torch.Tensor, **_: object) -> _Work:
        log.append(f"gather:{accelerator.current_stream().name}")
        buffer.view(2, -1)[1].copy_(own)
        return _Work(log, 0)

    monkeypatch.setattr(unit_module.collectives, "all_gather", all_gather)
    pool = BufferPool(torch.device("cpu"))
    give = pool.give

    def logged_give(tensor: torch.Tensor) -> None:
        log.append("give")
        give(tensor)

    monkeypatch.setattr(pool, "give", logged_give)
    spec = UnitSpec("block", nn.Linear(3, 2), (("w", nn.Parameter(torch.arange(6.0).view(2, 3))),))
    unit = Unit(
        0,
        spec,
        manager=_Manager(),
        rank=0,
        world_size=2,
        group=None,
        memory=UnitMemory(
            device=torch.device("cpu"),
            shard_device=torch.device("cpu"),
            pool=pool,
            allocate_shard=lambda n, d, dev: torch.zeros(n, dtype=d),
        ),
    )
    unit.comm = CommStream(enabled=True, accelerator=accelerator)
    return unit, accelerator


def test_a_units_gather_runs_on_the_comm_stream_and_is_joined_before_its_buffer_is_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log: list[str] = []
    unit, _ = _gathering_unit(log, monkeypatch)
    for _round in range(2):  # the second gather reuses the pooled buffer the first one gave back
        unit.start_gather(hook=True)
        start = log.index("gather:comm")
        assert log[start - 2 : start + 2] == ["comm.wait(main)", "enter(comm)", "gather:comm", "exit(comm)"], log
        unit.finish_gather(hook=True)
        assert log[start + 2 :] == ["main.wait(comm)", "wait-work0", "give"], log  # joined, then unpacked
        assert unit.params[0].tolist() == [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]]
        unit.release()
        log.clear()


def test_a_stage3_engine_gathers_on_the_one_stream_its_reductions_use(monkeypatch: pytest.MonkeyPatch) -> None:
    log: list[str] = []
    accelerator = _StreamedAccelerator(log)
    made: list[_Stream] = []

    def make() -> _Stream:
        made.append(_Stream("comm", log))
        return made[-1]

    monkeypatch.setattr(_StreamedAccelerator, "Stream", property(lambda self: make))
    monkeypatch.setattr(comm_stream, "get_accelerator", lambda: accelerator)
    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 3, "overlap_comm": True},
    }
    engine, *_ = slipstream.initialize(model=nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), config=config)
    comm = engine.optimizer._ring.comm
    assert comm.stream is not None
    assert [unit.comm for unit in engine.optimizer.model.units] == [comm] * len(engine.optimizer.model.units)
    assert made == [comm.stream], "one communication stream per engine"
    engine.destroy()


def test_an_hpz_gather_from_the_secondary_shard_runs_on_the_comm_stream_and_is_joined(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log: list[str] = []
    unit, _ = _gathering_unit(log, monkeypatch)
    monkeypatch.setattr(secondary_module.dist, "get_rank", lambda group: 0)
    block: dist.ProcessGroup = None  # type: ignore[assignment]  # the block's gather is the logged double
    unit.secondary = SecondaryShard(full_numel=6, dtype=torch.float32, device=torch.device("cpu"), block=block, size=2)
    unit.secondary.values.copy_(torch.tensor([5.0, 6.0, 7.0]))
    unit.secondary.filled = True
    unit.start_gather(hook=True)
    start = log.index("gather:comm")
    assert log[start - 2 : start + 2] == ["comm.wait(main)", "enter(comm)", "gather:comm", "exit(comm)"], log
    unit.finish_gather(hook=True)
    assert log[start + 2 :] == ["main.wait(comm)", "wait-work0", "give"], log
    assert unit.params[0].tolist() == [[5.0, 6.0, 7.0], [5.0, 6.0, 7.0]]
