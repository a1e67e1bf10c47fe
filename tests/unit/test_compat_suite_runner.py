"""The acceptance-suite runner's pure parts (compat/deepspeed_suite/run.py): reading the plugin's report
lines, the exclusions file, and the per-folder table. Running the suite itself is `make compat`."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "compat" / "deepspeed_suite" / "run.py"
_spec = importlib.util.spec_from_file_location("deepspeed_suite_run", _PATH)
assert _spec is not None and _spec.loader is not None
run = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run)


def test_folder_of_matches_directories_and_files_by_prefix():
    assert run.folder_of("unit/runtime/zero/test_zero.py::TestX::test[1]") == "runtime/zero"
    assert run.folder_of("unit/runtime/test_ds_config_dict.py::TestBasicConfig::test_accelerator") == (
        "runtime/test_ds_config*"
    )
    assert run.folder_of("unit/runtime/test_lr_schedulers.py::TestOneCycle::test_lr[1]") == "lr_schedules"
    assert run.folder_of("unit/runtime/zeroish/test_a.py::t") is None  # a directory prefix needs its slash
    assert run.folder_of("unit/runtime/test_ds_config_dict.py_other::t") is None


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
    assert Path(run.DEFAULT_REPO) == _PATH.parents[2].parent / "DeepSpeed"
    for results in sorted(_PATH.parent.glob("results*.json")):
        found = re.findall(r"(?<![\w.>])/(?:tmp|home|work|root)/[^\s'\"]*", results.read_text())
        assert not found, f"{results.name} names a machine's directories: {found[:3]}"
