"""Op-builder pieces that need no compiler: flags from CPU features, policies, registry, error text."""

from __future__ import annotations

import pytest

from slipstream.ops.op_builder import ALL_OPS, CPUAdamBuilder, OpBuildError, get_builder, ops_policy
from slipstream.ops.op_builder import builder as builder_mod
from slipstream.ops.op_builder import cpu_features, toolchain
from slipstream.ops.op_builder.errors import first_error_lines


@pytest.mark.parametrize(
    ("flags", "machine", "expected"),
    [
        ({"avx512f", "avx512bw", "avx2", "fma"}, "x86_64", "avx512"),
        ({"avx512f", "avx2", "fma"}, "x86_64", "avx2"),  # AVX-512 without BW: the kernels use AVX2
        ({"avx2", "fma"}, "x86_64", "avx2"),
        ({"sse4_2"}, "x86_64", "scalar"),
        (set(), "aarch64", "neon"),
        (set(), "arm64", "neon"),
    ],
)
def test_simd_level_from_cpu_flags(flags: set[str], machine: str, expected: str) -> None:
    assert cpu_features.simd_level(frozenset(flags), machine) == expected


def test_arch_flag_follows_machine_and_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLIPSTREAM_CPU_ARCH", raising=False)
    assert cpu_features.arch_flags("x86_64") == ["-march=native"]
    assert cpu_features.arch_flags("aarch64") == ["-mcpu=native"]
    monkeypatch.setenv("SLIPSTREAM_CPU_ARCH", "-march=x86-64-v3")
    assert cpu_features.arch_flags("x86_64") == ["-march=x86-64-v3"]
    assert cpu_features.simd_flags() == []  # a portable target lets the compiler's macros decide


def test_cpu_adam_flags_carry_simd_and_openmp(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLIPSTREAM_CPU_ARCH", raising=False)
    monkeypatch.setattr(toolchain, "cxx_compiler", lambda: "/usr/bin/c++")
    monkeypatch.setattr(toolchain, "openmp_flags", lambda compiler: (["-fopenmp"], ["-fopenmp"]))
    monkeypatch.setattr(cpu_features, "simd_level", lambda *a: "avx2")
    args = CPUAdamBuilder().cxx_args()
    assert "-O3" in args and "-D__AVX256__" in args and "-fopenmp" in args
    assert CPUAdamBuilder().extra_ldflags() == ["-fopenmp"]
    monkeypatch.setattr(toolchain, "openmp_flags", lambda compiler: ([], []))
    assert "-fopenmp" not in CPUAdamBuilder().cxx_args()


def test_missing_compiler_is_incompatible_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    compat = CPUAdamBuilder().is_compatible()
    assert not compat.ok and "no C++ compiler" in compat.reason and "/nonexistent/c++" in compat.reason


def test_missing_compiler_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setenv("SLIPSTREAM_OPS", "auto")
    monkeypatch.setattr(builder_mod, "_LOADED", {})
    monkeypatch.setattr(builder_mod, "_WARNED", set())
    monkeypatch.setattr("slipstream.git_version_info.installed_ops", {})
    with pytest.warns(RuntimeWarning, match="(?s)op 'cpu_adam' uses its PyTorch fallback.*no C\\+\\+ compiler"):
        module = CPUAdamBuilder().load()
    assert module.__name__ == "slipstream.ops.fallback.cpu_adam"
    assert CPUAdamBuilder().load_status().how == "fallback"  # type: ignore[union-attr]


def test_ops_policy_validates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLIPSTREAM_OPS", "FALLBACK")
    assert ops_policy() == "fallback"
    monkeypatch.setenv("SLIPSTREAM_OPS", "fast")
    with pytest.raises(ValueError, match="SLIPSTREAM_OPS='fast' is not one of auto, native, fallback"):
        ops_policy()


def test_forced_fallback_loads_without_warning(monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder) -> None:
    monkeypatch.setenv("SLIPSTREAM_OPS", "fallback")
    monkeypatch.setattr(builder_mod, "_LOADED", {})
    module = CPUAdamBuilder().load()
    assert module.simd_level() == "fallback"
    assert CPUAdamBuilder().load_status().reason == "SLIPSTREAM_OPS=fallback"  # type: ignore[union-attr]
    assert not [w for w in recwarn if "slipstream" in str(w.message)]


def test_registry_and_unknown_name() -> None:
    assert set(ALL_OPS) == {"cpu_adam", "cpu_lamb", "async_io"}
    assert get_builder("cpu_adam").BUILD_VAR == "DS_BUILD_CPU_ADAM"
    assert get_builder("cpu_lamb").BUILD_VAR == "DS_BUILD_CPU_LAMB"
    assert get_builder("async_io").BUILD_VAR == "DS_BUILD_AIO"
    assert {n: op.FALLBACK for n, op in ALL_OPS.items()} == {n: f"slipstream.ops.fallback.{n}" for n in ALL_OPS}
    assert get_builder("cpu_lamb").sources() == ["lamb/cpu_lamb.cpp"]
    assert len(get_builder("async_io").sources()) == 3
    with pytest.raises(ValueError, match="unknown op 'cpu_adamw'; known ops: async_io, cpu_adam, cpu_lamb"):
        get_builder("cpu_adamw")


def test_every_op_declares_sources_that_exist_and_a_fallback() -> None:
    import importlib

    for name, op in ALL_OPS.items():
        assert op.BUILD_VAR.startswith("DS_BUILD_"), name
        assert all(p.is_file() for p in op.source_paths()), name
        importlib.import_module(op.FALLBACK)


def test_build_error_text_names_op_command_and_errors() -> None:
    output = "In file included from x.h\nfoo.cpp:3:5: error: 'bar' was not declared\n   3 |   bar();\nwarning: x\n"
    lines = first_error_lines(output)
    assert lines[0] == "foo.cpp:3:5: error: 'bar' was not declared"
    err = OpBuildError("cpu_adam", "c++ -O3 -c foo.cpp", lines)
    text = str(err)
    assert "'cpu_adam'" in text and "c++ -O3 -c foo.cpp" in text and "'bar' was not declared" in text


def test_cuda_arch_list_parsing() -> None:
    assert toolchain.cuda_arch_flags("8.0;9.0+PTX") == [
        "-gencode=arch=compute_80,code=sm_80",
        "-gencode=arch=compute_90,code=sm_90",
        "-gencode=arch=compute_90,code=compute_90",
    ]
    with pytest.raises(ValueError, match="TORCH_CUDA_ARCH_LIST entry 'sm_80'"):
        toolchain.cuda_arch_flags("sm_80")


def test_cuda_and_rocm_home_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert toolchain.cuda_home() == str(tmp_path)
    monkeypatch.setenv("ROCM_HOME", str(tmp_path))
    assert toolchain.rocm_home() == str(tmp_path)
