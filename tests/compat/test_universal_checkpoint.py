"""Universal checkpoints (DeepSpeed's `ds_to_universal` layout): DeepSpeed's own conversions of two fixtures load
into the engine at another world size and stage (`checkpoint.load_universal` and `latest_universal`), and
Slipstream's `ds_to_universal` converts a DeepSpeed checkpoint into the same tensors and a Slipstream checkpoint
into one that loads back equal to the original."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from slipstream.checkpoint.deepspeed.reader import read_deepspeed_checkpoint
from slipstream.checkpoint.errors import CheckpointError
from slipstream.checkpoint.deepspeed.universal import is_universal_checkpoint, read_universal_checkpoint
from tests.compat.test_checkpoint_single import TinyNet, _engine, _train, _train_tiny

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
DEEPSPEED = FIXTURES / "deepspeed_ckpt"
UNIVERSAL = FIXTURES / "deepspeed_universal"


def _convert(source: Path, out: Path) -> Path:
    from slipstream.checkpoint.ds_to_universal import main, parse_arguments  # DeepSpeed's module path

    return main(parse_arguments(["--input_folder", str(source), "--output_folder", str(out)]))


def _step_both_and_compare(universal: Any, direct: Any) -> None:
    """One more step on both engines: the masters stay equal."""
    _train(universal, steps=1)
    _train(direct, steps=1)
    for a, b in zip(
        universal.optimizer.owned_slices(universal._param_names, for_save=False),
        direct.optimizer.owned_slices(direct._param_names, for_save=False),
    ):
        assert torch.equal(a.master, b.master), a.name


@pytest.mark.parametrize("case,stage", [("stage2_bf16_ws2", 1), ("stage3_fp32_ws2", 2)])
def test_deepspeeds_universal_checkpoint_loads_into_the_engine(case: str, stage: int) -> None:
    """Saved by DeepSpeed at 2 ranks, converted by DeepSpeed, loaded here at 1 rank and another stage."""
    expected = json.loads((DEEPSPEED / case / "expected.json").read_text())
    bf16 = expected["dtype"] == "bf16"
    engine = _engine(stage=stage, model=TinyNet(), bf16={"enabled": bf16}, checkpoint={"load_universal": True})
    path, client = engine.load_checkpoint(UNIVERSAL / case)  # the tag comes from latest_universal
    assert path is not None and Path(path).name == "global_step2_universal"
    assert client == expected["client_state"] and engine.global_steps == expected["global_steps"]
    for piece in engine.optimizer.owned_slices(engine._param_names, for_save=False):
        for key, have in (("master", piece.master), ("exp_avg", None), ("exp_avg_sq", None)):
            if have is None:
                have = piece.state_view(engine.optimizer.optimizer.state[piece.piece], key)
            want = torch.tensor(expected[key][piece.name]).reshape(-1)[piece.lo : piece.hi]
            torch.testing.assert_close(have, want, rtol=0, atol=0, msg=lambda m, k=key, n=piece.name: f"{k} {n}: {m}")
    _train_tiny(engine, expected)  # the optimizer step count and hyperparameters came along: the next step is exact


@pytest.mark.parametrize("case", ["stage2_bf16_ws2", "stage3_fp32_ws2"])
def test_conversion_of_a_deepspeed_checkpoint_matches_deepspeeds(case: str, tmp_path: Path) -> None:
    ours = read_universal_checkpoint(_convert(DEEPSPEED / case / "global_step2", tmp_path / "universal"))
    theirs = read_universal_checkpoint(UNIVERSAL / case / "global_step2_universal")
    source = read_deepspeed_checkpoint(DEEPSPEED / case)
    assert ours.optimizer_step == theirs.optimizer_step == source.optimizer_step == 2
    assert ours.param_groups == theirs.param_groups and ours.scalars["global_steps"] == 2
    for name, value in source.master.items():
        assert torch.equal(ours.master[name], value) and torch.equal(theirs.master[name], value), name
        for key in ("exp_avg", "exp_avg_sq"):
            want = source.optimizer_state[name][key]
            assert torch.equal(ours.optimizer_state[name][key], want), (name, key)
            assert torch.equal(theirs.optimizer_state[name][key], want), (name, key)
    for name, value in source.module.items():
        assert torch.equal(ours.module[name], value), name
    # written next to the input folder? no: tmp_path is elsewhere, so no latest_universal was written there
    assert not (DEEPSPEED / case / "latest_universal").exists()


def test_slipstream_checkpoint_round_trip_at_another_stage(tmp_path: Path) -> None:
    engine = _engine(stage=2, bf16={"enabled": True})
    _train(engine, steps=3)
    engine.save_checkpoint(tmp_path)
    out = _convert(tmp_path / "global_step3", tmp_path / "global_step3_universal")
    assert is_universal_checkpoint(out) and (tmp_path / "latest_universal").read_text() == out.name
    assert (out / "zero" / "layers.0.weight" / "exp_avg.pt").is_file() and (
        out / "zero" / "optimizer_state.pt"
    ).is_file()

    direct = _engine(stage=3, bf16={"enabled": True})
    direct.load_checkpoint(tmp_path)  # `latest`: the native checkpoint
    universal = _engine(stage=3, bf16={"enabled": True}, checkpoint={"load_universal": True})
    path, _ = universal.load_checkpoint(tmp_path)  # `latest_universal`
    assert Path(path) == out and universal.global_steps == direct.global_steps == 3
    mine = universal.optimizer.owned_slices(universal._param_names, for_save=False)
    ref = direct.optimizer.owned_slices(direct._param_names, for_save=False)
    for a, b in zip(mine, ref):
        assert a.name == b.name and torch.equal(a.master, b.master), a.name
        for key in ("exp_avg", "exp_avg_sq"):
            sa = a.state_view(universal.optimizer.optimizer.state[a.piece], key)
            sb = b.state_view(direct.optimizer.optimizer.state[b.piece], key)
            assert torch.equal(sa, sb), (a.name, key)
    _step_both_and_compare(universal, direct)


def test_muon_momentum_goes_through_the_universal_layout(tmp_path: Path) -> None:
    """Every optimizer state shaped like its parameter is converted, not only Adam's two moments."""
    muon = {"optimizer": {"type": "Muon", "params": {"lr": 1e-2}}}
    engine = _engine(stage=1, **muon)
    _train(engine, steps=2)
    engine.save_checkpoint(tmp_path)
    out = _convert(tmp_path / "global_step2", tmp_path / "global_step2_universal")
    assert (out / "zero" / "layers.0.weight" / "momentum_buffer.pt").is_file()

    direct = _engine(stage=2, **muon)
    direct.load_checkpoint(tmp_path)
    universal = _engine(stage=2, checkpoint={"load_universal": True}, **muon)
    universal.load_checkpoint(tmp_path)
    compared = 0
    for a, b in zip(
        universal.optimizer.owned_slices(universal._param_names, for_save=False),
        direct.optimizer.owned_slices(direct._param_names, for_save=False),
    ):
        sa = universal.optimizer.optimizer.state[a.piece]
        sb = direct.optimizer.optimizer.state[b.piece]
        keys = {k for k, v in sb.items() if isinstance(v, torch.Tensor) and v.numel() == b.piece.numel()}
        for key in keys:
            assert torch.equal(a.state_view(sa, key), b.state_view(sb, key)), (a.name, key)
            compared += key == "momentum_buffer"
    assert compared > 0
    _step_both_and_compare(universal, direct)


def test_broken_universal_checkpoints_are_named(tmp_path: Path) -> None:
    copy = tmp_path / "u"
    shutil.copytree(UNIVERSAL / "stage2_bf16_ws2" / "global_step2_universal", copy)
    (copy / "zero" / "fc1.weight" / "fp32.pt").unlink()
    with pytest.raises(CheckpointError, match="fc1.weight has no fp32.pt"):
        read_universal_checkpoint(copy)
    torch.save(torch.zeros(5), copy / "zero" / "fc1.weight" / "fp32.pt")
    with pytest.raises(CheckpointError, match="5 elements.*fc1.weight"):
        read_universal_checkpoint(copy)
    with pytest.raises(CheckpointError, match="not a universal checkpoint"):
        read_universal_checkpoint(tmp_path / "nothing")
    with pytest.raises(CheckpointError, match="neither a Slipstream checkpoint"):
        _convert(tmp_path / "nothing", tmp_path / "out")


def _peer_python() -> str | None:
    """The DeepSpeed peer interpreter (SLIPSTREAM_PEER_PYTHON, else .bench-venv from bench/make_peer_venv.sh)."""
    import os
    import subprocess

    candidate = os.environ.get("SLIPSTREAM_PEER_PYTHON") or str(
        Path(__file__).resolve().parents[2] / ".bench-venv/bin/python"
    )
    if not Path(candidate).is_file():
        return None
    probe = subprocess.run([candidate, "-c", "import deepspeed"], capture_output=True, timeout=120)
    return candidate if probe.returncode == 0 else None


def load_in_deepspeed(peer: str, tmp_path: Path, *, stage: int, world: int) -> dict:
    """Run peer/load_universal_in_deepspeed.py in DeepSpeed's environment on `tmp_path` (its universal checkpoint
    and expected.pt); its JSON result. A failure shows the traceback without torch's deprecation warnings."""
    import subprocess

    script = Path(__file__).parent / "peer" / "load_universal_in_deepspeed.py"
    done = subprocess.run(
        [peer, str(script), str(tmp_path), str(tmp_path / "expected.pt"), str(stage), str(world)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    errors = [line for line in done.stderr.splitlines() if "Warning" not in line and "warnings.warn" not in line]
    assert done.returncode == 0, "\n".join(errors)[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("stage,world", [(1, 2), (2, 1)])
def test_deepspeed_loads_a_universal_checkpoint_slipstream_wrote(stage: int, world: int, tmp_path: Path) -> None:
    """Both ways: real DeepSpeed reads Slipstream's conversion of a Slipstream checkpoint, every master and moment
    bit-equal, at another world size and stage (peer environment only: DeepSpeed is never a dependency)."""

    peer = _peer_python()
    if peer is None:
        pytest.skip("DeepSpeed peer environment absent (the interop check needs real DeepSpeed)")
    engine = _engine(stage=2, model=TinyNet())
    _train_ds(engine)
    engine.save_checkpoint(tmp_path)
    _convert(tmp_path / "global_step2", tmp_path / "global_step2_universal")
    from slipstream.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    expected = {
        name: {"master": safe_get_full_fp32_param(p), "exp_avg": safe_get_full_optimizer_state(p, "exp_avg")}
        for name, p in engine.module.named_parameters()
        if p.requires_grad
    }
    torch.save(expected, tmp_path / "expected.pt")
    result = load_in_deepspeed(peer, tmp_path, stage=stage, world=world)
    assert result["differ"] == [] and result["global_steps"] == 2, result
    assert result["path"].endswith("global_step2_universal/mp_rank_00_model_states.pt"), result


def _train_ds(engine: Any) -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        x = torch.randn(4, 8, generator=gen)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
