"""The JIT build cache: content-keyed reuse, rebuild on change, concurrent first loads, stale locks, errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest

from slipstream.ops.op_builder import OpBuildError
from slipstream.ops.op_builder import builder as builder_mod
from slipstream.ops.op_builder.builder import CPUOpBuilder
from slipstream.ops.op_builder.jit import exclusive_lock

pytestmark = pytest.mark.needs_compiler

DATA = Path(__file__).resolve().parent / "data"
REPO = Path(__file__).resolve().parents[2]


def make_builder_source(src_dir: Path, value: int = 1, *, broken: bool = False) -> Path:
    src_dir.mkdir(parents=True, exist_ok=True)
    text = (DATA / "tiny_op.cpp").read_text().replace("#define TINY_OP_VALUE 1", f"#define TINY_OP_VALUE {value}")
    if broken:
        text += "\nint broken() { return undefined_symbol_here; }\n"
    path = src_dir / "tiny_op.cpp"
    path.write_text(text)
    return path


class TinyBuilder(CPUOpBuilder):
    """Builds tests/ops/data/tiny_op.cpp (or a copy given by TINY_OP_SRC) through the real op machinery."""

    NAME = "tiny_test_op"
    BUILD_VAR = "DS_BUILD_TINY_TEST_OP"
    FALLBACK = "tests.ops.tiny_fallback"

    def source_paths(self) -> list[Path]:
        return [Path(os.environ.get("TINY_OP_SRC", DATA / "tiny_op.cpp"))]

    def include_dirs(self) -> list[Path]:
        return []

    def cxx_args(self) -> list[str]:
        return ["-O0", "-DTINY_OP_FLAG=1"]

    def extra_ldflags(self) -> list[str]:
        return []


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SLIPSTREAM_OPS_CACHE", str(root))
    monkeypatch.setattr(builder_mod, "_LOADED", {})
    monkeypatch.setattr(builder_mod, "_WARNED", set())
    return root


LOAD_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {repo!r})
    import torch
    from slipstream.ops.op_builder import jit
    from tests.ops.test_jit_cache import TinyBuilder
    compiles = []
    compile_op = jit._compile
    jit._compile = lambda *args, **kwargs: compiles.append(args[0]) or compile_op(*args, **kwargs)
    mod = TinyBuilder().jit_load()
    print(mod.tiny_value(), len(compiles))
""")
"""Loads the op in a fresh process; prints its value and how many times this process compiled it."""


def load_in_subprocess(env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", LOAD_SCRIPT.format(repo=str(REPO))], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_build_then_reuse_from_a_second_process_without_compiling(cache: Path, tmp_path: Path) -> None:
    env = {**os.environ, "TINY_OP_SRC": str(make_builder_source(tmp_path / "src", 7))}
    first = load_in_subprocess(env)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err
    assert out.split()[0] == "7"
    builds = [p for p in cache.iterdir() if p.is_dir()]
    assert len(builds) == 1 and (builds[0] / ".complete").is_file()

    assert out.split()[1] == "1"  # the first process compiled it
    library = next(builds[0].glob("*.so"))
    built_at = library.stat().st_mtime_ns

    second = load_in_subprocess(env)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    assert out.split() == ["7", "0"], "the second process compiled the op again instead of importing the cached build"
    assert library.stat().st_mtime_ns == built_at and [p for p in cache.iterdir() if p.is_dir()] == builds


def test_changed_source_rebuilds_into_a_new_directory(cache: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    src = make_builder_source(tmp_path / "src", 3)
    monkeypatch.setenv("TINY_OP_SRC", str(src))
    dir_before, _ = TinyBuilder().jit_location()
    make_builder_source(tmp_path / "src", 4)
    dir_after, name_after = TinyBuilder().jit_location()
    assert dir_before != dir_after
    assert TinyBuilder().jit_load().tiny_value() == 4
    assert (dir_after / ".complete").is_file() and not dir_before.exists()


def test_concurrent_first_loads_build_once(cache: Path, tmp_path: Path) -> None:
    env = {**os.environ, "TINY_OP_SRC": str(make_builder_source(tmp_path / "src", 11))}
    procs = [load_in_subprocess(env) for _ in range(3)]
    results = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err
        assert out.split()[0] == "11"
    assert sum(int(out.split()[1]) for out, _ in results) == 1  # one compiled, the others imported its build
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 1


def test_lock_left_by_a_killed_builder_does_not_block(cache: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINY_OP_SRC", str(make_builder_source(tmp_path / "src", 5)))
    build_dir, _ = TinyBuilder().jit_location()
    lock_path = build_dir.with_name(build_dir.name + ".lock")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(REPO)!r})
        from pathlib import Path
        from slipstream.ops.op_builder.jit import exclusive_lock
        with exclusive_lock(Path({str(lock_path)!r}), what="test"):
            print("locked", flush=True)
            time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        # Mimic a build killed half way: torch's lock file and a half-written directory stay behind.
        build_dir.mkdir(parents=True)
        (build_dir / "lock").write_text("")
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        started = time.monotonic()
        assert TinyBuilder().jit_load().tiny_value() == 5
        assert time.monotonic() - started < 120
        assert not (build_dir / "lock").exists()
    finally:
        if holder.poll() is None:
            holder.kill()


def test_lock_is_exclusive_while_held(tmp_path: Path) -> None:
    from slipstream.ops.op_builder.jit import _try_lock

    lock_path = tmp_path / "x.lock"
    with exclusive_lock(lock_path, what="test"), open(lock_path, "a+b") as other:
        assert _try_lock(other) is False


def test_compile_error_names_op_command_and_first_errors(cache: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINY_OP_SRC", str(make_builder_source(tmp_path / "src", broken=True)))
    with pytest.raises(OpBuildError) as info:
        TinyBuilder().jit_load()
    message = str(info.value)
    assert "tiny_test_op" in message
    assert "undefined_symbol_here" in message
    assert "-DTINY_OP_FLAG=1" in info.value.command
    assert info.value.error_lines


def test_load_falls_back_with_one_warning_or_raises_under_native(cache: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINY_OP_SRC", str(make_builder_source(tmp_path / "src", broken=True)))
    monkeypatch.setenv("SLIPSTREAM_OPS", "native")
    with pytest.raises(OpBuildError):
        TinyBuilder().load()
    monkeypatch.setenv("SLIPSTREAM_OPS", "auto")
    with pytest.warns(RuntimeWarning, match="(?s)tiny_test_op.*PyTorch fallback.*undefined_symbol_here"):
        module = TinyBuilder().load()
    assert module.tiny_value() == -1
    assert TinyBuilder().load_status().how == "fallback"  # type: ignore[union-attr]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second load reuses the first decision, silently
        assert TinyBuilder().load().tiny_value() == -1
