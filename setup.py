"""Build script: a pure-Python wheel by default, native ops ahead of time on request (DeepSpeed's variables).

Environment (see docs/install.md):
  DS_BUILD_OPS=1         build every op that is compatible with this machine (default 0; 1 on Windows)
  DS_BUILD_<OP>=1|0      force one op on or off (DS_BUILD_CPU_ADAM, ...); an explicitly requested op that
                         cannot be built fails the build, one only included by DS_BUILD_OPS is skipped
  DS_BUILD_STRING=.devN  version suffix instead of +<git hash>
  DS_ENABLE_NINJA=1      build the ops with ninja
Writes slipstream/git_version_info_installed.py (version, git hash and branch, installed ops, accelerator,
torch info), which `slipstream report` shows.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from slipstream.ops.op_builder import ALL_OPS, OpBuildError  # noqa: E402  (needs ROOT on sys.path)
from slipstream.ops.op_builder.errors import first_error_lines  # noqa: E402


def _git(*args: str) -> str | None:
    try:
        result = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return result.stdout.strip() if result.returncode == 0 and result.stdout.strip() else None


def _version() -> tuple[str, str, str]:
    base = (ROOT / "version.txt").read_text().strip()
    git_hash = _git("rev-parse", "--short", "HEAD") or "unknown"
    git_branch = _git("rev-parse", "--abbrev-ref", "HEAD") or "unknown"
    build_string = os.environ.get("DS_BUILD_STRING")
    if build_string:
        (ROOT / "build.txt").write_text(build_string + "\n")
        return base + build_string, git_hash, git_branch
    return (f"{base}+{git_hash}" if git_hash != "unknown" else base), git_hash, git_branch


def _flag(name: str, default: str) -> bool:
    value = os.environ.get(name, default).strip()
    if value not in ("0", "1"):
        raise SystemExit(f"slipstream setup: {name}={value!r} must be 0 or 1")
    return value == "1"


def _torch_or_exit(requested: list[str]) -> object:
    try:
        import torch
    except ImportError:
        raise SystemExit(
            f"slipstream setup: ahead-of-time build of {', '.join(requested)} was requested "
            "(DS_BUILD_OPS / DS_BUILD_<OP>), but torch is not importable in the build environment.\n"
            "Install torch first (for example `pip install torch`), then run the same command again; "
            "with pip's build isolation the torch already installed in the target environment is used."
        ) from None
    return torch


def _select_ops() -> list[str]:
    """Names of the ops to build ahead of time; exits with a clear message on an impossible request."""
    build_all = _flag("DS_BUILD_OPS", "1" if sys.platform == "win32" else "0")
    wanted = [(name, b) for name, b in ALL_OPS.items() if _flag(b.BUILD_VAR, "1" if build_all else "0")]
    if not wanted:
        return []
    _torch_or_exit([name for name, _ in wanted])
    selected = []
    for name, builder in wanted:
        compat = builder.is_compatible()
        if compat.ok:
            selected.append(name)
        elif builder.BUILD_VAR in os.environ:
            raise SystemExit(f"slipstream setup: {builder.BUILD_VAR}=1 asks for op '{name}', "
                             f"which cannot be built here: {compat.reason}")
        else:
            print(f"slipstream setup: skipping op '{name}' (included by DS_BUILD_OPS=1): {compat.reason}")
    return selected


def _torch_info() -> tuple[str, dict[str, object]]:
    info: dict[str, object] = {"version": "0.0", "bf16_support": False, "cuda_version": "0.0",
                               "nccl_version": "0.0", "hip_version": "0.0"}
    try:
        import torch
    except ImportError:
        return os.environ.get("DS_ACCELERATOR", "unknown"), info
    info["version"] = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    info["cuda_version"] = torch.version.cuda or "0.0"
    info["hip_version"] = getattr(torch.version, "hip", None) or "0.0"
    if torch.cuda.is_available():
        info["bf16_support"] = bool(torch.cuda.is_bf16_supported())
        nccl = torch.cuda.nccl.version()
        info["nccl_version"] = ".".join(str(x) for x in nccl) if isinstance(nccl, tuple) else str(nccl)
    else:
        info["bf16_support"] = True  # CPU kernels support bf16
    if "DS_ACCELERATOR" in os.environ:
        accelerator = os.environ["DS_ACCELERATOR"]
    elif torch.version.cuda or getattr(torch.version, "hip", None):
        accelerator = "cuda"
    elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        accelerator = "mps"
    else:
        accelerator = "cpu"
    return accelerator, info


def _write_build_info(version: str, git_hash: str, git_branch: str, built: list[str]) -> None:
    accelerator, torch_info = _torch_info()
    installed = {name: name in built for name in ALL_OPS}
    text = (
        '"""Written by setup.py at build time; do not edit."""\n'
        f"version = {version!r}\n"
        f"git_hash = {git_hash!r}\n"
        f"git_branch = {git_branch!r}\n"
        f"installed_ops = {installed!r}\n"
        f"accelerator_name = {accelerator!r}\n"
        f"torch_info = {torch_info!r}\n"
    )
    (ROOT / "slipstream" / "git_version_info_installed.py").write_text(text)


def _build_ext_class(op_of_extension: dict[str, str]) -> type:
    """torch's BuildExtension, with compile failures turned into OpBuildError naming the op."""
    from torch.utils.cpp_extension import BuildExtension

    use_ninja = _flag("DS_ENABLE_NINJA", "0")

    class SlipstreamBuildExt(BuildExtension.with_options(use_ninja=use_ninja)):  # type: ignore[misc]
        def build_extension(self, ext: object) -> None:
            op = op_of_extension.get(ext.name, ext.name)  # type: ignore[attr-defined]
            last: dict[str, str] = {"command": "", "output": ""}
            original_spawn = self.compiler.spawn

            def spawn(cmd: list[str], **kwargs: object) -> None:
                last["command"] = shlex.join(cmd)
                result = subprocess.run(cmd, capture_output=True, text=True)
                sys.stdout.write(result.stdout)
                sys.stderr.write(result.stderr)
                if result.returncode != 0:
                    last["output"] = result.stdout + result.stderr
                    raise OpBuildError(op, last["command"], first_error_lines(last["output"]))

            self.compiler.spawn = spawn
            try:
                super().build_extension(ext)
            except OpBuildError:
                raise
            except Exception as exc:  # ninja path, linker errors: wrap with what we know
                raise OpBuildError(op, last["command"] or "(ninja build, see build.ninja under build/)",
                                   first_error_lines(str(exc))) from exc
            finally:
                self.compiler.spawn = original_spawn

    return SlipstreamBuildExt


def main() -> None:
    version, git_hash, git_branch = _version()
    if os.environ.get("SLIPSTREAM_BUILD_LISTING_REQUIRES") == "1":
        # tools/build_backend.py asks setuptools for its requirements before torch is in the build
        # environment; the op selection (which needs torch) happens in the build step that follows.
        setup(version=version)
        return
    selected = _select_ops()
    _write_build_info(version, git_hash, git_branch, selected)
    kwargs: dict[str, object] = {}
    if selected:
        extensions = [ALL_OPS[name].setuptools_extension(ROOT) for name in selected]
        kwargs["ext_modules"] = extensions
        kwargs["cmdclass"] = {"build_ext": _build_ext_class({e.name: n for e, n in zip(extensions, selected)})}
        print(f"slipstream setup: building ops ahead of time: {', '.join(selected)}")
    setup(version=version, **kwargs)


main()
