"""The engine's side of tensor and sequence parallelism: the mesh, the TP split before ZeRO, the norm over TP,
the loaders, and global tensors for checkpoints.

Order at `initialize`: every rank takes rank 0's parameters (so the TP shards are cut from one model), the
model is split over the TP group (slipstream/parallel/tensor.py), then ZeRO places and shards the local
shards over the data group (data x sequence ranks). Gradients are averaged once, at the step, by the size of
the data group (docs/design.md D7): TP ranks hold different shards of one gradient, never copies to average.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from slipstream.checkpoint.tp_slices import TpLayout
from slipstream.comm import collectives
from slipstream.config.plan import EnginePlan
from slipstream.parallel import (
    TensorParallelModel,
    Topology,
    apply_tensor_parallel,
    build_topology,
    plan_tensor_parallel,
)
from slipstream.utils.logging import log_rank0

__all__ = ["ParallelSetup", "setup_parallel"]


class ParallelSetup:
    """The topology of the job and, with TP, what the split did (None without model parallelism)."""

    def __init__(self, topology: Topology | None, tp_model: TensorParallelModel | None) -> None:
        self.topology, self.tp_model = topology, tp_model

    @property
    def data_group(self) -> dist.ProcessGroup | None:
        return None if self.topology is None else self.topology.data_group

    @property
    def tp_size(self) -> int:
        return 1 if self.topology is None else self.topology.tp

    @property
    def sp_size(self) -> int:
        return 1 if self.topology is None else self.topology.sp

    @property
    def tp_rank(self) -> int:
        return 0 if self.topology is None else self.topology.rank % self.topology.tp

    def checkpoint_layouts(self, model: nn.Module) -> dict[str, TpLayout] | None:
        """Per TP parameter, where this rank's shard sits in the global tensor (checkpoint/tp_slices.py)."""
        if self.tp_model is None:
            return None
        layouts = {}
        for name, _local, spec in self.tp_model.param_specs(model):
            start, _width = spec.extent(self.tp_rank, self.tp_size)
            layouts[name] = TpLayout(tuple(spec.shape), spec.shard_dim, start)
        for name, param in model.named_parameters():
            layouts.setdefault(name, TpLayout(tuple(param.shape), None, 0))
        return layouts

    def adopt_client_params(self, optimizer: torch.optim.Optimizer, model_parameters: Any) -> Any:
        """Point what the client built over the unsplit model at the local shards that replaced its split
        parameters: the groups of its optimizer instance (in place) and `model_parameters` (returned as a list).
        An optimizer built before `initialize` otherwise steps the unsplit tensors, and the split layers never
        train. Refuses optimizer state kept for an unsplit parameter (it has the unsplit shape)."""
        if self.tp_model is None or not self.tp_model.replaced:
            return model_parameters
        local = {id(old): new for old, new in self.tp_model.replaced}
        if isinstance(optimizer, torch.optim.Optimizer):
            held = [p for group in optimizer.param_groups for p in group["params"] if id(p) in local]
            if any(p in optimizer.state for p in held):
                raise RuntimeError(
                    f"initialize(optimizer=...): the optimizer has state (it stepped) for {len(held)} parameter(s) "
                    "that tensor parallelism splits, in their unsplit shapes; build the optimizer without stepping "
                    "it before initialize, or load its state through engine.load_checkpoint after initialize"
                )
            for group in optimizer.param_groups:
                group["params"] = [local.get(id(p), p) for p in group["params"]]
        self.tp_model.replaced.clear()  # the unsplit tensors are freed once the client drops them
        if model_parameters is None:
            return None
        return [
            {**g, "params": [local.get(id(p), p) for p in g["params"]]} if isinstance(g, dict) else local.get(id(g), g)
            for g in model_parameters
        ]

    def loader_rank_and_size(self) -> tuple[int, int]:
        """(which batch, how many distinct batches): the ranks of a TP or SP group read the same batch."""
        if self.topology is None:
            return dist.get_rank(), dist.get_world_size()
        return self.topology.data_index, self.topology.dp

    def wrap_loader(self, loader: Any) -> Any:
        if loader is None or self.sp_size == 1:
            return loader
        from slipstream.sequence.data import SequenceShardLoader

        return SequenceShardLoader(loader, self.topology.sp_group if self.topology else None)

    def norm_info(self, model: nn.Module) -> tuple[dist.ProcessGroup, set[int]] | None:
        if self.tp_model is None or self.topology is None or self.topology.tp_group is None:
            return None
        return self.topology.tp_group, self.tp_model.replicated_param_ids(model)

    def full_state(self, model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`state` (a module state dict of local TP shards) with every sharded tensor made global."""
        if self.tp_model is None:
            return state
        out = dict(state)
        for name, _param, spec in self.tp_model.param_specs(model):
            if spec.sharded and name in out:
                out[name] = self.tp_model.full_tensor(name, out[name], spec)
        return out


def setup_parallel(model: nn.Module, plan: EnginePlan, device: torch.device, rank: int) -> ParallelSetup:
    """Build the mesh and split `model` over TP as `plan.parallel` says (no-op without TP and SP)."""
    tp, sp = plan.parallel.tp_size, plan.parallel.sp_size
    if tp == 1 and sp == 1:
        return ParallelSetup(None, None)
    topology = build_topology(tp=tp, sp=sp, device_type=device.type)
    tp_model = None
    if tp > 1:
        decisions = plan_tensor_parallel(model, tp, rules=plan.parallel.tp_rules)
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                collectives.broadcast(tensor.data, src=0)
        model.to(device)
        tp_model = apply_tensor_parallel(model, topology.tp_mesh, decisions)
        log_rank0(
            f"tensor parallel: size {tp}; " + ", ".join(f"{name}: {kind}" for name, kind in decisions.items()),
            rank=rank,
        )
        uneven = Counter("/".join(map(str, s.sizes)) for _, _, s in tp_model.param_specs(model) if s.sizes)
        if uneven:
            log_rank0(
                "tensor parallel: heads the TP size does not divide are split by whole KV groups; widths per rank: "
                + ", ".join(f"{widths} ({count} weights)" for widths, count in uneven.items()),
                rank=rank,
            )
    log_rank0(f"parallel layout: data {topology.dp} x sequence {sp} x tensor {tp}", rank=rank)
    return ParallelSetup(topology, tp_model)
