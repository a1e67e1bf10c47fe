"""init_inference's config: DeepSpeed's keys, aliases and defaults into an InferencePlan; what is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from slipstream.config.errors import ConfigError
from slipstream.config.inference_plans import resolve_inference


def test_defaults_aliases_and_kwargs_over_config(tmp_path) -> None:  # type: ignore[no-untyped-def]
    plan = resolve_inference()
    assert (plan.dtype, plan.tp_size, plan.max_out_tokens, plan.checkpoint) == ("fp16", 1, 1024, None)
    path = tmp_path / "inference.json"
    path.write_text(json.dumps({"dtype": "bf16", "tp": {"tp_size": 4}, "max_tokens": 99}))
    plan = resolve_inference(str(path), dtype=torch.float32, kernel_inject=True)
    assert (plan.dtype, plan.tp_size, plan.max_out_tokens, plan.kernel_inject) == ("fp32", 4, 99, True)
    assert resolve_inference({"dtype": "half", "mp_size": 2}).tp_size == 2  # the deprecated spelling
    assert resolve_inference({"dtype": "half"}).dtype == "fp16"
    assert resolve_inference({"tensor_parallel": {"tp_size": 2, "enabled": False}}).tp_size == 1


def test_keys_not_acted_on_are_reported_and_bad_ones_refused() -> None:
    plan = resolve_inference({"use_triton": True, "tensor_parallel": {"tp_grain_size": 32}, "dtype": "fp32"})
    assert plan.unimplemented == ("tensor_parallel.tp_grain_size", "use_triton")
    with pytest.raises(ConfigError, match="dtyp"):
        resolve_inference({"dtyp": "fp16"})
    with pytest.raises(ConfigError, match="max_out_tokens|max_tokens"):
        resolve_inference({"max_out_tokens": 0})
    with pytest.raises(ConfigError, match="checkpoint description dicts"):
        resolve_inference({"checkpoint": {"type": "Megatron", "checkpoints": []}})


def test_engine_refuses_cuda_graphs_off_cuda() -> None:
    import slipstream

    with pytest.raises(ValueError, match=r"enable_cuda_graph=True.*not built.*this run's is cpu"):
        slipstream.init_inference(torch.nn.Linear(2, 2), enable_cuda_graph=True)
    engine = slipstream.init_inference(torch.nn.Linear(2, 2), dtype="fp32")
    assert engine(torch.ones(1, 2)).shape == (1, 2) and not engine.module.training


def test_tensor_parallel_on_old_torch_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    import slipstream
    from slipstream.utils.torch_versions import TorchTooOld

    monkeypatch.setattr(torch, "__version__", "2.4.1")
    with pytest.raises(TorchTooOld, match=r"tensor_parallel.tp_size=2.*PyTorch >= 2.5"):
        slipstream.init_inference(torch.nn.Linear(2, 2), dtype="fp32", tensor_parallel={"tp_size": 2})
