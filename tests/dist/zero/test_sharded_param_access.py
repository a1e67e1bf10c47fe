"""What client code gets from a ZeRO-3 parameter outside a gather (slipstream/zero/stage3/sharded_param.py).

The operations Transformers, Accelerate, TRL and PEFT perform on sharded parameters outside any gather:
`detach()` (every `state_dict()` value, state-dict hooks see them), `.data`, `clone()`, conversions (`to`,
`cpu`, `float`) give DeepSpeed's stand-in, a 0-element tensor of the result's dtype and device, and
`p.data = stand_in` changes nothing; `numel()`, `shape` stay global; `requires_grad_` freezes and unfreezes;
tying a parameter to another module outside a gather keeps one parameter; `copy_` and `load_state_dict`
inside `GatheredParameters(modifier_rank=0)` reach every rank. Values are still refused (`sum()`), and after all
of it the tied model trains from the values written as one process does. TRL's generation context (`optimizer.parameter_offload`, its
hooks taken off and put back inside a gather of everything) runs forwards without collectives and training goes
on after it. 2 ranks, one spawn.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests.harness import run_distributed


class _Tied(nn.Module):
    """An embedding, a block, and a head that the test ties to the embedding (as `tie_weights` does)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(12, 8)
        self.block = nn.ModuleList([nn.Linear(8, 8)])
        self.head = nn.Linear(8, 12, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.block[0](self.embed(ids))))


CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}


def _stand_ins(weight: Any) -> dict[str, Any]:
    """Each derived tensor's (numel, dtype, device type)."""
    derived = {
        "detach": weight.detach(),
        "data": weight.data,
        "clone": weight.clone(),
        "to_double": weight.to(torch.float64),
        "to_copy": weight.to("cpu", copy=True),
        "float": weight.float(),
        "half": weight.half(),
        "detach_clone": weight.detach().clone(),
    }
    return {k: (v.numel(), v.dtype, v.device.type) for k, v in derived.items()}


def _state_dict_hooks(model: nn.Module) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def post_hook(module: nn.Module, state: dict[str, torch.Tensor], prefix: str, local_metadata: Any) -> None:
        seen.update({k: (v.numel(), v.dtype) for k, v in state.items()})

    handle = model._register_state_dict_hook(post_hook)
    keys = list(model.state_dict().keys())
    handle.remove()
    return {"keys": keys, "seen": seen}


def _outside_a_gather(engine: Any, rank: int) -> dict[str, Any]:
    from slipstream.zero import GatheredParameters, ShardedParameterError, ZeroParamStatus

    model = engine.module
    weight = model.block[0].weight
    out: dict[str, Any] = {"status": weight.ds_status is ZeroParamStatus.NOT_AVAILABLE}
    out["meta"] = (tuple(weight.shape), weight.numel(), weight.ds_numel)
    out["stand_ins"] = _stand_ins(weight)
    before = weight.ds_tensor.clone()
    weight.data = weight.data.to(weight.device)  # DeepSpeed's idiom: a no-op
    out["data_set_kept"] = torch.equal(weight.ds_tensor, before) and weight.shape == (8, 8)
    out["state_dict"] = _state_dict_hooks(model)
    weight.requires_grad_(False)
    out["frozen"] = not weight.requires_grad
    weight.requires_grad_(True)
    try:
        weight.sum()
        out["sum_refused"] = False
    except ShardedParameterError:
        out["sum_refused"] = True
    with GatheredParameters([weight], modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                weight.copy_(torch.full((8, 8), 0.5))
    with GatheredParameters(list(model.block.parameters()), modifier_rank=0):
        if rank == 0:
            model.block.load_state_dict({"0.weight": torch.full((8, 8), 0.25), "0.bias": torch.ones(8)})
    with GatheredParameters(list(model.block.parameters())):
        out["copied"] = bool((weight == 0.25).all()) and bool((model.block[0].bias == 1).all())
    return out


def _train(engine: Any, steps: int = 2) -> list[float]:
    losses = []
    for step in range(steps):
        ids = torch.randint(0, 12, (2, 5), generator=torch.Generator().manual_seed(step))
        loss = engine(ids).logsumexp(-1).mean()
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    return losses


def _generation_context(engine: Any) -> dict[str, Any]:
    """TRL's `unwrap_model_for_generation` at ZeRO-3: gather everything, take DeepSpeed's hooks off through
    `optimizer.parameter_offload`, run forwards, put the hooks back; the forwards inside issue no collective."""
    from slipstream.comm import count_collectives
    from slipstream.zero import GatheredParameters

    offload = engine.optimizer.parameter_offload
    ids = torch.randint(0, 12, (2, 5), generator=torch.Generator().manual_seed(5))
    with GatheredParameters(list(engine.module.parameters())):
        for _, param in offload.module.named_parameters(recurse=True):
            param.ds_active_sub_modules.clear()
        assert list(offload.module.ds_external_parameters()) == []
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        with torch.no_grad(), count_collectives() as counter:
            logits = [engine.module(ids) for _ in range(3)]
        if not offload.param_coordinator.is_invalid_trace():
            offload.param_coordinator._invalidate_trace()
        offload._register_deepspeed_module(offload.module)
    return {"collectives": sum(counter.calls.values()), "same": all(torch.equal(x, logits[0]) for x in logits)}


def access(rank: int, world: int) -> dict[str, Any]:
    import slipstream
    from slipstream.zero import GatheredParameters

    torch.manual_seed(0)
    with slipstream.zero.Init(config_dict_or_path=CONFIG):
        model = _Tied()
    model.head.weight = model.embed.weight  # tie_weights outside a gather, on sharded parameters
    out: dict[str, Any] = {"tied_init": model.head.weight is model.embed.weight}
    engine, *_ = slipstream.initialize(model=model, config=CONFIG)
    out.update(_outside_a_gather(engine, rank))
    with GatheredParameters(list(model.parameters())):
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["start"] = start
    out["losses"] = _train(engine)
    out["generation"] = _generation_context(engine)
    out["losses"] += _train(engine, steps=1)
    out["tied_after"] = model.head.weight is model.embed.weight
    return out


def _reference(start: dict[str, torch.Tensor], seeds: list[int]) -> list[float]:
    """The same tied model and steps in one process (gradient_clipping defaults to 1.0, as in DeepSpeed)."""
    model = _Tied()
    model.head.weight = model.embed.weight
    model.load_state_dict(start, strict=False)  # named_parameters() lists the tied weight once
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for seed in seeds:
        ids = torch.randint(0, 12, (2, 5), generator=torch.Generator().manual_seed(seed))
        loss = model(ids).logsumexp(-1).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return losses


def test_sharded_parameter_outside_a_gather(tmp_path: Any) -> None:
    results = run_distributed(access, world_size=2, tmp_dir=tmp_path)
    empty = {
        "detach": (0, torch.float32, "cpu"),
        "data": (0, torch.float32, "cpu"),
        "clone": (0, torch.float32, "cpu"),
        "to_double": (0, torch.float64, "cpu"),
        "to_copy": (0, torch.float32, "cpu"),
        "float": (0, torch.float32, "cpu"),
        "half": (0, torch.float16, "cpu"),
        "detach_clone": (0, torch.float32, "cpu"),
    }
    for out in results:
        assert out["status"] and out["meta"] == ((8, 8), 64, 64)
        assert out["stand_ins"] == empty
        assert out["data_set_kept"]
        keys = ["embed.weight", "block.0.weight", "block.0.bias", "head.weight"]
        assert out["state_dict"]["keys"] == keys
        assert out["state_dict"]["seen"] == {k: (0, torch.float32) for k in keys}
        assert out["frozen"] and out["sum_refused"] and out["copied"]
        assert out["tied_init"] and out["tied_after"]
    reference = _reference(results[0]["start"], seeds=[0, 1, 0])  # both ranks train on the same batches
    for out in results:  # the values written under modifier_rank=0 are what training starts from
        assert out["start"]["block.0.weight"].eq(0.25).all() and out["start"]["block.0.bias"].eq(1).all()
        assert torch.allclose(torch.tensor(out["losses"]), torch.tensor(reference), atol=1e-5), (out, reference)
        assert out["generation"] == {"collectives": 0, "same": True}
