"""Installing the package the ways a user does: pure wheel without a compiler, and ops ahead of time.

These tests build a copy of the working tree in a fresh virtual environment, as `pip install .` does on a
user's machine (build isolation included), so they take a few minutes; they are the check that
`DS_BUILD_CPU_ADAM=1 pip install .` really ships a prebuilt op and that a plain install needs no compiler.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def run(
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    check: bool = True,
    timeout: float = 900,
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{argv} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the working tree (tracked and new files, no build outputs) committed in its own git repo."""
    dest = tmp_path_factory.mktemp("src") / "slipstream-src"
    listed = run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO).stdout.split("\0")
    for rel in filter(None, listed):
        if (REPO / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / rel, dest / rel)
    for argv in (
        ["git", "init", "-q"],
        ["git", "add", "-A"],
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "copy"],
    ):
        run(argv, cwd=dest)
    return dest


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("venv") / "env"
    run([sys.executable, "-m", "venv", str(path)])
    tools = path / "git-only"  # git (for the version's hash) without the rest of /usr/bin
    tools.mkdir()
    git = shutil.which("git")
    if git:
        (tools / "git").symlink_to(git)
    return path


def clean_env(venv: Path, **extra: str) -> dict[str, str]:
    """A user's shell without a compiler: PATH is the venv plus git, so there is no c++ and no ninja."""
    keep = {
        k: v
        for k, v in os.environ.items()
        if k.startswith(("PIP_", "HOME", "LANG", "LC_", "TMP", "SSL_", "REQUESTS_CA")) or k == "USER"
    }
    return {**keep, "PATH": f"{venv / 'bin'}:{venv / 'git-only'}", **extra}


def venv_python(venv: Path) -> str:
    return str(venv / "bin" / "python")


def test_pure_install_without_compiler_then_aot_install(source: Path, venv: Path, tmp_path: Path) -> None:
    py = venv_python(venv)
    env = clean_env(venv)
    assert shutil.which("c++", path=env["PATH"]) is None and shutil.which("g++", path=env["PATH"]) is None

    # 1. An ahead-of-time build with no torch in the target environment stops and says what to do.
    failed = run([py, "-m", "pip", "install", str(source)], env={**env, "DS_BUILD_CPU_ADAM": "1"}, check=False)
    output = failed.stdout + failed.stderr
    assert failed.returncode != 0
    assert "install torch first" in output.lower(), output[-4000:]

    # The user's environment has PyTorch (the same build as this test runner's, from the local wheel cache).
    run([py, "-m", "pip", "install", "--quiet", f"torch=={torch.__version__}"], env=env)

    # 2. The default wheel is pure Python and its version carries the git hash.
    run([py, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path / "wheels"), str(source)], env=env)
    wheel = next((tmp_path / "wheels").glob("slipstream-*.whl"))
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    git_hash = run(["git", "rev-parse", "--short", "HEAD"], cwd=source).stdout.strip()
    assert f"+{git_hash}" in wheel.name
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert not [n for n in names if n.endswith((".so", ".pyd"))]
    assert "slipstream/ops/csrc/adam/cpu_adam.cpp" in names  # sources ship for JIT builds
    assert "slipstream/py.typed" in names  # type checkers use the package's annotations
    # Windows: commands are entry points (pip writes an .exe launcher), never shell or batch scripts.
    assert not [n for n in names if ".data/scripts/" in n or n.endswith((".bat", ".cmd", ".sh"))], names

    # 3. pip install . works with no compiler on PATH, and import needs nothing built. DeepSpeed's feature
    # extras exist (pip warns of one a package does not provide) and bring nothing: torch is there. Their names
    # as the metadata writes them (PEP 685): pip before 23.3 does not match `sparse_attn` to `sparse-attn`.
    extras = "autotuning,autotuning-ml,sparse-attn,sparse,1bit,inf"
    installed = run([py, "-m", "pip", "install", f"{source}[{extras}]"], env=env)
    assert "does not provide the extra" not in installed.stdout + installed.stderr, installed.stderr[-2000:]
    info = run(
        [
            py,
            "-c",
            "import json, slipstream.git_version_info as g; print(json.dumps([g.mode, g.installed_ops, g.version]))",
        ],
        env=env,
        cwd=tmp_path,
    ).stdout
    mode, installed_ops, version = json.loads(info)
    assert mode == "installed" and version.endswith(git_hash)
    assert installed_ops == {"cpu_adam": False, "cpu_lamb": False, "async_io": False}

    # 4. DS_BUILD_CPU_ADAM=1 pip install . ships the op prebuilt: no JIT at first use.
    compiler_dir = os.path.dirname(shutil.which("c++") or "/usr/bin/c++")
    with_compiler = clean_env(venv, DS_BUILD_CPU_ADAM="1")
    with_compiler["PATH"] += f":{compiler_dir}"
    run([py, "-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps", str(source)], env=with_compiler)
    cache = tmp_path / "jit-cache"
    probe = (
        "import json, slipstream.git_version_info as g; "
        "from slipstream.ops.op_builder import CPUAdamBuilder; b = CPUAdamBuilder(); m = b.load(); "
        "print(json.dumps([g.installed_ops, b.load_status().how, m.__name__]))"
    )
    out = run([py, "-c", probe], env={**env, "SLIPSTREAM_OPS_CACHE": str(cache)}, cwd=tmp_path).stdout
    installed_ops, how, module_name = json.loads(out.strip().splitlines()[-1])
    assert installed_ops == {"cpu_adam": True, "cpu_lamb": False, "async_io": False}
    assert how == "prebuilt" and module_name == "slipstream.ops._prebuilt.cpu_adam"
    assert not cache.exists() or not any(p.is_dir() and p.name.startswith("cpu_adam") for p in cache.iterdir())


def test_build_string_and_impossible_requests(source: Path, venv: Path, tmp_path: Path) -> None:
    """setup.py's decisions, without pip: version suffix, explicit incompatible op, DS_BUILD_OPS skip."""
    py = sys.executable  # has torch, like a build environment would
    env = {**os.environ, "DS_BUILD_STRING": ".dev20260101"}
    env.pop("DS_BUILD_OPS", None)
    env.pop("DS_BUILD_CPU_ADAM", None)
    work = tmp_path / "tree"
    shutil.copytree(source, work)
    base = (work / "version.txt").read_text().strip()
    printed = run([py, "setup.py", "--version"], env=env, cwd=work).stdout.strip().splitlines()[-1]
    assert printed == base + ".dev20260101"

    no_compiler = {**env, "CXX": "/nonexistent/c++"}
    explicit = run([py, "setup.py", "--version"], env={**no_compiler, "DS_BUILD_CPU_ADAM": "1"}, cwd=work, check=False)
    assert explicit.returncode != 0
    assert "DS_BUILD_CPU_ADAM=1" in explicit.stderr and "cpu_adam" in explicit.stderr
    assert "no C++ compiler" in explicit.stderr

    implicit = run([py, "setup.py", "--version"], env={**no_compiler, "DS_BUILD_OPS": "1"}, cwd=work)
    assert "skipping op 'cpu_adam'" in implicit.stdout
    written = (work / "slipstream" / "git_version_info_installed.py").read_text()
    assert "'cpu_adam': False" in written

    bad = run([py, "setup.py", "--version"], env={**env, "DS_BUILD_OPS": "yes"}, cwd=work, check=False)
    assert bad.returncode != 0 and "DS_BUILD_OPS='yes' must be 0 or 1" in bad.stderr
