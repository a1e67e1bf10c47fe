"""The long-context planner (planner/sequence.py, `slipstream plan --sequence`): its activation bytes against
the bytes a training step of the benchmark's decoder creates (counted tensor by tensor), the longest-sequence
search, the model's dimensions and the command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch

from slipstream.activation import recompute
from slipstream.planner.sequence import (
    OPTIONS,
    SeqDims,
    activation_bytes,
    longest_sequence,
    seq_dims,
    sequence_rows,
)
from slipstream.planner.shapes import from_hf_config, synthetic
from slipstream.profiling.live_tensors import LiveTensorBytes
from slipstream.sequence.fpdt_attention import fpdt_attention
from slipstream.sequence.fpdt_store import HostChunks
from slipstream.sequence.tiled import TiledFusedLogitsLoss, TiledMLP

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from _long_context_model import Dims, Kit, Model, batch, step_peak

TINY = Dims(hidden=16, layers=3, heads=2, intermediate=48, vocab=128)
SEQS = (256, 512)


def _kit(option: str) -> Kit:
    tiled = "tiled" in option
    if option == "fpdt":  # one store: its host buffers are reused from the first step on, as in the bench
        store = HostChunks()
        return Kit(
            attention=lambda q, k, v: fpdt_attention(
                *(x.transpose(1, 2) for x in (q, k, v)), chunk_size=64, store=store
            ).transpose(1, 2)
        )
    return Kit(
        checkpoint=None if option == "plain" else recompute.checkpoint,
        tiled_mlp=TiledMLP if tiled else None,
        tiled_loss=TiledFusedLogitsLoss if tiled else None,
    )


@pytest.fixture
def restore_checkpointing():
    yield
    recompute.reset()


@pytest.mark.usefixtures("restore_checkpointing")
def test_predicted_bytes_track_the_counted_bytes_of_a_step() -> None:
    """Per option, at two sequence lengths: the predicted activation bytes and the bytes one training step of
    the decoder creates (counted live tensors; the parameters' gradients are at most the parameter bytes on
    top) agree, their growth between the lengths (the per-token figure) within 2.5%, and what each feature
    saves per token (offload, tiling) within 10%."""
    dims = SeqDims(hidden=16, layers=3, heads=2, vocab=128, intermediate=48, kv_hidden=16)
    growth: dict[str, tuple[int, int]] = {}
    for option in OPTIONS:
        recompute.configure(None, checkpoint_in_cpu="offload" in option)
        torch.manual_seed(0)
        model = Model(TINY, _kit(option))
        grads = sum(p.numel() * 4 for p in model.parameters())
        counted, predicted = [], []
        for seq in SEQS:
            tokens, targets = batch(TINY, seq)
            model(tokens, targets).backward()  # a first step: activation offload's host buffers exist after it
            counted.append(step_peak(model, tokens, targets, LiveTensorBytes()))
            predicted.append(activation_bytes(dims, option, seq=seq, dtype_bytes=4))
        for seq, got, want in zip(SEQS, counted, predicted):
            assert want * 0.95 <= got <= want * 1.05 + grads, (option, seq, got, want, grads)
        growth[option] = (counted[1] - counted[0], predicted[1] - predicted[0])
        assert abs(growth[option][0] - growth[option][1]) <= 0.025 * growth[option][0], (option, growth[option])
    for without, with_ in (
        ("plain", "fpdt"),
        ("checkpointing", "checkpointing+offload"),
        ("checkpointing+tiled", "checkpointing+tiled+offload"),
        ("checkpointing", "checkpointing+tiled"),
    ):
        saved = [growth[without][i] - growth[with_][i] for i in (0, 1)]
        assert saved[0] > 0 and abs(saved[0] - saved[1]) <= 0.1 * saved[0], (without, with_, saved)


def test_longest_sequence_is_the_last_length_that_fits() -> None:
    for limit in (1, 2, 3, 5, 1000, 4097):
        assert longest_sequence(lambda n, limit=limit: n <= limit) == limit
    assert longest_sequence(lambda n: n <= 1000, step=8) == 1000
    assert longest_sequence(lambda n: n <= 1001, step=8) == 1000
    assert longest_sequence(lambda n: n <= 7, step=8) == 0
    with pytest.raises(ValueError, match="step must be >= 1"):
        longest_sequence(lambda n: True, step=0)


def test_rows_answer_within_the_budget_and_ulysses_divides_the_tokens() -> None:
    dims = SeqDims(hidden=512, layers=8, heads=8, vocab=8192, intermediate=1376, kv_hidden=512)
    budget, fixed = 2 * 2**30, 100 * 2**20
    rows = sequence_rows(dims, seq=None, dtype_bytes=2, budget=budget, fixed_bytes=fixed)
    longest = {row.option: row.longest for row in rows}
    assert longest["plain"] < longest["checkpointing"] < longest["checkpointing+tiled"]
    assert longest["checkpointing+tiled"] < longest["checkpointing+tiled+offload"]
    for row in rows:
        assert row.longest is not None
        at = activation_bytes(dims, row.option, seq=row.longest, dtype_bytes=2)
        beyond = activation_bytes(dims, row.option, seq=row.longest + 1, dtype_bytes=2)
        assert fixed + at <= budget < fixed + beyond, row
    split = sequence_rows(dims, seq=4096, dtype_bytes=2, ulysses=4)
    whole = sequence_rows(dims, seq=1024, dtype_bytes=2)
    extra = {r.option: r.activations - w.activations for r, w in zip(split, whole) if r.activations and w.activations}
    per_token = 1024 * 2  # Ulysses' own bytes: one more h per layer (plain), the all-to-all buffers (9h/2)
    assert extra["fpdt"] == 0 and extra["plain"] == dims.layers * 512 * per_token
    assert extra["checkpointing+tiled"] == extra["checkpointing+tiled+offload"] == 9 * 256 * per_token
    assert activation_bytes(dims, "fpdt", seq=4097, dtype_bytes=2, ulysses=4) == activation_bytes(
        dims, "fpdt", seq=1025, dtype_bytes=2
    )
    with pytest.raises(ValueError, match="not one of"):
        activation_bytes(dims, "ring", seq=1, dtype_bytes=2)


def test_dims_come_from_the_model() -> None:
    llama = from_hf_config(
        {
            "hidden_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "intermediate_size": 688,
            "vocab_size": 1000,
        }
    )
    assert seq_dims(llama) == SeqDims(
        hidden=256, layers=2, heads=8, vocab=1000, intermediate=688, kv_hidden=64, gated=True
    )
    gpt = synthetic(params=None, hidden=128, layers=2, vocab=500, heads=4)
    assert seq_dims(gpt) == SeqDims(
        hidden=128, layers=2, heads=4, vocab=500, intermediate=512, kv_hidden=128, gated=False
    )
    assert seq_dims(gpt, intermediate=300).intermediate == 300


def test_command_line_prints_the_rows(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from slipstream.cli import plan

    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "hidden_size": 512,
                "num_hidden_layers": 8,
                "num_attention_heads": 8,
                "intermediate_size": 1376,
                "vocab_size": 8192,
                "num_key_value_heads": 8,
            }
        )
    )
    parser = argparse.ArgumentParser()
    plan.add_arguments(parser)
    argv = ["--sequence", "--hf-config", str(config), "--seq", "4096", "--memory", "2GiB", "--dtype", "fp32"]
    assert plan.run(parser.parse_args([*argv, "--ulysses", "2", "--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    dims = SeqDims(**out["dims"])
    assert dims.intermediate == 1376 and dims.kv_hidden == 512
    rows = sequence_rows(dims, seq=4096, dtype_bytes=4, budget=2 * 2**30, fixed_bytes=out["model_states"])
    rows += sequence_rows(dims, seq=4096, dtype_bytes=4, ulysses=2, budget=2 * 2**30, fixed_bytes=out["model_states"])
    assert [(r["option"], r["ulysses"], r["longest"]) for r in out["rows"]] == [
        (r.option, r.ulysses, r.longest) for r in rows
    ]
    assert out["model_states_option"] == "zero0"
    assert plan.run(parser.parse_args(argv)) == 0
    assert "checkpointing+tiled+offload" in capsys.readouterr().out
    assert plan.run(parser.parse_args([*argv, "--ulysses", "0"])) == 2
    assert "--ulysses must be >= 1" in capsys.readouterr().err
