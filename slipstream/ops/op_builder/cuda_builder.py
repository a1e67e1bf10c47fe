"""`CUDAOpBuilder`: the base of ops with CUDA (or HIP) sources, and the toolkit checks they need.

It honours `CUDA_HOME`/`CUDA_PATH` and `ROCM_HOME`/`ROCM_PATH` (where the toolkit is),
`TORCH_CUDA_ARCH_LIST` (which GPUs to build for; torch's default when unset) and `DS_SKIP_CUDA_CHECK=1`
(build even when nvcc's major version differs from the one torch was built with). Unlike DeepSpeed, a
mismatch of the minor version alone is accepted: CUDA keeps binary compatibility within a major release.
No op of the first release uses it yet; GPU ops (fused_adam, ...) declare themselves on top of it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from slipstream.ops.op_builder import toolchain
from slipstream.ops.op_builder.builder import Compatibility, OpBuilder


def cuda_versions_compatible(nvcc: str, torch_cuda: str) -> bool:
    """Whether an extension compiled by nvcc `nvcc` ('12.4') can load into torch built with `torch_cuda`."""
    return nvcc.split(".")[0] == torch_cuda.split(".")[0]


class CUDAOpBuilder(OpBuilder):
    """An op compiled with nvcc (or hipcc through torch's HIP build)."""

    def nvcc_args(self) -> list[str]:
        return ["-O3", "--use_fast_math", *toolchain.cuda_arch_flags()]

    def cuda_args(self) -> list[str] | None:
        return self.nvcc_args()

    def is_compatible(self) -> Compatibility:
        base = super().is_compatible()
        if not base.ok:
            return base
        import torch

        hip = getattr(torch.version, "hip", None)
        if hip:
            if toolchain.rocm_home() is None:
                return Compatibility(
                    False, f"torch {torch.__version__} is a ROCm build but no ROCm toolkit was found; set ROCM_HOME"
                )
            return Compatibility(True)
        if torch.version.cuda is None:
            return Compatibility(False, f"torch {torch.__version__} is a CPU build; install a CUDA build of torch")
        home = toolchain.cuda_home()
        if home is None:
            return Compatibility(False, "no CUDA toolkit found; set CUDA_HOME or put nvcc on PATH")
        nvcc = toolchain.nvcc_version(home)
        if nvcc is None:
            return Compatibility(False, f"no working nvcc under {Path(home) / 'bin'}; check CUDA_HOME")
        if not cuda_versions_compatible(nvcc, torch.version.cuda):
            if os.environ.get("DS_SKIP_CUDA_CHECK", "0") == "1":
                return Compatibility(True, f"nvcc {nvcc} vs torch CUDA {torch.version.cuda} (DS_SKIP_CUDA_CHECK=1)")
            return Compatibility(
                False,
                f"nvcc {nvcc} in {home} does not match the CUDA {torch.version.cuda} torch "
                "was built with; install a matching toolkit (or point CUDA_HOME at one), or set "
                "DS_SKIP_CUDA_CHECK=1 to try anyway",
            )
        return Compatibility(True)

    def setuptools_extension(self, root: Path) -> Any:
        from torch.utils.cpp_extension import CUDAExtension

        return CUDAExtension(
            name=self.absolute_name(),
            sources=[os.path.relpath(p, root) for p in self.source_paths()],
            include_dirs=[str(p) for p in self.include_dirs()],
            extra_compile_args={"cxx": self.cxx_args(), "nvcc": self.nvcc_args()},
            extra_link_args=self.extra_ldflags(),
        )
