"""CUDAOpBuilder's toolkit checks, with torch's CUDA facts and the toolkit faked (this machine has no GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slipstream.ops.op_builder import toolchain
from slipstream.ops.op_builder.cuda_builder import CUDAOpBuilder, cuda_versions_compatible


class FakeGpuOp(CUDAOpBuilder):
    NAME = "fake_gpu_op"
    BUILD_VAR = "DS_BUILD_FAKE_GPU_OP"
    FALLBACK = "tests.ops.tiny_fallback"

    def sources(self) -> list[str]:
        return ["fake/fake.cu"]


@pytest.fixture()
def cuda_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(toolchain, "cxx_compiler", lambda: "/usr/bin/c++")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.delenv("DS_SKIP_CUDA_CHECK", raising=False)
    return tmp_path


def test_versions_compatible_within_a_major_release() -> None:
    assert cuda_versions_compatible("12.6", "12.4")
    assert not cuda_versions_compatible("13.0", "12.4")


def test_cpu_torch_is_incompatible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(toolchain, "cxx_compiler", lambda: "/usr/bin/c++")
    compat = FakeGpuOp().is_compatible()
    assert not compat.ok and "CPU build" in compat.reason


def test_major_mismatch_needs_skip_cuda_check(cuda_torch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(toolchain, "nvcc_version", lambda home: "13.0")
    compat = FakeGpuOp().is_compatible()
    assert not compat.ok and "nvcc 13.0" in compat.reason and "DS_SKIP_CUDA_CHECK=1" in compat.reason
    monkeypatch.setenv("DS_SKIP_CUDA_CHECK", "1")
    assert FakeGpuOp().is_compatible().ok


def test_matching_toolkit_from_cuda_home(cuda_torch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str | None] = []
    monkeypatch.setattr(toolchain, "nvcc_version", lambda home: seen.append(home) or "12.6")
    assert FakeGpuOp().is_compatible().ok
    assert seen == [str(cuda_torch)]


def test_no_nvcc_under_cuda_home(cuda_torch: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(toolchain, "nvcc_version", lambda home: None)
    compat = FakeGpuOp().is_compatible()
    assert not compat.ok and str(cuda_torch) in compat.reason


def test_rocm_build_needs_rocm_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.version, "hip", "6.2.0")
    monkeypatch.setattr(toolchain, "cxx_compiler", lambda: "/usr/bin/c++")
    monkeypatch.setattr(toolchain, "rocm_home", lambda: None)
    assert "ROCM_HOME" in FakeGpuOp().is_compatible().reason
    monkeypatch.setattr(toolchain, "rocm_home", lambda: str(tmp_path))
    assert FakeGpuOp().is_compatible().ok


def test_arch_list_reaches_nvcc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert "-gencode=arch=compute_90,code=sm_90" in FakeGpuOp().nvcc_args()


def test_rocm_version_queries_read_torchs_hip_version(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # DeepSpeed's 1-bit tests call OpBuilder.installed_rocm_version() at import to skip ROCm 5 and later
    from slipstream.ops.op_builder.builder import OpBuilder

    monkeypatch.setattr(torch.version, "hip", None)
    assert OpBuilder.installed_rocm_version() == (0, 0)
    assert not OpBuilder.is_rocm_pytorch()
    monkeypatch.setattr(torch.version, "hip", "6.2.41133-dd7f95766")
    monkeypatch.setenv("ROCM_HOME", str(tmp_path))
    assert OpBuilder.installed_rocm_version() == (6, 2)
    assert OpBuilder.is_rocm_pytorch()
