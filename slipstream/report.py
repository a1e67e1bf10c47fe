"""`slipstream report`: the environment report (DeepSpeed's `ds_report`), as a table or as JSON.

It says, for every native op, whether it was built at install, whether it can be built here (and why
not), and how it would load now (prebuilt, JIT from the cache, JIT with a compile, or the PyTorch
fallback), then the versions and paths a bug report needs. It never compiles anything.
Run `slipstream report [--json]` or `python -m slipstream.report [--json]`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from typing import Any

_SHM_WARN_BYTES = 512 * 1024**2


def op_rows() -> list[dict[str, Any]]:
    """One row per op: name, installed, compatible, reason, loads_as."""
    from slipstream import git_version_info
    from slipstream.ops.op_builder import ALL_OPS, ops_policy

    rows = []
    policy = ops_policy()
    for name, builder in ALL_OPS.items():
        compat = builder.is_compatible()
        installed = bool(git_version_info.installed_ops.get(name, False))
        status = builder.load_status()
        if status is not None:
            loads_as = status.how
        elif policy == "fallback":
            loads_as = "fallback (SLIPSTREAM_OPS=fallback)"
        elif installed:
            loads_as = "prebuilt"
        elif compat.ok and _ninja():
            loads_as = "jit (cached)" if builder.jit_cached() else "jit (compiles on first use)"
        else:
            loads_as = "fallback"
        rows.append(
            {
                "name": name,
                "build_var": builder.BUILD_VAR,
                "installed": installed,
                "compatible": compat.ok,
                "reason": compat.reason,
                "loads_as": loads_as,
            }
        )
    return rows


def _ninja() -> str | None:
    from slipstream.ops.op_builder import toolchain

    return toolchain.ninja_path()


def _shm_bytes() -> int | None:
    try:
        return shutil.disk_usage("/dev/shm").total
    except OSError:
        return None


def environment() -> dict[str, Any]:
    """Versions and paths: torch, CUDA/HIP/NCCL, accelerator, Python, compiler, ninja, /dev/shm."""
    import torch

    import slipstream
    from slipstream import git_version_info
    from slipstream.ops.op_builder import cpu_features, toolchain

    try:
        from slipstream.accelerator import get_accelerator

        accelerator = get_accelerator().name
    except Exception as exc:  # the report must still print when detection fails
        accelerator = f"error: {exc}"
    nccl: str | None = None
    if torch.cuda.is_available():
        raw = torch.cuda.nccl.version()
        nccl = ".".join(str(x) for x in raw) if isinstance(raw, tuple) else str(raw)
    compiler = toolchain.cxx_compiler()
    cuda_home = toolchain.cuda_home()
    return {
        "slipstream_version": slipstream.__version__,
        "slipstream_path": os.path.dirname(slipstream.__file__),
        "git_hash": git_version_info.git_hash,
        "git_branch": git_version_info.git_branch,
        "build_mode": git_version_info.mode,
        "built_with_torch": git_version_info.torch_info,
        "built_for_accelerator": git_version_info.accelerator_name,
        "torch_version": torch.__version__,
        "torch_path": os.path.dirname(torch.__file__),
        "torch_cuda_version": torch.version.cuda,
        "torch_hip_version": getattr(torch.version, "hip", None),
        "nccl_version": nccl,
        "cuda_home": cuda_home,
        "nvcc_version": toolchain.nvcc_version(cuda_home),
        "accelerator": accelerator,
        "python_version": platform.python_version(),
        "python_path": sys.executable,
        "platform": platform.platform(),
        "cpu_simd": cpu_features.simd_level(),
        "cxx_compiler": compiler,
        "cxx_compiler_version": toolchain.compiler_version(compiler) if compiler else None,
        "ninja": toolchain.ninja_version(),
        "shm_bytes": _shm_bytes(),
        "ops_policy": os.environ.get("SLIPSTREAM_OPS", "auto"),
        "deepspeed_compat": _deepspeed_compat(),
    }


def _deepspeed_compat() -> str:
    """What `import deepspeed` gives here (the opt-in compatibility package, a real DeepSpeed, or nothing)."""
    from slipstream.compat.deepspeed_dist import status

    try:
        return str(status()["state"])
    except Exception as exc:  # the report must still print
        return f"error: {exc}"


def collect() -> dict[str, Any]:
    return {"ops": op_rows(), "environment": environment()}


def format_report(data: dict[str, Any]) -> str:
    """The human-readable table."""
    line = "-" * 78
    env = data["environment"]
    out = [
        line,
        "Slipstream native op report",
        line,
        "Ops not built at install are compiled just in time on first use (needs a C++ compiler and",
        "ninja); where that is impossible the op runs its PyTorch fallback, with one warning.",
        line,
        f"{'ninja':<20} {env['ninja'] or 'NOT FOUND (pip install ninja)'}",
        f"{'C++ compiler':<20} {env['cxx_compiler_version'] or 'NOT FOUND'}",
        f"{'CPU SIMD':<20} {env['cpu_simd']}",
        line,
        f"{'op name':<16}{'installed':<11}{'compatible':<12}loads as",
    ]
    for row in data["ops"]:
        out.append(
            f"{row['name']:<16}{'[YES]' if row['installed'] else '[NO]':<11}"
            f"{'[OKAY]' if row['compatible'] else '[NO]':<12}{row['loads_as']}"
        )
        if not row["compatible"]:
            out.append(f"{'':<16}reason: {row['reason']}")
    shm = env["shm_bytes"]
    shm_text = "unavailable" if shm is None else f"{shm / 1024**3:.2f} GiB"
    if shm is not None and shm < _SHM_WARN_BYTES:
        shm_text += " (WARNING: under 512 MiB; multi-process data loading and gloo may fail)"
    out += [line, "Slipstream general environment info:"]
    pairs = [
        ("torch install path", env["torch_path"]),
        ("torch version", env["torch_version"]),
        ("torch cuda version", env["torch_cuda_version"]),
        ("torch hip version", env["torch_hip_version"]),
        ("nccl version", env["nccl_version"]),
        ("nvcc version", env["nvcc_version"]),
        ("accelerator", env["accelerator"]),
        ("slipstream install path", env["slipstream_path"]),
        ("slipstream info", f"{env['slipstream_version']}, {env['git_hash']}, {env['git_branch']}"),
        ("slipstream build", _build_text(env)),
        ("python", f"{env['python_version']} ({env['python_path']})"),
        ("platform", env["platform"]),
        ("shared memory (/dev/shm) size", shm_text),
        ("SLIPSTREAM_OPS", env["ops_policy"]),
        ("import deepspeed", env["deepspeed_compat"]),
    ]
    out += [f"{key + ' ':.<34} {value if value is not None else 'none'}" for key, value in pairs]
    out.append(line)
    return "\n".join(out)


def _build_text(env: dict[str, Any]) -> str:
    if env["build_mode"] == "jit":
        return "source checkout without build info: no op built at install, all JIT or fallback"
    return (
        f"installed; ops built against torch {env['built_with_torch']['version']} "
        f"for accelerator {env['built_for_accelerator']}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--hide_operator_status", action="store_true", help="omit the op table")


def run(args: argparse.Namespace) -> int:
    data = collect()
    if args.hide_operator_status:
        data.pop("ops")
        data["ops"] = []
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(format_report(data))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="slipstream report", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
