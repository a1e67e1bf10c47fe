"""Import of real DeepSpeed 0.19.8 checkpoints (tests/fixtures/deepspeed_ckpt, from tools/make_deepspeed_fixtures.py).

Each fixture's expected.json is DeepSpeed's own full view after two AdamW steps (gathered module weights, fp32
masters from safe_get_full_fp32_param, Adam moments from safe_get_full_optimizer_state).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from slipstream.checkpoint.deepspeed.reader import is_deepspeed_checkpoint, read_deepspeed_checkpoint
from slipstream.checkpoint.errors import CheckpointError
from slipstream.checkpoint.deepspeed.safe_pickle import safe_load

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "deepspeed_ckpt"
CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "expected.json").is_file())
# bf16 keeps 8 significant bits: one rounding of a value is within 2**-8 relative.
BF16_RTOL = 2.0**-8


def _expected(case: str) -> dict[str, Any]:
    return json.loads((FIXTURES / case / "expected.json").read_text())


def _check(actual: dict[str, torch.Tensor], expected: dict[str, list[float]], *, rtol: float, what: str) -> None:
    assert set(actual) == set(expected), f"{what}: names differ: {set(actual) ^ set(expected)}"
    for name, values in expected.items():
        want = torch.tensor(values, dtype=torch.float32)
        got = actual[name].float().reshape(-1)
        torch.testing.assert_close(got, want, rtol=rtol, atol=0.0, msg=lambda m, n=name: f"{what}[{n}]: {m}")


def test_all_cases_are_present() -> None:
    assert CASES == ["stage0_bf16_ws2", "stage0_fp32_ws1", "stage1_fp32_ws2", "stage2_bf16_ws2",
                     "stage2_fp32_ws2", "stage3_bf16_ws2", "stage3_fp32_ws2"]


@pytest.mark.parametrize("case", CASES)
def test_fixture_matches_deepspeeds_view(case: str) -> None:
    exp = _expected(case)
    assert is_deepspeed_checkpoint(FIXTURES / case)
    ckpt = read_deepspeed_checkpoint(FIXTURES / case)
    assert (ckpt.tag, ckpt.zero_stage, ckpt.world_size, ckpt.dtype) == (
        exp["tag"], exp["zero_stage"], exp["world_size"], exp["dtype"])
    module_rtol = BF16_RTOL if exp["dtype"] == "bf16" else 0.0
    _check(ckpt.module, exp["module"], rtol=module_rtol, what="module")
    _check(ckpt.master, exp["master"], rtol=0.0, what="master")
    for key in ("exp_avg", "exp_avg_sq"):
        moments = {name: state[key] for name, state in ckpt.optimizer_state.items() if key in state}
        _check(moments, exp[key], rtol=0.0, what=key)
    for name, tensor in ckpt.master.items():
        assert tensor.dtype == torch.float32 and tensor.shape == ckpt.module[name].shape, name
    assert ckpt.scalars["global_steps"] == exp["global_steps"] == 2
    assert ckpt.scalars["lr_scheduler"] == {"last_batch_iteration": 1}
    assert ckpt.client_state == exp["client_state"]
    assert ckpt.param_groups and "params" not in ckpt.param_groups[0]
    assert ckpt.param_groups[0]["betas"] == (0.9, 0.999) and ckpt.param_groups[0]["weight_decay"] == 0.01
    # DeepSpeed's bf16 stage-0 wrapper (FP16_UnfusedOptimizer) takes one extra optimizer step at init.
    assert ckpt.optimizer_step == (3 if case == "stage0_bf16_ws2" else 2)


def test_module_dtype_is_kept_and_buffers_stay_fp32() -> None:
    ckpt = read_deepspeed_checkpoint(FIXTURES / "stage3_bf16_ws2")
    assert ckpt.module["fc1.weight"].dtype == torch.bfloat16 and ckpt.module["fc1.weight"].shape == (16, 8)
    assert ckpt.module["out_scale"].dtype == torch.float32
    assert ckpt.module["frozen_bias"].tolist() == [-1.0, -0.5, 0.0, 0.5, 1.0]  # padded fragments merged
    assert "frozen_bias" not in ckpt.master and ckpt.scalars["loss_scaler"]["cur_scale"] == 1.0


def test_tag_argument_and_tag_directory(tmp_path: Path) -> None:
    case = FIXTURES / "stage1_fp32_ws2"
    by_tag = read_deepspeed_checkpoint(case, tag="global_step2")
    by_dir = read_deepspeed_checkpoint(case / "global_step2")
    assert by_tag.tag == by_dir.tag == "global_step2"
    assert all(torch.equal(by_tag.master[n], by_dir.master[n]) for n in by_tag.master)
    assert not is_deepspeed_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="not a DeepSpeed checkpoint"):
        read_deepspeed_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="global_step9"):
        read_deepspeed_checkpoint(case, tag="global_step9")


@pytest.mark.parametrize(("case", "missing"), [
    ("stage2_fp32_ws2", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ("stage3_bf16_ws2", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    ("stage3_fp32_ws2", "zero_pp_rank_1_mp_rank_00_model_states.pt"),
    ("stage3_fp32_ws2", "zero_pp_rank_0_mp_rank_00_model_states.pt"),
])
def test_missing_rank_file_is_named(tmp_path: Path, case: str, missing: str) -> None:
    copy = tmp_path / case
    shutil.copytree(FIXTURES / case, copy)
    (copy / "global_step2" / missing).unlink()
    with pytest.raises(CheckpointError, match="incomplete") as info:
        read_deepspeed_checkpoint(copy)
    assert missing in str(info.value)


def test_unknown_zero_stage_is_named(tmp_path: Path) -> None:
    copy = tmp_path / "stage2"
    shutil.copytree(FIXTURES / "stage2_fp32_ws2", copy)
    for rank in range(2):
        path = copy / "global_step2" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        state = safe_load(path)
        osd = state["optimizer_state_dict"]
        # Stubs cannot be re-pickled (DeepSpeed is not importable here): replace them with plain values.
        osd.update(zero_stage=7, loss_scaler={"cur_scale": 1.0}, param_slice_mappings=[])
        torch.save(state, path)
    with pytest.raises(CheckpointError, match="unknown zero_stage 7"):
        read_deepspeed_checkpoint(copy)
