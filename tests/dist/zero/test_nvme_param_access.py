"""DeepSpeed's `safe_get/set_full_fp32_param` and `safe_get_full_optimizer_state` with parameters and optimizer
state offloaded to NVMe at ZeRO-3 (their shards and masters live in files between steps): the values equal a
CPU-offload run of the same model and batches, and a value set through them is what the next forward uses.
Found on the GPU check: the accessors sliced a shard whose memory NVMe offload had released."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.harness import run_distributed
from tests.harness.models import TinyMLP


def _engine(offload: dict):  # type: ignore[no-untyped-def]
    import slipstream

    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 300,
                                    "offload_optimizer": dict(offload), "offload_param": dict(offload)}}
    return slipstream.initialize(model=TinyMLP(), config=config)[0]


def _read(engine) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    from slipstream.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {}
    for name, param in engine.module.named_parameters():
        out[name] = safe_get_full_fp32_param(param).clone()
        out[name + ".exp_avg"] = safe_get_full_optimizer_state(param, "exp_avg").clone()
    return out


def run(rank: int, world: int, *, nvme_dir: str) -> dict:
    from slipstream.utils import safe_get_full_fp32_param, safe_set_full_fp32_param

    results = {}
    for label, offload in (("cpu", {"device": "cpu"}), ("nvme", {"device": "nvme", "nvme_path": nvme_dir})):
        engine = _engine(offload)
        for seed in range(2):
            x, y = TinyMLP().make_batch(seed=seed, batch_size=4 * world)
            x, y = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
            engine.backward(TinyMLP.loss(engine(x), y))
            engine.step()
        values = _read(engine)
        last = engine.module.layers[-1]
        safe_set_full_fp32_param(last.bias, torch.full(last.bias.ds_shape, 0.25))
        probe = torch.zeros(3, 13)
        output = engine(probe).detach().clone()  # zeros in: the output reads the set bias
        values["after_set.bias"] = safe_get_full_fp32_param(last.bias).clone()
        results[label] = {"values": values, "output": output}
        engine.destroy()
    return results


def test_nvme_offloaded_state_reads_and_writes_like_cpu_offload(tmp_path: Path) -> None:
    per_rank = run_distributed(run, world_size=2, tmp_dir=tmp_path / "run", nvme_dir=str(tmp_path))
    for result in per_rank:
        cpu, nvme = result["cpu"], result["nvme"]
        assert cpu["values"].keys() == nvme["values"].keys()
        for name, value in cpu["values"].items():
            torch.testing.assert_close(nvme["values"][name], value, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(nvme["values"]["after_set.bias"], torch.full((5,), 0.25), rtol=0, atol=0)
        torch.testing.assert_close(nvme["output"], cpu["output"], rtol=0, atol=0)
    assert not torch.equal(per_rank[0]["cpu"]["values"]["layers.0.weight"], TinyMLP().layers[0].weight.detach())
