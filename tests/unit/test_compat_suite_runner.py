"""The acceptance-suite runner's pure parts (compat/deepspeed_suite/run.py): reading the plugin's report
lines, the exclusions file, and the per-folder table. Running the suite itself is `make compat`."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]


def _load(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, _ROOT / path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run = _load("compat/deepspeed_suite/run.py", "deepspeed_suite_run")


def test_folder_of_matches_directories_and_files_by_prefix():
    assert run.folder_of("unit/runtime/zero/test_zero.py::TestX::test[1]") == "runtime/zero"
    assert run.folder_of("unit/runtime/test_ds_config_dict.py::TestBasicConfig::test_accelerator") == (
        "runtime/test_ds_config*"
    )
    assert run.folder_of("unit/runtime/test_lr_schedulers.py::TestOneCycle::test_lr[1]") == "lr_schedules"
    assert run.folder_of("unit/runtime/zeroish/test_a.py::t") is None  # a directory prefix needs its slash
    assert run.folder_of("unit/runtime/test_ds_config_dict.py_other::t") is None


def test_folder_of_takes_a_node_id_path_before_its_files_folder():
    # the LAMB row names classes and a method of files that belong to other rows
    assert run.folder_of("unit/runtime/half_precision/test_fp16.py::TestLambFP16::test__basic") == "lamb"
    assert (
        run.folder_of("unit/runtime/half_precision/test_fp16.py::TestFP16OptimizerForMoE::test_lamb_gradnorm[True]")
        == "lamb"
    )
    assert run.folder_of("unit/runtime/half_precision/test_fp16.py::TestFP16OptimizerForMoE::test_fused_gradnorm") == (
        "runtime/half_precision"
    )
    assert run.folder_of("unit/runtime/half_precision/test_fp16.py::TestLambFP16Other::t") == "runtime/half_precision"
    assert run.folder_of("unit/runtime/half_precision/onebit/test_onebit.py::TestOneBitAdamBasic::test") == (
        "runtime/half_precision/onebit"
    )
    assert run.folder_of("unit/elasticity/test_elastic.py::TestElasticConfigChanged::test") == "lamb"
    assert run.folder_of("unit/elasticity/test_elastic.py::test_basic_10k") is None


def test_data_efficiency_rows_take_their_modules_only():
    # a module row matches its own file: test_data.py is not a prefix of test_data_efficiency.py
    assert run.folder_of("unit/runtime/test_data.py::TestDataLoaderDropLast::test[1-True]") == "runtime/test_data"
    assert run.folder_of("unit/runtime/test_data_efficiency.py::TestDataEfficiency::test_curriculum_learning[x]") == (
        "data_efficiency"
    )
    assert run.folder_of("unit/runtime/test_pld.py::test_pld_schedule[0]") == "progressive_layer_drop"
    assert run.folder_of("unit/ops/sparse_attention/test_sparse_attention.py::test_matmul[x]") == "ops/sparse_attention"
    assert run.folder_of("unit/runtime/sparse_tensor/test_csr.py::test_csr_addition_self") == "runtime/sparse_tensor"


def test_node_id_paths_give_pytest_their_modules_and_select_the_tests():
    paths = [
        "unit/ops/muon",
        "unit/runtime/half_precision/test_fp16.py::TestLambFP16",
        "unit/runtime/half_precision/test_fp16.py::TestLambFP32GradClip",
    ]
    targets, select = run.pytest_targets(paths)
    assert targets == ["unit/ops/muon", "unit/runtime/half_precision/test_fp16.py"]
    assert select == paths
    assert run.pytest_targets(["unit/ops/muon", "unit/utils"]) == (["unit/ops/muon", "unit/utils"], [])
    plugin = _load("compat/deepspeed_suite/suite_plugin.py", "deepspeed_suite_plugin")
    prefixes = {p.rstrip("/") for p in select}
    assert plugin._under("unit/ops/muon/test_muon.py::TestX::test[a]", prefixes)
    assert plugin._under("unit/runtime/half_precision/test_fp16.py::TestLambFP16::test__basic", prefixes)
    assert not plugin._under("unit/runtime/half_precision/test_fp16.py::TestLambFP16Other::test", prefixes)
    assert not plugin._under("unit/runtime/half_precision/test_fp16.py::TestAdamFP32EmptyGrad::test", prefixes)
    assert plugin._under("unit/a.py::test_f[1]", {"unit/a.py::test_f"})
    assert not plugin._under("unit/a.py::test_fg", {"unit/a.py::test_f"})


def test_read_jsonl_keeps_tests_and_collection_errors_apart():
    lines = [
        json.dumps({"id": "unit/utils/test_a.py::t1", "outcome": "failed", "seconds": 1.0, "message": "E1"}),
        "",
        json.dumps({"id": "unit/utils/test_b.py", "outcome": "collect-error", "seconds": 0, "message": "no x"}),
        json.dumps({"id": "unit/utils/test_a.py::t1", "outcome": "passed", "seconds": 2.0, "message": ""}),
    ]
    tests, errors = run.read_jsonl(lines)
    assert tests == {"unit/utils/test_a.py::t1": {"outcome": "passed", "message": "", "seconds": 2.0}}
    assert errors == {"unit/utils/test_b.py": "no x"}
    assert run.outcome_for("unit/utils/test_b.py::t2", tests, errors)["message"] == "collection: no x"
    assert run.outcome_for("unit/utils/test_c.py::t", tests, errors)["outcome"] == "error"


def test_exclusions_need_a_reason_and_match_by_prefix():
    exclusions = run.read_exclusions(["# comment", "", "unit/utils/test_a.py::TestX  # reads bit16_groups"])
    assert exclusions == {"unit/utils/test_a.py::TestX": "reads bit16_groups"}
    assert run.is_excluded("unit/utils/test_a.py::TestX::test[1]", exclusions)
    assert not run.is_excluded("unit/utils/test_a.py::TestY::test", exclusions)
    with pytest.raises(ValueError, match="line 1.*no reason"):
        run.read_exclusions(["unit/utils/test_a.py::TestX"])


def test_table_counts_per_folder_against_deepspeed_passes_less_exclusions():
    deepspeed = {
        "unit/utils/test_a.py::t1": "passed",
        "unit/utils/test_a.py::t2": "passed",
        "unit/utils/test_a.py::t3": "passed",
        "unit/utils/test_a.py::t4": "failed",  # not in the denominator
        "unit/launcher/test_run.py::t": "passed",
    }
    slipstream = {
        "unit/utils/test_a.py::t1": "passed",
        "unit/utils/test_a.py::t2": "failed",
        "unit/utils/test_a.py::t4": "passed",
    }
    rows = {row[0]: row[1:] for row in run.table_rows(deepspeed, slipstream, {"unit/utils/test_a.py::t3": "why"})}
    assert rows["utils"] == (3, 1, 1, 50.0)
    assert rows["launcher"] == (1, 0, 0, 0.0)
    assert rows["total"] == (4, 1, 1, pytest.approx(100 / 3))
    text = run.format_table(run.table_rows(deepspeed, slipstream, {}))
    assert "utils" in text and "33.3%" in text
    muon_row = [line for line in text.splitlines() if line.startswith("ops/muon ")]
    assert muon_row[0].split()[1:] == ["0", "0", "0", "-"]  # a row DeepSpeed passes none of has no share


def test_summary_round_trips_to_outcomes():
    summary = run.summarise(
        {"a::t": {"outcome": "failed", "message": "AssertionError: x: y"}, "b::t": {"outcome": "passed", "message": ""}}
    )
    assert summary == {"a::t": "failed: AssertionError: x: y", "b::t": "passed"}
    assert run.outcomes(summary) == {"a::t": "failed", "b::t": "passed"}


def test_causes_group_failures_and_drop_paths_and_numbers():
    slipstream = {
        "unit/a/test_x.py::t1": "error: collection: ModuleNotFoundError: No module named 'deepspeed.pipe'",
        "unit/a/test_y.py::t2": "error: collection: ModuleNotFoundError: No module named 'deepspeed.pipe'",
        "unit/b/test_z.py::t3": "failed: AssertionError: 3 != 4 in /tmp/x/y.py",
        "unit/b/test_z.py::t4": "passed",
    }
    text = run.causes_markdown(slipstream, list(slipstream) + ["unit/c/test_w.py::t5"])
    lines = text.splitlines()
    assert lines[2] == "| `ModuleNotFoundError: No module named 'deepspeed.pipe'` | 2 | a/test_x.py, a/test_y.py |"
    assert "| `AssertionError: <n> != <n> in <path>` | 1 | b/test_z.py |" in lines
    assert "| `not run` | 1 | c/test_w.py |" in lines  # a test the side never reported
    assert "t4" not in text


def test_recorded_messages_and_defaults_name_no_machine_directory():
    places = {"<workdir>": "/scratch/suite", "<tmp>": "/scratch", "<slipstream_src>": "/home/me/src/", "<repo>": ""}
    side = {
        "unit/a.py::t": {"outcome": "failed", "message": "E: no file '/scratch/suite/tests/x.pt'\n in /scratch/y"},
        "unit/b.py::t": {"outcome": "error", "message": "ImportError (/home/me/src/slipstream/zero/init.py)"},
    }
    assert run.summarise(side, places) == {
        "unit/a.py::t": "failed: E: no file '<workdir>/tests/x.pt'  in <tmp>/y",
        "unit/b.py::t": "error: ImportError (<slipstream_src>/slipstream/zero/init.py)",
    }
    assert Path(run.DEFAULT_REPO) == _ROOT.parent / "DeepSpeed"
    for results in sorted((_ROOT / "compat" / "deepspeed_suite").glob("results*.json")):
        found = re.findall(r"(?<![\w.>])/(?:tmp|home|work|root)/[^\s'\"]*", results.read_text())
        assert not found, f"{results.name} names a machine's directories: {found[:3]}"


def test_beyond_keeps_the_tests_outside_the_denominator_apart():
    onebit = "unit/runtime/half_precision/onebit/test_onebit.py"
    muon = "unit/ops/muon/test_muon_partial_training.py::T::test_a"
    tests = {
        muon: {"outcome": "passed", "message": "", "seconds": 1.0},
        f"{onebit}::TestOneBitAdamBasic::test[fp32]": {"outcome": "passed", "message": "", "seconds": 1.0},
    }
    earlier = {"slipstream_beyond": {"unit/utils/test_x.py::t": "passed", f"{onebit}::Gone::test": "failed: x"}}
    out = run.beyond_results(
        earlier, tests, {"unit/ops/muon/test_muon.py": "E"}, [muon], ["ops/muon", "runtime/half_precision/onebit"], {}
    )
    assert out == {
        "unit/utils/test_x.py::t": "passed",  # another folder's earlier outcome is kept
        f"{onebit}::TestOneBitAdamBasic::test[fp32]": "passed",
        "unit/ops/muon/test_muon.py": "error: collection: E",
    }
