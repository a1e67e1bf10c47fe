"""DeepSpeed-format checkpoint tooling (docs/checkpoints.md, "DeepSpeed-format folders"): the 3D reshape maps and
folder descriptor, and `ds_to_universal` over an AutoTP + ZeRO-3 folder written here file by file in DeepSpeed's
layout (tensor-parallel shards split over data-parallel ranks with ZeRO-3's per-parameter padding), compared
with the tensors it was built from: weights and both Adam moments, column- and row-parallel, replicated, uneven
and fused (grouped-query) parameters."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from slipstream.checkpoint.deepspeed.constants import (
    CAT_DIM,
    CHECKPOINT_PARALLEL_DIMS,
    CHECKPOINT_PP_DEGREE,
    CHECKPOINT_TP_DEGREE,
    FP32_FLAT_GROUPS,
    OPTIMIZER_STATE_DICT,
    PARAM,
    PARAM_GROUPS,
    PARAM_SHAPES,
    PARAMETER_WITH_ROW_PARALLELISM_PATTERNS,
    PARAMETER_WITH_SUB_PARAMS,
    SUB_PARAM_SHARD_WIDTHS,
    TP_REPLICATED_PARAMETER_PATTERNS,
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    ZERO_STAGE,
)
from slipstream.checkpoint.deepspeed.folder import DeepSpeedCheckpointFolder, ZeroFiles
from slipstream.checkpoint.deepspeed.layout import ParallelDegrees, get_model_3d_descriptor, parallel_dimensions_record
from slipstream.checkpoint.errors import CheckpointError, ConversionMetadataError
from slipstream.checkpoint.deepspeed.safe_pickle import safe_load
from slipstream.checkpoint.deepspeed.universal import read_universal_checkpoint

MOMENTS = ("exp_avg", "exp_avg_sq")


# ---- reshape maps ----


@pytest.mark.parametrize(
    "source,target,expected",
    [
        # (pp, tp, dp) -> per target dp rank: {(pp, tp): source ZeRO file indices}
        ((2, 2, 2), (1, 1, 1), [{(0, 0): [0, 4, 1, 5, 2, 6, 3, 7]}]),
        ((2, 2, 2), (1, 2, 2), [{(0, 0): [0, 4], (0, 1): [1, 5]}, {(0, 0): [2, 6], (0, 1): [3, 7]}]),
        ((1, 4, 2), (1, 2, 1), [{(0, 0): [0, 4, 1, 5], (0, 1): [2, 6, 3, 7]}]),
        ((2, 1, 4), (2, 1, 2), [{(0, 0): [0, 2], (1, 0): [1, 3]}, {(0, 0): [4, 6], (1, 0): [5, 7]}]),
    ],
)
def test_reshape_maps(source: tuple[int, int, int], target: tuple[int, int, int], expected: list[dict]) -> None:
    maps = ParallelDegrees(*source).reshape(ParallelDegrees(*target))
    assert [{key: m.get_data(*key) for key in want} for m, want in zip(maps, expected)] == expected
    assert len(maps) == target[2]


def test_reshape_refuses_growth() -> None:
    small, big = ParallelDegrees(1, 2, 1), ParallelDegrees(1, 4, 1)
    ok, errors = small.can_reshape(big)
    assert not ok and "TP" in errors[0]
    with pytest.raises(ValueError, match="grow"):
        small.reshape(big)


def _layout(folder: Path, dims: list[Any], zero_per_model: int = 2) -> None:
    for mp, dim in enumerate(dims):
        state: dict[str, Any] = {PARAM_SHAPES: [{}], UNIVERSAL_CHECKPOINT_INFO: {"v": mp}}
        if dim is not None:
            state[CHECKPOINT_PARALLEL_DIMS] = dim
        torch.save(state, folder / f"mp_rank_{mp:02d}_model_states.pt")
        for dp in range(zero_per_model):
            torch.save({}, folder / f"zero_pp_rank_{dp}_mp_rank_{mp:02d}_optim_states.pt")


PP2 = {CHECKPOINT_PP_DEGREE: 2, CHECKPOINT_TP_DEGREE: 1}
TP2 = {CHECKPOINT_PP_DEGREE: 1, CHECKPOINT_TP_DEGREE: 2}


@pytest.mark.parametrize(
    "dims,error",
    [
        ([PP2, None], "missing from model-state files"),
        ([PP2, TP2], "disagrees across model-state files"),
        ([{CHECKPOINT_PP_DEGREE: 4, CHECKPOINT_TP_DEGREE: 1}] * 2, "2 model-state files"),
        ([{CHECKPOINT_PP_DEGREE: 0, CHECKPOINT_TP_DEGREE: 2}] * 2, "positive integer"),
    ],
)
def test_descriptor_errors_name_the_problem(tmp_path: Path, dims: list[Any], error: str) -> None:
    _layout(tmp_path, dims)
    with pytest.raises(CheckpointError, match=error):
        get_model_3d_descriptor(tmp_path)


def test_descriptor_from_records_and_from_counts(tmp_path: Path) -> None:
    (tmp_path / "legacy").mkdir()
    _layout(tmp_path / "legacy", [None, None])  # no records: every model file is a tensor rank
    legacy = get_model_3d_descriptor(tmp_path / "legacy")
    assert (legacy.pp_degree, legacy.tp_degree, legacy.dp_degree) == (1, 2, 2)
    assert ZeroFiles(str(tmp_path / "legacy")).get_src_tp_degree() == 2
    record = parallel_dimensions_record(SimpleNamespace(get_pipe_parallel_world_size=lambda: 2))
    (tmp_path / "recorded").mkdir()
    _layout(tmp_path / "recorded", [record[CHECKPOINT_PARALLEL_DIMS]] * 2)
    folder = DeepSpeedCheckpointFolder(str(tmp_path / "recorded"))
    assert (folder.pp_degree, folder.tp_degree, folder.dp_degree) == (2, 1, 2)
    assert folder.get_checkpoint_info(UNIVERSAL_CHECKPOINT_INFO) == {"v": 0}  # the first file's
    assert folder.get_zero_files(1, 0, 1) == [str(tmp_path / "recorded" / "zero_pp_rank_1_mp_rank_01_optim_states.pt")]


# ---- an AutoTP + ZeRO-3 folder in DeepSpeed's layout ----


def _write_zero3(folder: Path, shards: dict[str, list[dict[str, torch.Tensor]]], dp: int, info: dict) -> None:
    """shards[name][tp] = {"fp32": shard, "exp_avg": ..., "exp_avg_sq": ...}; one sub-group, each parameter
    padded to a multiple of dp and cut in dp pieces, the pieces of one rank concatenated (ZeRO-3's layout)."""
    folder.mkdir(parents=True)
    names = list(shards)
    for tp in range(len(shards[names[0]])):
        shapes = [{name: torch.Size(shards[name][tp]["fp32"].shape) for name in names}]
        for rank in range(dp):
            flats = {}
            for state in ("fp32", *MOMENTS):
                pieces = []
                for name in names:
                    flat = shards[name][tp][state].reshape(-1)
                    per_rank = math.ceil(flat.numel() / dp)
                    padded = torch.cat([flat, torch.zeros(per_rank * dp - flat.numel())])
                    pieces.append(padded[rank * per_rank : (rank + 1) * per_rank])
                flats[state] = torch.cat(pieces)
            stem = folder / f"zero_pp_rank_{rank}_mp_rank_{tp:02d}"
            torch.save({PARAM_SHAPES: shapes, UNIVERSAL_CHECKPOINT_INFO: info}, f"{stem}_model_states.pt")
            optimizer = {
                OPTIMIZER_STATE_DICT: {
                    "state": {0: {"step": torch.tensor(3.0), **{m: flats[m] for m in MOMENTS}}},
                    PARAM_GROUPS: [{"lr": 0.01, "params": [0]}],
                },
                FP32_FLAT_GROUPS: [flats["fp32"]],
                ZERO_STAGE: 3,
            }
            torch.save({OPTIMIZER_STATE_DICT: optimizer}, f"{stem}_optim_states.pt")


def _full(*shape: int) -> dict[str, torch.Tensor]:
    return {state: torch.randn(*shape) for state in ("fp32", *MOMENTS)}


def _split(full: dict[str, torch.Tensor], sizes: list[int], dim: int) -> list[dict[str, torch.Tensor]]:
    parts = {state: value.split(sizes, dim=dim) for state, value in full.items()}
    return [{state: parts[state][r].contiguous() for state in full} for r in range(len(sizes))]


def _convert(source: Path, out: Path, strict: bool = True) -> Path:
    from slipstream.checkpoint.ds_to_universal import main  # DeepSpeed's module path (compat alias)

    args = SimpleNamespace(input_folder=str(source), output_folder=str(out), strict=strict)
    return main(args)


def test_tp2_dp2_zero3_folder_converts_to_whole_tensors_and_adam_states(tmp_path: Path) -> None:
    torch.manual_seed(0)
    column, row, norm, uneven = _full(4, 3), _full(3, 4), _full(5), _full(5, 2)
    shards = {
        "fc.weight": _split(column, [2, 2], 0),
        "proj.weight": _split(row, [2, 2], 1),  # row-parallel: cut along dim 1
        "ln.weight": [norm, {s: v.clone() for s, v in norm.items()}],  # replicated: each rank holds a copy
        "head.weight": _split(uneven, [3, 2], 0),  # uneven: 5 rows over 2 ranks
    }
    info = {
        UNIVERSAL_CHECKPOINT_VERSION_KEY: 0.4,
        PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [r"^proj\.weight$"],
        TP_REPLICATED_PARAMETER_PATTERNS: [r"^ln\.weight$"],
    }
    _write_zero3(tmp_path / "ckpt", shards, dp=2, info=info)
    out = _convert(tmp_path / "ckpt", tmp_path / "universal")
    for name, full in (("fc.weight", column), ("proj.weight", row), ("ln.weight", norm), ("head.weight", uneven)):
        for state, value in full.items():
            written = safe_load(out / "zero" / name / f"{state}.pt")
            assert torch.equal(written[PARAM], value), (name, state)
        assert written.get(CAT_DIM) == (1 if name == "proj.weight" else None if name == "ln.weight" else 0), name
    back = read_universal_checkpoint(out)  # Slipstream's own reader: whole tensors despite per-rank param_shapes
    assert torch.equal(back.master["head.weight"], uneven["fp32"])
    assert torch.equal(back.optimizer_state["proj.weight"]["exp_avg_sq"], row["exp_avg_sq"])
    assert back.optimizer_step == 3 and back.param_groups == [{"lr": 0.01}]


def test_zero3_without_tp_writes_deepspeeds_flat_tensors(tmp_path: Path) -> None:
    torch.manual_seed(1)
    weight, bias = _full(3, 3), _full(3)  # 9 and 3 elements over 2 ranks: both padded
    _write_zero3(tmp_path / "ckpt", {"w": [weight], "b": [bias]}, dp=2, info={})
    out = _convert(tmp_path / "ckpt", tmp_path / "universal")
    assert torch.equal(safe_load(out / "zero" / "w" / "fp32.pt"), weight["fp32"].reshape(-1))
    assert torch.equal(safe_load(out / "zero" / "b" / "exp_avg.pt"), bias["exp_avg"])
    assert read_universal_checkpoint(out).master["w"].shape == (3, 3)


def test_fused_gqa_weight_merges_by_recorded_widths(tmp_path: Path) -> None:
    """q has 4 heads, k and v 2 each (one row per head), over 2 ranks: each rank holds half of each."""
    torch.manual_seed(2)
    full = _full(8, 2)
    q, k, v = (full["fp32"][a:b] for a, b in ((0, 4), (4, 6), (6, 8)))
    pattern = r"^qkv\.weight$"
    info = {
        UNIVERSAL_CHECKPOINT_VERSION_KEY: 0.4,
        PARAMETER_WITH_SUB_PARAMS: [{"patterns": [pattern], "shape": [(4, 2, 2), 2], "partition_dim": 0}],
        SUB_PARAM_SHARD_WIDTHS: {pattern: [[2, 2], [1, 1], [1, 1]]},
    }

    def rank_rows(t: torch.Tensor, r: int) -> torch.Tensor:
        return torch.cat([t[2 * r : 2 * r + 2], t[4 + r : 5 + r], t[6 + r : 7 + r]])

    shards = [{state: rank_rows(value, r) for state, value in full.items()} for r in range(2)]
    assert torch.equal(shards[1]["fp32"], torch.cat([q[2:], k[1:], v[1:]]))
    _write_zero3(tmp_path / "ckpt", {"qkv.weight": shards}, dp=2, info=info)
    out = _convert(tmp_path / "ckpt", tmp_path / "universal")
    for state, value in full.items():
        assert torch.equal(safe_load(out / "zero" / "qkv.weight" / f"{state}.pt")[PARAM], value), state
    # and back: each rank's slice of the universal tensor is what it held
    from slipstream.compat.universal_checkpoint import load_hp_checkpoint_state

    meta = {"partition_dim": 0, "logical_shape": (8, 2), "sub_param_sizes": (4, 2, 2)}
    meta |= {UNIVERSAL_CHECKPOINT_VERSION_KEY: 0.4, "sub_param_shard_widths": [[2, 2], [1, 1], [1, 1]]}
    for rank in range(2):
        param = _fragment_param((4, 2), meta)
        assert load_hp_checkpoint_state(param, str(out / "zero" / "qkv.weight"), rank, 2) is None
        assert torch.equal(param.data, shards[rank]["fp32"])
        assert torch.equal(param._hp_mapping.optim_fragment["exp_avg"], shards[rank]["exp_avg"].reshape(-1))


def test_restore_by_the_files_own_sub_param_shape(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without AutoTP metadata on the parameter, a fused file's recorded sub-parameter shape cuts each rank's
    slice (its halves of q, k and v), whether Slipstream's converter wrote the file or DeepSpeed's (whose
    SubparamShape the restricted loader reads as an inert stub)."""
    from slipstream.checkpoint.deepspeed.subparam import SubparamShape
    from slipstream.compat.universal_checkpoint import load_hp_checkpoint_state

    theirs = _deepspeed_class(monkeypatch, "deepspeed.checkpoint.universal_checkpoint", "SubparamShape", SubparamShape)
    full = torch.arange(16.0).reshape(8, 2)  # q: rows 0-3, k: 4-5, v: 6-7
    for kind in (SubparamShape, theirs):
        folder = tmp_path / kind.__module__ / "qkv.weight"
        folder.mkdir(parents=True)
        torch.save({PARAM: full, "sub_param_shape": kind(["qkv"], ((4, 2, 2), 2), 0)}, folder / "fp32.pt")
        for rank in range(2):
            param = _fragment_param((4, 2), None)
            load_hp_checkpoint_state(param, str(folder), rank, 2)
            want = torch.cat([full[2 * rank : 2 * rank + 2], full[4 + rank : 5 + rank], full[6 + rank : 7 + rank]])
            assert torch.equal(param.data, want), (kind.__module__, rank)


def _fragment_param(shape: tuple[int, ...], meta: dict | None) -> torch.nn.Parameter:
    """A parameter with DeepSpeed's fragment interface: its whole fp32 slice is its fragment."""
    param = torch.nn.Parameter(torch.zeros(shape))
    param._hp_mapping = SimpleNamespace(  # type: ignore[attr-defined]
        lp_fragment_address=SimpleNamespace(start=0, numel=param.numel()),
        get_hp_fragment=lambda: param.data.view(-1),
        optim_fragment={},
    )
    if meta is not None:
        param.ds_autotp_universal_checkpoint_meta = meta  # type: ignore[attr-defined]
    return param


def test_inconsistent_tp_metadata_is_refused(tmp_path: Path) -> None:
    torch.manual_seed(3)
    norm = _full(4)
    different = {s: v + 1 for s, v in norm.items()}
    info = {TP_REPLICATED_PARAMETER_PATTERNS: [r"^ln\.weight$"]}
    _write_zero3(tmp_path / "replicas", {"ln.weight": [norm, different]}, dp=1, info=info)
    with pytest.raises(ConversionMetadataError, match="replicated"):
        _convert(tmp_path / "replicas", tmp_path / "out1")
    pattern = r"^qkv\.weight$"
    sub = {UNIVERSAL_CHECKPOINT_VERSION_KEY: 0.4}
    sub[PARAMETER_WITH_SUB_PARAMS] = [{"patterns": [pattern], "shape": [(2, 2), 2], "partition_dim": 0}]
    _write_zero3(tmp_path / "widths", {"qkv.weight": _split(_full(4, 2), [2, 2], 0)}, dp=1, info=sub)
    with pytest.raises(ConversionMetadataError, match="records no sub_param_shard_widths"):
        _convert(tmp_path / "widths", tmp_path / "out2")
    unused = {TP_REPLICATED_PARAMETER_PATTERNS: [r"^nothing$"]}
    _write_zero3(tmp_path / "unused", {"fc.weight": _split(_full(4, 2), [2, 2], 0)}, dp=1, info=unused)
    with pytest.raises(ConversionMetadataError, match="matched no parameter"):
        _convert(tmp_path / "unused", tmp_path / "out3")
    assert _convert(tmp_path / "unused", tmp_path / "out4", strict=False).is_dir()


def test_incomplete_rank_grid_is_named(tmp_path: Path) -> None:
    _write_zero3(tmp_path / "ckpt", {"fc.weight": _split(_full(4, 2), [2, 2], 0)}, dp=2, info={})
    (tmp_path / "ckpt" / "zero_pp_rank_1_mp_rank_01_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"\(1, 1\)"):
        _convert(tmp_path / "ckpt", tmp_path / "out")


def test_shard_size_list_deals_heads_then_rows() -> None:
    from slipstream.compat.tp_shard import get_shard_size_list

    assert get_shard_size_list(10, 4) == [3, 3, 2, 2]
    assert get_shard_size_list(24, 2, "self_attn.q_proj", num_kv_heads=3) == [16, 8]  # 2 heads, then 1
    assert get_shard_size_list(24, 2, "mlp.up_proj", num_kv_heads=3) == [12, 12]  # MLPs split rows evenly


@pytest.mark.parametrize("stage,world", [(3, 2), (3, 1)])  # DeepSpeed reads a stage-3 source's files at stage 3 only
def test_deepspeed_loads_our_conversion_of_its_zero3_checkpoint(stage: int, world: int, tmp_path: Path) -> None:
    """Real DeepSpeed (peer environment only) loads Slipstream's conversion of a ZeRO-3 checkpoint DeepSpeed saved
    at 2 ranks, at 2 ranks and at 1, every master and exp_avg bit-equal to what DeepSpeed saved."""
    import shutil

    from slipstream.checkpoint.deepspeed.reader import read_deepspeed_checkpoint
    from tests.compat.test_universal_checkpoint import DEEPSPEED, _peer_python, load_in_deepspeed

    peer = _peer_python()
    if peer is None:
        pytest.skip("DeepSpeed peer environment absent (the interop check needs real DeepSpeed)")
    source = DEEPSPEED / "stage3_fp32_ws2"
    shutil.copytree(source / "global_step2", tmp_path / "global_step2")
    (tmp_path / "latest").write_text("global_step2")
    _convert(tmp_path / "global_step2", tmp_path / "global_step2_universal")
    assert (tmp_path / "latest_universal").read_text() == "global_step2_universal"
    saved = read_deepspeed_checkpoint(source)
    expected = {n: {"master": v, "exp_avg": saved.optimizer_state[n]["exp_avg"]} for n, v in saved.master.items()}
    torch.save(expected, tmp_path / "expected.pt")
    result = load_in_deepspeed(peer, tmp_path, stage=stage, world=world)
    assert result["differ"] == [] and result["global_steps"] == 2, result


_DEEPSPEED_CONVERT = """
import sys
from types import SimpleNamespace
from deepspeed.checkpoint.ds_to_universal import main
main(SimpleNamespace(input_folder=sys.argv[1], output_folder=sys.argv[2], num_extract_workers=1,
                     num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False))
"""


def _record(value: Any) -> Any:
    """A universal file's content comparable across sides: SubparamShape (ours, or DeepSpeed's as a stub) as a
    tuple of its fields."""
    from slipstream.checkpoint.deepspeed.safe_pickle import DeepSpeedStub

    if isinstance(value, DeepSpeedStub):
        return (list(value.state["patterns"]), value.state["shape"], value.state["partition_dim"])
    if hasattr(value, "partition_dim"):
        return (list(value.patterns), value.shape, value.partition_dim)
    return value


def test_conversion_equals_deepspeeds_file_by_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's own converter (peer environment only) and Slipstream's, on the same AutoTP + ZeRO-3 folder
    (column, row-parallel, replicated, uneven, fused grouped-query), a ZeRO-3 folder without TP and a ZeRO-1
    folder with two pipeline stages (a tied embedding in both) and two tensor ranks."""
    import subprocess

    from tests.compat.test_universal_checkpoint import _peer_python

    peer = _peer_python()
    if peer is None:
        pytest.skip("DeepSpeed peer environment absent (the comparison needs real DeepSpeed)")
    torch.manual_seed(4)
    qkv = _full(8, 2)

    def rank_rows(t: torch.Tensor, r: int) -> torch.Tensor:
        return torch.cat([t[2 * r : 2 * r + 2], t[4 + r : 5 + r], t[6 + r : 7 + r]])

    norm = _full(5)
    tp_shards = {
        "fc.weight": _split(_full(4, 3), [2, 2], 0),
        "proj.weight": _split(_full(3, 4), [2, 2], 1),
        "ln.weight": [norm, {s: v.clone() for s, v in norm.items()}],
        "head.weight": _split(_full(5, 2), [3, 2], 0),
        "qkv.weight": [{s: rank_rows(v, r) for s, v in qkv.items()} for r in range(2)],
    }
    pattern = r"^qkv\.weight$"
    info = {
        UNIVERSAL_CHECKPOINT_VERSION_KEY: 0.4,
        PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [r"^proj\.weight$"],
        TP_REPLICATED_PARAMETER_PATTERNS: [r"^ln\.weight$"],
        PARAMETER_WITH_SUB_PARAMS: [{"patterns": [pattern], "shape": [(4, 2, 2), 2], "partition_dim": 0}],
        SUB_PARAM_SHARD_WIDTHS: {pattern: [[2, 2], [1, 1], [1, 1]]},
    }
    _write_zero3(tmp_path / "tp", tp_shards, dp=2, info=info)
    _write_zero3(tmp_path / "plain", {"w": [_full(3, 3)], "b": [_full(3)]}, dp=2, info={})
    from slipstream.checkpoint.deepspeed.constants import PIPELINE_REPLICATED_PARAMETER_PATTERNS

    tied = _split(_full(6, 3), [3, 3], 0)
    stages = [
        {"embed.weight": tied, "l0.weight": _split(_full(4, 3), [2, 2], 0), "ln.weight": [norm, norm]},
        {
            "embed.weight": [{s: v.clone() for s, v in t.items()} for t in tied],
            "l1.weight": _split(_full(3, 4), [2, 2], 1),
        },
    ]
    zero1_info = {
        PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [r"^l1\.weight$"],
        TP_REPLICATED_PARAMETER_PATTERNS: [r"^ln\.weight$"],
        PIPELINE_REPLICATED_PARAMETER_PATTERNS: [r"^embed\.weight$"],
    }
    _write_zero12(tmp_path / "zero1", stages, dp=2, info=zero1_info, address=_fragment_address_class(monkeypatch))
    for case in ("tp", "plain", "zero1"):
        theirs, ours = tmp_path / f"{case}_deepspeed", tmp_path / f"{case}_ours"
        done = subprocess.run(
            [peer, "-c", _DEEPSPEED_CONVERT, str(tmp_path / case), str(theirs)],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        _convert(tmp_path / case, ours)
        files = sorted(p.relative_to(theirs) for p in (theirs / "zero").rglob("*.pt") if p.name != "optimizer_state.pt")
        assert files == sorted(
            p.relative_to(ours) for p in (ours / "zero").rglob("*.pt") if p.name != "optimizer_state.pt"
        )
        assert len(files) == {"tp": 15, "plain": 6, "zero1": 16}[case]  # ZeRO-1: a step.pt per parameter too
        for file in files:
            a, b = safe_load(theirs / file), safe_load(ours / file)
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), file
                continue
            if file.name == "step.pt":
                assert a == b, file
                continue
            assert sorted(a) == sorted(b), file
            assert torch.equal(a[PARAM], b[PARAM]), file
            assert {k: _record(v) for k, v in a.items() if k != PARAM} == {
                k: _record(v) for k, v in b.items() if k != PARAM
            }, file


# ---- ZeRO-1/2 folders saved with tensor and pipeline parallelism ----


def _deepspeed_class(monkeypatch: pytest.MonkeyPatch, module: str, name: str, like: type) -> type:
    """A copy of dataclass `like` importable as DeepSpeed's `module.name`, for pickling only: the files must
    name DeepSpeed's class, as DeepSpeed's do (loading goes through the restricted unpickler, which never
    imports it)."""
    import dataclasses
    import sys
    import types

    cls = dataclasses.make_dataclass(name, [(f.name, f.type) for f in dataclasses.fields(like)])
    cls.__module__ = module
    parts = module.split(".")
    for depth in range(1, len(parts) + 1):
        path = ".".join(parts[:depth])
        if not isinstance(sys.modules.get(path), types.ModuleType) or not getattr(sys.modules[path], "_fake", False):
            fake = types.ModuleType(path)
            fake._fake = True  # type: ignore[attr-defined]
            monkeypatch.setitem(sys.modules, path, fake)
    setattr(sys.modules[module], name, cls)
    return cls


def _fragment_address_class(monkeypatch: pytest.MonkeyPatch) -> type:
    """DeepSpeed's `deepspeed.utils.tensor_fragment.fragment_address` (numel, start)."""
    import dataclasses

    @dataclasses.dataclass
    class _Address:
        numel: int
        start: int

    return _deepspeed_class(monkeypatch, "deepspeed.utils.tensor_fragment", "fragment_address", _Address)


def _write_zero12(
    folder: Path, stages: list[dict[str, list[dict[str, torch.Tensor]]]], dp: int, info: dict, address: type
) -> None:
    """stages[pp][name][tp] = that rank's shard states; per (pp, tp) one flat group padded to a multiple of dp and
    cut in dp partitions, each rank's param_slice_mappings locating the fragments it holds (ZeRO-1/2's layout)."""
    folder.mkdir(parents=True)
    tp_degree = len(next(iter(stages[0].values())))
    for pp, params in enumerate(stages):
        for tp in range(tp_degree):
            mp = pp * tp_degree + tp
            shapes = {name: torch.Size(shards[tp]["fp32"].shape) for name, shards in params.items()}
            dims = {CHECKPOINT_PP_DEGREE: len(stages), CHECKPOINT_TP_DEGREE: tp_degree}
            torch.save(
                {PARAM_SHAPES: [shapes], UNIVERSAL_CHECKPOINT_INFO: info, CHECKPOINT_PARALLEL_DIMS: dims},
                folder / f"mp_rank_{mp:02d}_model_states.pt",
            )
            flats = {
                s: torch.cat([shards[tp][s].reshape(-1) for shards in params.values()]) for s in ("fp32", *MOMENTS)
            }
            total = flats["fp32"].numel()
            per_rank = math.ceil(total / dp)
            pad = per_rank * dp - total
            bounds, lo = {}, 0
            for name, shards in params.items():
                bounds[name] = (lo, lo + shards[tp]["fp32"].numel())
                lo = bounds[name][1]
            for rank in range(dp):
                a, b = rank * per_rank, (rank + 1) * per_rank
                part = {s: torch.cat([v, torch.zeros(pad)])[a:b].clone() for s, v in flats.items()}
                mappings = {
                    name: address(numel=min(hi, b) - max(lo, a), start=max(lo, a) - a)
                    for name, (lo, hi) in bounds.items()
                    if min(hi, b) > max(lo, a)
                }
                optimizer = {
                    "base_optimizer_state": {
                        "state": {0: {"step": torch.tensor(5.0), **{m: part[m] for m in MOMENTS}}},
                        PARAM_GROUPS: [{"lr": 0.02, "params": [0]}],
                    },
                    "single_partition_of_fp32_groups": [part["fp32"]],
                    "param_slice_mappings": [mappings],
                    "group_paddings": [pad if rank == dp - 1 else 0],
                    ZERO_STAGE: 1,
                }
                torch.save(
                    {OPTIMIZER_STATE_DICT: optimizer}, folder / f"zero_pp_rank_{rank}_mp_rank_{mp:02d}_optim_states.pt"
                )


def test_tp2_pp2_dp2_zero1_folder_converts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two pipeline stages with their own layers and a tied embedding in both, two tensor ranks, two data ranks."""
    from slipstream.checkpoint.deepspeed.constants import PIPELINE_REPLICATED_PARAMETER_PATTERNS

    address = _fragment_address_class(monkeypatch)
    torch.manual_seed(5)
    embed, l0, l1, out, norm = _full(6, 3), _full(4, 3), _full(3, 4), _full(5, 2), _full(3)
    tied = _split(embed, [3, 3], 0)
    stage0 = {"embed.weight": tied, "l0.weight": _split(l0, [2, 2], 0), "ln.weight": [norm, norm]}
    stage1 = {"embed.weight": [{s: v.clone() for s, v in t.items()} for t in tied], "l1.weight": _split(l1, [2, 2], 1)}
    stage1["out.weight"] = _split(out, [3, 2], 0)  # uneven
    info = {
        PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: [r"^l1\.weight$"],
        TP_REPLICATED_PARAMETER_PATTERNS: [r"^ln\.weight$"],
        PIPELINE_REPLICATED_PARAMETER_PATTERNS: [r"^embed\.weight$"],
    }
    _write_zero12(tmp_path / "ckpt", [stage0, stage1], dp=2, info=info, address=address)
    universal = _convert(tmp_path / "ckpt", tmp_path / "universal")
    for name, full in (("embed.weight", embed), ("l0.weight", l0), ("l1.weight", l1), ("out.weight", out)):
        for state, value in full.items():
            written = safe_load(universal / "zero" / name / f"{state}.pt")
            assert torch.equal(written[PARAM], value), (name, state)
        assert written[CAT_DIM] == (1 if name == "l1.weight" else 0)
        assert float(safe_load(universal / "zero" / name / "step.pt")) == 5.0
    assert torch.equal(safe_load(universal / "zero" / "ln.weight" / "exp_avg.pt")[PARAM], norm["exp_avg"])
    assert safe_load(universal / "zero" / "optimizer_state.pt")[PARAM_GROUPS] == [{"lr": 0.02, "params": [0]}]
    assert sorted(p.name for p in universal.glob("*.pt")) == [f"mp_rank_0{i}_model_states.pt" for i in range(4)]


def test_zero12_folder_without_merge_rules_needs_inject_missing_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from slipstream.checkpoint.ds_to_universal import main

    torch.manual_seed(6)
    weight = _full(4, 2)
    stages = [{"fc.weight": _split(weight, [2, 2], 0)}]
    _write_zero12(tmp_path / "ckpt", stages, dp=2, info=None, address=_fragment_address_class(monkeypatch))  # type: ignore[arg-type]
    args = SimpleNamespace(input_folder=str(tmp_path / "ckpt"), output_folder=str(tmp_path / "out"))
    with pytest.raises(CheckpointError, match="--inject_missing_state"):
        main(args)
    main(SimpleNamespace(**vars(args), inject_missing_state=True))
    assert torch.equal(safe_load(tmp_path / "out" / "zero" / "fc.weight" / "fp32.pt")[PARAM], weight["fp32"])


def test_zero12_fragments_of_a_real_deepspeed_checkpoint(tmp_path: Path) -> None:
    """The fragment reader on files DeepSpeed 0.19.8 wrote (ZeRO-2 bf16, 2 ranks): every master and moment equals
    what the data-parallel reader (the flat-partition arithmetic of zero_to_fp32) gives."""
    from slipstream.checkpoint.deepspeed.reader import read_deepspeed_checkpoint
    from slipstream.checkpoint.deepspeed.zero12_grid import read_zero12_shards
    from tests.compat.test_universal_checkpoint import DEEPSPEED

    shards = read_zero12_shards(DEEPSPEED / "stage2_bf16_ws2" / "global_step2", require_info=False)
    reference = read_deepspeed_checkpoint(DEEPSPEED / "stage2_bf16_ws2")
    assert shards.tp_degree == 1 and sorted(shards.names) == sorted(reference.master)
    for name, value in reference.master.items():
        assert torch.equal(shards.shards[0][name]["fp32"], value), name
        for moment in MOMENTS:
            assert torch.equal(shards.shards[0][name][moment], reference.optimizer_state[name][moment]), name
        assert int(shards.steps[name]) == reference.optimizer_step
