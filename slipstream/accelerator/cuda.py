"""The CUDA backend, which is also the ROCm backend through torch's HIP build.

This module owns `CudaAccelerator` and `unavailable_reason()` (why CUDA cannot be used here, for
the registry's error message). It is the only module that spells the device type "cuda".

On ROCm torch keeps the "cuda" device type and the `torch.cuda` API, and its "nccl" backend is
RCCL, so the differences are confined to `visible_devices_envs` and `export_envs`.
Importing this module touches no GPU: every `torch.cuda` call happens inside a method.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable

import torch

from slipstream.accelerator.base import Accelerator, DeviceModuleCalls, StreamLike
from slipstream.utils.pin_memory_tracker import track_pinned_memory


def is_rocm() -> bool:
    """Whether this torch is a ROCm (HIP) build."""
    return getattr(torch.version, "hip", None) is not None


def unavailable_reason() -> str | None:
    """None when CUDA is usable; else one sentence saying why not (for error messages)."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return None
    if torch.version.cuda is None and not is_rocm():
        return f"torch.cuda.is_available() is False (torch {torch.__version__} is a CPU build)"
    runtime = f"ROCm {torch.version.hip}" if is_rocm() else f"CUDA {torch.version.cuda}"
    return (
        f"torch.cuda.is_available() is False or no device is visible (torch {torch.__version__} built for "
        f"{runtime}); check the driver with nvidia-smi/rocm-smi and CUDA_VISIBLE_DEVICES/HIP_VISIBLE_DEVICES"
    )


class CudaAccelerator(DeviceModuleCalls, Accelerator):
    """NVIDIA GPUs via CUDA, AMD GPUs via ROCm/HIP; one device per local rank, NCCL (RCCL) collectives."""

    _name = "cuda"
    _communication_backend_name = "nccl"

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device_name(device_index))

    def set_rng_state(self, state: torch.Tensor, device_index: int | None = None) -> None:
        torch.cuda.set_rng_state(state, self.device_name(device_index))

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index]

    @property
    def Stream(self) -> type[StreamLike]:
        return torch.cuda.Stream  # type: ignore[return-value]

    def stream(self, stream: StreamLike | None) -> contextlib.AbstractContextManager[object]:
        return torch.cuda.stream(stream)  # type: ignore[arg-type]

    def current_stream(self, device_index: int | None = None) -> StreamLike:
        return torch.cuda.current_stream(device_index)  # type: ignore[return-value]

    def default_stream(self, device_index: int | None = None) -> StreamLike:
        return torch.cuda.default_stream(device_index)  # type: ignore[return-value]

    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes held by tensors in torch's caching allocator on the device."""
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, int]:
        return dict(torch.cuda.memory_stats(device_index))

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        index = self.current_device() if device_index is None else device_index
        return int(torch.cuda.get_device_properties(index).total_memory)

    def available_memory(self, device_index: int | None = None) -> int:
        """Free bytes on the device per the driver (cudaMemGetInfo), net of other processes."""
        free, _total = torch.cuda.mem_get_info(device_index)
        return int(free)

    def is_bf16_supported(self) -> bool:
        """Native bf16 only (Ampere+ or ROCm); torch's emulated bf16 on older GPUs does not count."""
        if not torch.cuda.is_available():
            return False
        try:
            return bool(torch.cuda.is_bf16_supported(including_emulation=False))
        except TypeError:  # torch < 2.4 has no including_emulation and never counts emulation
            return bool(torch.cuda.is_bf16_supported())

    def is_fp16_supported(self) -> bool:
        """fp16 arithmetic needs compute capability >= 6.0 (Pascal); every ROCm GPU torch supports has it."""
        if not torch.cuda.is_available():
            return False
        if is_rocm():
            return True
        major, _minor = torch.cuda.get_device_capability()
        return major >= 6

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """A page-locked copy of `tensor` (`align_bytes`: DeepSpeed's signature; torch aligns), counted in
        the process's pinned total (utils/pin_memory_tracker.py)."""
        pinned = tensor.pin_memory()
        if pinned is not tensor:
            track_pinned_memory(pinned.nbytes)
        return pinned

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def visible_devices_envs(self) -> list[str]:
        """CUDA_VISIBLE_DEVICES, plus HIP_VISIBLE_DEVICES on ROCm.

        On ROCm torch prefers HIP_VISIBLE_DEVICES over CUDA_VISIBLE_DEVICES, so a stale
        HIP_VISIBLE_DEVICES inherited from the user's shell would win; the launcher sets both.
        """
        if is_rocm():
            return ["CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"]
        return ["CUDA_VISIBLE_DEVICES"]

    def export_envs(self) -> list[str]:
        """NCCL_* (RCCL reads NCCL_* too), plus RCCL_* on ROCm."""
        return ["NCCL", "RCCL"] if is_rocm() else ["NCCL"]

    def range_push(self, msg: str) -> None:
        """Open an NVTX range (roctx on ROCm) when torch has NVTX."""
        nvtx = getattr(torch.cuda, "nvtx", None)
        if nvtx is not None and hasattr(nvtx, "range_push"):
            nvtx.range_push(msg)

    def range_pop(self) -> None:
        nvtx = getattr(torch.cuda, "nvtx", None)
        if nvtx is not None and hasattr(nvtx, "range_pop"):
            nvtx.range_pop()

    def lazy_call(self, callback: Callable[[], object]) -> None:
        """Defer `callback` until CUDA initialises, or run it now if it already has."""
        lazy = getattr(torch.cuda, "_lazy_call", None)  # the hook torch.cuda.manual_seed itself uses
        if lazy is None:
            callback()
        else:
            lazy(callback)

    def is_triton_supported(self) -> bool:
        """Triton is importable and the GPU is Ampere or newer (ROCm: Triton importable)."""
        if importlib.util.find_spec("triton") is None or not torch.cuda.is_available():
            return False
        if is_rocm():
            return True
        major, _minor = torch.cuda.get_device_capability()
        return major >= 8
