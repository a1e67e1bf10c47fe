"""The version seam of utils/torch_versions.py: a feature that needs a newer torch says which."""

from __future__ import annotations

import pickle

import pytest
import torch

from slipstream.utils import torch_versions
from slipstream.utils.torch_versions import TorchTooOld, require_torch, safe_globals, torch_version


def test_versions_are_read_without_local_suffixes() -> None:
    assert torch_version("2.13.0+cpu") == (2, 13)
    assert torch_version("2.4.1+cu121") == (2, 4)
    assert torch_version() == torch_version(torch.__version__)
    with pytest.raises(ValueError, match="nightly"):
        torch_version("nightly")


def test_a_feature_that_needs_a_newer_torch_names_both_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    require_torch("2.4", "ZeRO")  # the installed torch is at least the oldest supported one
    monkeypatch.setattr(torch_versions.torch, "__version__", "2.4.1")
    with pytest.raises(TorchTooOld, match=r"zero-bubble schedules needs PyTorch >= 2\.6; .*torch 2\.4\.1"):
        require_torch("2.6", "zero-bubble schedules")


def test_tensor_parallelism_on_torch_2_4_names_the_version(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.4 has no public torch.distributed.tensor.DTensor: TP says which torch it needs, before any
    import fails inside the engine."""
    from slipstream.parallel.tensor import apply_tensor_parallel

    monkeypatch.setattr(torch_versions.torch, "__version__", "2.4.1")
    with pytest.raises(TorchTooOld, match=r"tensor parallelism .*needs PyTorch >= 2\.5; .*torch 2\.4\.1"):
        apply_tensor_parallel(torch.nn.Linear(2, 2), None, {})  # type: ignore[arg-type]


class _Allowed:
    pass


def test_safe_globals_allows_a_class_for_a_weights_only_load(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "obj.pt"
    torch.save({"x": _Allowed()}, path)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    with safe_globals([_Allowed]):
        assert isinstance(torch.load(path, weights_only=True)["x"], _Allowed)
