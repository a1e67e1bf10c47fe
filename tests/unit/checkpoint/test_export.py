"""Export to HF-style safetensors: roundtrip, shards + index, dtype, CLI, DeepSpeed names and peak memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from slipstream.checkpoint.direct_io import BUFFER_BYTES
from slipstream.checkpoint.errors import CheckpointCorrupt, CheckpointError
from slipstream.checkpoint.export import export_checkpoint, parse_size
from slipstream.checkpoint.safetensors_io import SafetensorsFile
from slipstream.cli.main import main as cli_main
from slipstream.utils.zero_to_fp32 import (convert_zero_checkpoint_to_fp32_state_dict,
                                           get_fp32_state_dict_from_zero_checkpoint,
                                           load_state_dict_from_zero_checkpoint)

from .builder import write_checkpoint

REPO = Path(__file__).resolve().parents[3]


def _model_checkpoint(save_dir: Path, tag: str = "global_step3") -> dict[str, torch.Tensor]:
    weights = {"embed.weight": torch.randn(16, 8), "fc.weight": torch.randn(8, 8).bfloat16(),
               "fc.bias": torch.randn(8).bfloat16(), "count": torch.tensor([3, 4])}
    tensors = {f"module/{k}": v for k, v in weights.items()}
    tensors["optimizer/embed.weight/exp_avg"] = torch.randn(16, 8)
    write_checkpoint(save_dir / tag, tensors, num_files=2, frozen=("module/fc.bias",))
    (save_dir / "latest").write_text(tag)
    return weights


def _load_dir(out: Path) -> dict[str, torch.Tensor]:
    loaded = {}
    for path in sorted(out.glob("*.safetensors")):
        with SafetensorsFile(path) as handle:
            assert handle.metadata == {"format": "pt"}
            loaded.update({name: handle.get(name) for name in handle.keys()})  # noqa: SIM118
    return loaded


def test_parse_size() -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("1.5GiB") == 3 * 2**29
    assert parse_size(" 12 kib ") == 12 * 1024
    assert parse_size(1234) == parse_size("1234") == 1234
    for bad in ("5 parsecs", "-1GB", "0", "GB", True):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)  # type: ignore[arg-type]


def test_single_file_roundtrip_keeps_dtypes(tmp_path: Path) -> None:
    weights = _model_checkpoint(tmp_path / "ckpt")
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]  # one shard: no index (HF)
    loaded = _load_dir(out)
    assert list(loaded) == list(weights)  # no optimizer state, no prefix
    for name, expected in weights.items():
        assert loaded[name].dtype == expected.dtype and torch.equal(loaded[name], expected), name


def test_shards_index_and_cast(tmp_path: Path) -> None:
    weights = _model_checkpoint(tmp_path / "ckpt")
    # 256 + 128 + 16 + 16 bytes in fp16 (ints stay int64): a 300-byte limit gives [embed] [fc.weight, bias, count]
    out = export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", tag="global_step3", dtype="fp16",
                            max_shard_size=300, progress=False)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 128 * 2 + 64 * 2 + 8 * 2 + 2 * 8
    assert index["weight_map"] == {"embed.weight": "model-00001-of-00002.safetensors",
                                   "fc.weight": "model-00002-of-00002.safetensors",
                                   "fc.bias": "model-00002-of-00002.safetensors",
                                   "count": "model-00002-of-00002.safetensors"}
    loaded = _load_dir(out)
    assert loaded["count"].dtype == torch.int64 and torch.equal(loaded["count"], weights["count"])
    for name in ("embed.weight", "fc.weight", "fc.bias"):
        assert loaded[name].dtype == torch.float16
        assert torch.equal(loaded[name], weights[name].to(torch.float16)), name
    st = pytest.importorskip("safetensors.torch")
    assert torch.equal(st.load_file(str(out / "model-00001-of-00002.safetensors"))["embed.weight"],
                       weights["embed.weight"].half())


def test_export_errors(tmp_path: Path) -> None:
    _model_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="export dtype 'int8'"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", dtype="int8")
    write_checkpoint(tmp_path / "opt_only", {"optimizer/w/exp_avg": torch.zeros(3)})
    with pytest.raises(CheckpointError, match="no model tensors"):
        export_checkpoint(tmp_path / "opt_only", tmp_path / "hf2", progress=False)
    shard = tmp_path / "ckpt" / "global_step3" / "rank001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1] + b"\x7f")
    with pytest.raises(CheckpointCorrupt, match="rank001.safetensors: sha256"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "hf3", progress=False)
    # the files are hashed while the export reads them: what it wrote before finding the damage is deleted
    assert not any((tmp_path / "hf3").iterdir())


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    weights = _model_checkpoint(tmp_path / "ckpt")
    code = cli_main(["export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--dtype", "bf16",
                     "--max-shard-size", "1KB", "--no-progress"])
    assert code == 0 and "exported to" in capsys.readouterr().out
    assert _load_dir(tmp_path / "hf")["embed.weight"].dtype == torch.bfloat16
    assert torch.equal(_load_dir(tmp_path / "hf")["fc.weight"], weights["fc.weight"])
    assert cli_main(["export", str(tmp_path / "nothing"), str(tmp_path / "hf2"), "--no-progress"]) == 1
    assert "neither manifest.json nor a `latest` file" in capsys.readouterr().err


def test_deepspeed_zero_to_fp32_names(tmp_path: Path) -> None:
    weights = _model_checkpoint(tmp_path / "ckpt")
    state = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    assert list(state) == list(weights)
    assert state["fc.weight"].dtype == torch.float32 and state["count"].dtype == torch.int64
    assert torch.equal(state["fc.weight"], weights["fc.weight"].float())
    unfrozen = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt", tag="global_step3",
                                                        exclude_frozen_parameters=True)
    assert "fc.bias" not in unfrozen and "fc.weight" in unfrozen

    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "fp32", max_shard_size="700B",
                                               safe_serialization=True)
    loaded = _load_dir(tmp_path / "fp32")
    assert (tmp_path / "fp32" / "model.safetensors.index.json").exists()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
    # DeepSpeed's default: pytorch_model.bin (torch.save of the state dict), sharded with an index past the limit
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "bin")
    single = torch.load(tmp_path / "bin" / "pytorch_model.bin", weights_only=True)
    assert list(single) == list(state) and all(torch.equal(single[k], v) for k, v in state.items())
    convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "ckpt", tmp_path / "bins", max_shard_size="700B")
    index = json.loads((tmp_path / "bins" / "pytorch_model.bin.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"pytorch_model-00001-of-{len(files):05d}.bin"
    merged = {k: v for f in files for k, v in torch.load(tmp_path / "bins" / f, weights_only=True).items()}
    assert set(merged) == set(state) and all(torch.equal(merged[k], v) for k, v in state.items())

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(16, 8)
    model.fc = torch.nn.Linear(8, 8)
    returned = load_state_dict_from_zero_checkpoint(model, tmp_path / "ckpt")
    assert returned is model
    assert torch.equal(model.embed.weight.detach(), weights["embed.weight"])
    assert torch.equal(model.fc.bias.detach(), weights["fc.bias"].float())


_PEAK_SCRIPT = """
import json, re, sys
import torch
from slipstream.checkpoint.export import export_checkpoint
from slipstream.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
big, small, out = sys.argv[1:4]

def kib(field):
    return int(re.search(field + r":\\s+(\\d+)", open("/proc/self/status").read()).group(1))

def peak_growth(fn):
    open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current RSS
    before = kib("VmRSS")
    result = fn()
    return (kib("VmHWM") - before) * 1024, result

for dtype in ("fp32", "bf16"):  # warm-up: page in the code paths and the allocator's working set
    export_checkpoint(small, out + "/warm_" + dtype, dtype=dtype, max_shard_size="4KB", progress=False)
growth = {}
for dtype in ("fp32", "bf16"):
    growth[dtype], _ = peak_growth(lambda: export_checkpoint(big, out + "/hf_" + dtype, dtype=dtype,
                                                             max_shard_size="48MB", progress=False))
growth["whole_state_dict"], state = peak_growth(lambda: get_fp32_state_dict_from_zero_checkpoint(big))
print(json.dumps(growth))
"""


def _can_reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
    except OSError:
        return False
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _can_reset_peak_rss(),
                    reason="needs Linux /proc/self/clear_refs to reset the peak RSS (VmHWM)")
def test_export_peak_memory_is_one_tensor_not_the_model(tmp_path: Path) -> None:
    """Peak RSS growth during export stays near the largest tensor (4 MiB), far from the model (160 MiB).

    ru_maxrss cannot measure this: a spawned child inherits the parent's peak. VmHWM, reset through
    /proc/self/clear_refs after a warm-up export, can. Loading the whole state dict is the positive control.
    """
    numel = 1 << 20  # 4 MiB per fp32 tensor, 40 of them: 160 MiB in all
    write_checkpoint(tmp_path / "big", {f"module/layer{i}.weight": torch.full((numel,), float(i)) for i in range(40)})
    write_checkpoint(tmp_path / "small", {f"module/layer{i}.weight": torch.full((1000,), 1.0) for i in range(3)})
    largest = numel * 4
    # glibc raises its mmap threshold after a large free, after which freed 4 MiB blocks may stay in the heap
    # and count in the peak RSS or not, depending on timing (10-16 MiB measured under load). A fixed threshold
    # returns every freed tensor to the system at once, so the peak is the live tensors: 7.7-8.1 MiB in 12 runs
    # (the read tensor and its converted copy), against a bound of 3 tensors (12 MiB, plus the writer's fixed
    # buffers) and a model of 160 MiB.
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
    result = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path / "big"), str(tmp_path / "small"),
                             str(tmp_path)], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    growth = json.loads(result.stdout.strip().splitlines()[-1])
    for dtype in ("fp32", "bf16"):
        # plus the writer's fixed buffers (direct_io.BUFFER_BYTES, 6 MiB), the same for any model size
        bound = 3 * largest + BUFFER_BYTES
        assert growth[dtype] < bound, f"{dtype}: export grew RSS by {growth[dtype] / 2**20:.1f} MiB"
    assert growth["whole_state_dict"] > 25 * largest  # the measurement does see memory that is held
    index = json.loads((tmp_path / "hf_fp32" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 4  # 12 x 4 MiB fit under 48 MB
    with SafetensorsFile(tmp_path / "hf_bf16" / "model-00002-of-00002.safetensors") as handle:
        assert torch.equal(handle.get("layer39.weight"), torch.full((numel,), 39.0, dtype=torch.bfloat16))


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io to count bytes read")
def test_export_reads_each_checkpoint_byte_once(tmp_path: Path) -> None:
    """The sha256 check rides on the reads of the weights: an export reads the checkpoint's bytes once, where
    verifying first and then reading read them twice. /proc/self/io's rchar counts every byte read() returned."""
    tensors = {f"module/layer{i}.weight": torch.full((1 << 20,), float(i)) for i in range(8)}  # 32 MiB
    write_checkpoint(tmp_path / "ckpt", tensors)
    stored = sum(p.stat().st_size for p in (tmp_path / "ckpt").glob("*.safetensors"))

    def bytes_read() -> int:
        text = Path("/proc/self/io").read_text()
        return int(next(line for line in text.splitlines() if line.startswith("rchar:")).split()[1])

    before = bytes_read()
    export_checkpoint(tmp_path / "ckpt", tmp_path / "hf", progress=False)
    read = bytes_read() - before
    assert stored <= read < 1.1 * stored, f"read {read:,} bytes of a {stored:,}-byte checkpoint"
    assert torch.equal(_load_dir(tmp_path / "hf")["layer7.weight"], tensors["module/layer7.weight"])
