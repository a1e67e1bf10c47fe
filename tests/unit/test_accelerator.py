"""Tests for slipstream.accelerator: selection (env, detection, cache) and each backend's host-side behaviour.

CUDA logic is exercised with torch.cuda functions monkeypatched; the test that needs a real GPU carries
`@pytest.mark.gpu`, which tests/conftest.py skips without one.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from slipstream.accelerator import (
    SUPPORTED_ACCELERATORS,
    Accelerator,
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)
from slipstream.accelerator import cuda as cuda_mod
from slipstream.accelerator import registry
from slipstream.accelerator.cpu import CpuAccelerator, HostEvent, HostStream
from slipstream.accelerator.cuda import CudaAccelerator
from slipstream.accelerator.mps import MpsAccelerator

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CPU_ONLY = not torch.cuda.is_available() and not torch.backends.mps.is_available()


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    registry._reset_for_tests()
    yield
    registry._reset_for_tests()


# ---------------------------------------------------------------------- selection
@pytest.mark.skipif(not CPU_ONLY, reason="auto-detection picks a GPU on this machine")
def test_detects_cpu_on_cpu_only_machine() -> None:
    acc = get_accelerator()
    assert isinstance(acc, CpuAccelerator) and acc.name == "cpu" == acc._name
    assert get_accelerator() is acc, "the choice is cached per process"
    assert is_current_accelerator_supported()


def test_detection_prefers_cuda_when_devices_are_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert isinstance(get_accelerator(), CudaAccelerator)


def test_detection_skips_cuda_with_zero_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert isinstance(get_accelerator(), CpuAccelerator)


@pytest.mark.parametrize("value", ["cpu", " CPU "])
def test_env_selects_cpu(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", value)
    assert isinstance(get_accelerator(), CpuAccelerator)


def test_empty_env_means_auto_detect(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "")
    assert get_accelerator().name in SUPPORTED_ACCELERATORS


def test_env_unknown_name_lists_valid_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "tpu")
    with pytest.raises(ValueError) as err:
        get_accelerator()
    message = str(err.value)
    assert "DS_ACCELERATOR='tpu'" in message
    for name in ("cpu", "cuda", "mps"):
        assert name in message
    assert registry._current is None, "a failed selection is not cached"


@pytest.mark.skipif(bool(torch.version.cuda or torch.version.hip), reason="needs a CPU-only torch build")
def test_env_cuda_on_cpu_build_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    with pytest.raises(RuntimeError) as err:
        get_accelerator()
    message = str(err.value)
    assert "DS_ACCELERATOR=cuda but torch.cuda.is_available() is False" in message
    assert f"torch {torch.__version__} is a CPU build" in message


def test_env_cuda_without_visible_gpu_names_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    with pytest.raises(RuntimeError, match=r"built for CUDA 12\.4.*CUDA_VISIBLE_DEVICES"):
        get_accelerator()


def test_env_mps_unavailable_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setenv("DS_ACCELERATOR", "mps")
    with pytest.raises(RuntimeError, match=r"DS_ACCELERATOR=mps but torch\.backends\.mps"):
        get_accelerator()


def test_set_accelerator_overrides_and_resets(monkeypatch: pytest.MonkeyPatch) -> None:
    class Custom(CpuAccelerator):
        _name = "custom"

    custom = Custom()
    set_accelerator(custom)
    assert get_accelerator() is custom
    assert not is_current_accelerator_supported()
    set_accelerator(None)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert type(get_accelerator()) is CpuAccelerator
    with pytest.raises(TypeError, match="Accelerator instance or None"):
        set_accelerator("cpu")  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", [CpuAccelerator, CudaAccelerator, MpsAccelerator])
def test_every_backend_implements_the_whole_api(cls: type[Accelerator]) -> None:
    acc = cls()  # abc refuses to instantiate a backend with a missing method
    assert acc.name in SUPPORTED_ACCELERATORS
    assert acc.op_builder_dir() == "slipstream.ops.op_builder"
    assert acc.get_compile_backend() == "inductor"


def test_import_is_silent_and_touches_no_device() -> None:
    code = (
        "import sys, torch\n"
        "sys.stdout.write('MARK'); sys.stdout.flush(); sys.stderr.write('MARK'); sys.stderr.flush()\n"
        "import slipstream.accelerator, slipstream.accelerator.registry as r\n"
        "sys.exit(3 if torch.cuda.is_initialized() or r._current is not None else 0)\n"
    )
    env = {**os.environ, "PYTHONPATH": REPO_ROOT}
    env.pop("DS_ACCELERATOR", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("MARK", 1)[1] == "", proc.stdout
    assert proc.stderr.split("MARK", 1)[1] == "", proc.stderr


# ---------------------------------------------------------------------- the CPU backend
def test_cpu_devices_and_names(monkeypatch: pytest.MonkeyPatch) -> None:
    acc = CpuAccelerator()
    assert acc.device_name() == acc.device_name(1) == acc.current_device_name() == "cpu"
    assert acc.device() == torch.device("cpu") and acc.current_device() == 0
    assert acc.is_available() and acc.is_synchronized_device()
    assert acc.use_host_timers() and acc.resolves_data_dependency() and acc.handles_memory_backpressure()
    assert acc.communication_backend_name() == "gloo"
    assert acc.visible_devices_envs() == [] and acc.export_envs() == []
    assert acc.supported_dtypes() == [torch.float32, torch.bfloat16, torch.float16]
    assert acc.device_count() == 1
    monkeypatch.setenv("LOCAL_SIZE", "4")
    assert acc.device_count() == 4
    monkeypatch.setenv("LOCAL_SIZE", "zero")
    with pytest.raises(ValueError, match="LOCAL_SIZE='zero'"):
        acc.device_count()


def test_cpu_rng_round_trip() -> None:
    acc = CpuAccelerator()
    acc.manual_seed(1234)
    assert acc.initial_seed() == 1234
    state = acc.get_rng_state()
    first = torch.rand(5)
    acc.set_rng_state(state)
    assert torch.equal(torch.rand(5), first)
    assert acc.default_generator(0) is torch.default_generator
    assert acc.random() is torch.random


def test_cpu_streams_and_events_are_working_null_objects() -> None:
    acc = CpuAccelerator()
    stream = acc.Stream()
    assert isinstance(stream, HostStream) and stream.query()
    stream.wait_stream(acc.current_stream())
    stream.synchronize()
    with acc.stream(stream):
        start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
        start.record()
        torch.ones(100).sum()
        end.record(acc.default_stream())
    end.synchronize()
    assert isinstance(start, HostEvent) and start.query()
    assert start.elapsed_time(end) >= 0.0
    assert isinstance(stream.record_event(), HostEvent)
    with pytest.raises(RuntimeError, match="both events recorded"):
        HostEvent().elapsed_time(end)
    acc.synchronize()


def test_cpu_memory_numbers() -> None:
    acc = CpuAccelerator()
    acc.empty_cache()
    acc.reset_peak_memory_stats()
    before = acc.memory_allocated()
    # 64 MiB of fresh pages, written so they are resident (a torch tensor could reuse heap pages freed earlier
    # in this process and leave the RSS unchanged)
    block = mmap.mmap(-1, 64 * 1024 * 1024)
    block.write(b"\1" * (64 * 1024 * 1024))
    after = acc.memory_allocated()
    assert after >= before + 32 * 1024 * 1024
    assert acc.max_memory_allocated() >= after
    block.close()
    stats = acc.memory_stats()
    for key in ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current"):
        assert isinstance(stats[key], int) and stats[key] > 0
    assert acc.memory_reserved() > 0 and acc.memory_cached() > 0
    assert acc.total_memory() >= acc.available_memory() > 0
    acc.reset_max_memory_allocated()
    assert acc.max_memory_allocated() > 0


def test_cpu_tensors_compile_backend_and_callbacks() -> None:
    acc = CpuAccelerator()
    t = torch.zeros(4)
    assert acc.pin_memory(t) is t and acc.pin_memory(t, align_bytes=64) is t
    assert not acc.is_pinned(t)
    assert acc.on_accelerator(t) and not CudaAccelerator().on_accelerator(t)
    calls: list[int] = []
    acc.lazy_call(lambda: calls.append(1))
    assert calls == [1]
    acc.range_push("x")
    acc.range_pop()
    assert not acc.is_triton_supported()
    acc.set_compile_backend("eager")
    assert acc.get_compile_backend() == "eager"
    with pytest.raises(ValueError, match="non-empty string"):
        acc.set_compile_backend("  ")


# ---------------------------------------------------------------------- the CUDA backend, host side
def test_cuda_names_and_envs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", None)
    acc = CudaAccelerator()
    assert acc.name == "cuda" and acc.communication_backend_name() == "nccl"
    assert acc.device_name() == "cuda" and acc.device_name(1) == "cuda:1"
    assert acc.device(3) == torch.device("cuda", 3)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert acc.current_device_name() == "cuda:2"
    assert not acc.is_synchronized_device() and not acc.use_host_timers()
    assert acc.visible_devices_envs() == ["CUDA_VISIBLE_DEVICES"] and acc.export_envs() == ["NCCL"]
    env = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "7"}
    acc.set_visible_devices_envs(env, [0, 2, 3])
    assert env == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,2,3"}


def test_rocm_sets_both_visible_devices_envs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.2.0")
    acc = CudaAccelerator()
    assert acc.visible_devices_envs() == ["CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"]
    assert acc.communication_backend_name() == "nccl"
    env = {"HIP_VISIBLE_DEVICES": "5"}
    acc.set_visible_devices_envs(env, [1])
    assert env == {"HIP_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "1"}
    assert "RCCL" in acc.export_envs()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "ROCm 6.2.0" in (cuda_mod.unavailable_reason() or "")


def test_cuda_dtype_queries_without_gpu_are_false(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    acc = CudaAccelerator()
    assert not acc.is_bf16_supported() and not acc.is_fp16_supported() and not acc.is_triton_supported()
    assert acc.supported_dtypes() == [torch.float32]


# ---------------------------------------------------------------------- real GPU (device machine only)
@pytest.mark.gpu  # tests/conftest.py skips it without torch.cuda.is_available()
def test_cuda_on_a_real_gpu() -> None:
    acc = CudaAccelerator()
    assert acc.device_count() >= 1 and acc.is_available()
    acc.set_device(0)
    assert acc.current_device_name() == "cuda:0"
    acc.manual_seed(7)
    state = acc.get_rng_state(0)
    first = torch.rand(5, device="cuda")
    acc.set_rng_state(state, 0)
    assert torch.equal(torch.rand(5, device="cuda"), first)
    start, end = acc.Event(enable_timing=True), acc.Event(enable_timing=True)
    with acc.stream(acc.Stream()):
        start.record()
        x = torch.ones(1024, 1024, device="cuda") @ torch.ones(1024, 1024, device="cuda")
        end.record()
    acc.synchronize()
    assert start.elapsed_time(end) >= 0.0 and acc.on_accelerator(x)
    assert acc.memory_allocated() > 0 and acc.max_memory_allocated() >= acc.memory_allocated()
    assert acc.total_memory() >= acc.available_memory() > 0
    pinned = acc.pin_memory(torch.zeros(8))
    assert acc.is_pinned(pinned)
    assert torch.float32 in acc.supported_dtypes()


def test_host_memory_falls_back_to_psutil_then_sysconf(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without /proc/meminfo: psutil's (total, available), else sysconf pages; the cgroup limit still clamps."""
    from slipstream.accelerator import cpu as cpu_mod

    monkeypatch.setattr(cpu_mod, "_proc_kib_field", lambda path, field: None)
    monkeypatch.setattr(cpu_mod, "_cgroup_limit_and_usage", lambda: None)
    monkeypatch.setattr(cpu_mod, "_psutil_virtual_memory", lambda: (8000, 3000))
    assert (cpu_mod.host_total_memory(), cpu_mod.host_available_memory()) == (8000, 3000)
    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 100, "SC_AVPHYS_PAGES": 40}
    monkeypatch.setattr(cpu_mod, "_psutil_virtual_memory", lambda: None)
    monkeypatch.setattr(cpu_mod.os, "sysconf", lambda name: pages[name])
    assert (cpu_mod.host_total_memory(), cpu_mod.host_available_memory()) == (409600, 163840)
    monkeypatch.setattr(cpu_mod, "_cgroup_limit_and_usage", lambda: (300000, 200000))
    assert (cpu_mod.host_total_memory(), cpu_mod.host_available_memory()) == (300000, 100000)


def test_mps_shares_the_host_memory_behaviour() -> None:
    """MPS memory is unified: host streams, the host's totals, no pinning, no launcher variables (no Mac needed)."""
    acc = MpsAccelerator()
    assert acc.Stream is HostStream and isinstance(acc.current_stream(), HostStream)
    with acc.stream(acc.default_stream()) as entered:
        assert isinstance(entered, HostStream)
    t = torch.zeros(4)
    assert acc.pin_memory(t) is t and not acc.is_pinned(t)
    assert acc.visible_devices_envs() == [] and acc.export_envs() == []
    assert acc.total_memory() == CpuAccelerator().total_memory()
    assert not acc.is_triton_supported()
    calls: list[int] = []
    acc.lazy_call(lambda: calls.append(1))
    assert calls == [1]


@pytest.mark.parametrize(("cls", "module"), [(CudaAccelerator, torch.cuda), (MpsAccelerator, torch.mps)])
def test_gpu_backends_forward_to_their_own_device_module(
    cls: type[Accelerator], module: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Event, empty_cache and manual_seed(_all) reach torch.cuda / torch.mps (recorded, no GPU needed)."""
    calls: list[tuple[str, object]] = []
    monkeypatch.setattr(module, "empty_cache", lambda: calls.append(("empty_cache", None)))
    monkeypatch.setattr(module, "manual_seed", lambda seed: calls.append(("manual_seed", seed)))
    acc = cls()
    assert acc.Event is module.Event
    acc.empty_cache()
    acc.manual_seed(3)
    if cls is MpsAccelerator:  # one device: manual_seed_all is manual_seed
        acc.manual_seed_all(4)
    assert calls == [("empty_cache", None), ("manual_seed", 3)] + ([("manual_seed", 4)] if cls is MpsAccelerator else [])


@pytest.mark.parametrize("cls", [CpuAccelerator, CudaAccelerator, MpsAccelerator])
def test_reset_max_memory_allocated_is_reset_peak_memory_stats(
    cls: type[Accelerator], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every backend's reset_max_memory_allocated resets the peaks as reset_peak_memory_stats does."""
    calls: list[int | None] = []
    monkeypatch.setattr(cls, "reset_peak_memory_stats", lambda self, device_index=None: calls.append(device_index))
    cls().reset_max_memory_allocated(0)
    assert calls == [0]
