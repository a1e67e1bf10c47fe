"""The restricted loader for foreign .pt pickles: plain tensors load, code-running pickles are refused unrun."""

from __future__ import annotations

import os
import pickle
from collections import Counter, OrderedDict
from pathlib import Path

import pytest
import torch

from slipstream.checkpoint.errors import CheckpointCorrupt, CheckpointError, UnsafeCheckpoint
from slipstream.checkpoint.deepspeed.safe_pickle import DEEPSPEED_STUBS, DeepSpeedStub, pickle_globals, safe_load

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "deepspeed_ckpt"


class _Evil:
    """Unpickling this runs a shell command that creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _assert_refused(path: Path, marker: Path) -> None:
    with pytest.raises(UnsafeCheckpoint) as info:
        safe_load(path)
    assert "system" in str(info.value) and str(path) in str(info.value)
    assert not marker.exists(), "the malicious pickle ran its code"


def test_malicious_zip_checkpoint_is_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    torch.save({"module": {"w": torch.ones(2)}, "payload": _Evil(marker)}, path)
    _assert_refused(path, marker)


@pytest.mark.parametrize("protocol", [2, 4, pickle.HIGHEST_PROTOCOL])
def test_malicious_raw_pickle_is_refused_without_running(tmp_path: Path, protocol: int) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pkl"
    path.write_bytes(pickle.dumps({"a": [1, 2], "b": _Evil(marker)}, protocol=protocol))
    _assert_refused(path, marker)


def test_legacy_torch_file_with_malicious_payload_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil_legacy.pt"
    torch.save({"t": torch.zeros(3), "x": _Evil(marker)}, path, _use_new_zipfile_serialization=False)
    _assert_refused(path, marker)


def test_dynamic_stack_global_is_refused(tmp_path: Path) -> None:
    # PROTO 4, BININT1 1, BININT1 2, STACK_GLOBAL, STOP: the global's name is not a literal string.
    path = tmp_path / "dynamic.pkl"
    path.write_bytes(b"\x80\x04K\x01K\x02\x93.")
    with pytest.raises(UnsafeCheckpoint, match="<dynamic>"):
        safe_load(path)


def test_stack_global_names_are_resolved_through_the_memo(tmp_path: Path) -> None:
    # The second STACK_GLOBAL takes its module string from the memo (BINGET), and Counter is not allowed.
    data = pickle.dumps([OrderedDict(a=1), Counter("ab")], protocol=4)
    assert pickle_globals(data) == ["collections.OrderedDict", "collections.Counter"]
    path = tmp_path / "counter.pkl"
    path.write_bytes(data)
    with pytest.raises(UnsafeCheckpoint, match=r"collections\.Counter"):
        safe_load(path)


def test_plain_tensors_and_containers_load(tmp_path: Path) -> None:
    obj = {"w": torch.arange(6, dtype=torch.bfloat16).view(2, 3), "o": OrderedDict(x=torch.ones(1)),
           "meta": {"steps": 3, "betas": (0.9, 0.999), "names": ["a"], "size": torch.Size([2, 3])}}
    for index, legacy in enumerate((False, True)):
        path = tmp_path / f"plain{index}.pt"
        torch.save(obj, path, _use_new_zipfile_serialization=not legacy)
        loaded = safe_load(path)
        assert torch.equal(loaded["w"], obj["w"]) and loaded["w"].dtype == torch.bfloat16
        assert isinstance(loaded["o"], OrderedDict) and loaded["meta"] == obj["meta"]


def test_deepspeed_globals_become_inert_stubs() -> None:
    osd = safe_load(FIXTURES / "stage2_fp32_ws2" / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    state = osd["optimizer_state_dict"]
    stage, scaler = state["zero_stage"], state["loss_scaler"]
    assert isinstance(stage, DEEPSPEED_STUBS["deepspeed.runtime.zero.config.ZeroStageEnum"]) and stage.value == 2
    assert isinstance(scaler, DeepSpeedStub) and scaler.state == {"cur_scale": 1.0, "dynamic": False}
    fragment = state["param_slice_mappings"][0]["fc1.bias"]
    assert fragment.deepspeed_path.endswith("fragment_address") and fragment.state == {"numel": 16, "start": 14}


def test_missing_and_truncated_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        safe_load(tmp_path / "nope.pt")
    path = tmp_path / "cut.pkl"
    path.write_bytes(pickle.dumps({"a": list(range(100))}, protocol=2)[:40])
    with pytest.raises(CheckpointCorrupt, match="cut.pkl"):
        safe_load(path)
