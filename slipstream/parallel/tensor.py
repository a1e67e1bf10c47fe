"""Automatic tensor parallelism for training (DeepSpeed's AutoTP), on DTensor.

Which layer is split how is decided by name, per `nn.Linear` / `nn.Embedding` (`plan_tensor_parallel`):
- column-wise (output features split; input replicated): q/k/v projections, up/gate projections, fc1;
- row-wise (input features split; the outputs are summed over the group, one all-reduce): o/out/down
  projections, fc2;
- the token embedding by vocabulary (rows; one all-reduce of its output), an untied LM head column-wise with
  its output gathered (the logits are whole on every rank);
- norms, position embeddings and biases of row-wise layers replicated; any other `nn.Linear` is reported once,
  by name, and left replicated; `tensor_parallel.partition_config` (DeepSpeed's `layer_specs`: regex
  `patterns` on parameter names with `partition_type` "column" / "row" / "skip") names the rule per pattern
  ahead of the defaults (`use_default_specs: false` drops the defaults).
Head-aware: a q/k/v/o projection of an attention module that says its head size (`head_dim`, or
`num_heads`/`num_attention_heads` with the projection's width) is split by whole heads. A head count the TP
size does not divide is split unevenly by whole KV groups (each KV head with its query heads): 4 heads on 3
ranks are 2 + 1 + 1, 8 query / 4 KV heads are 4/2 + 2/1 + 2/1 (`whole_head_widths`; see [Note: uneven
whole-head splits]). Fewer KV heads than TP ranks is refused with `TensorParallelError` naming both numbers.

`apply_tensor_parallel` shards with `torch.distributed.tensor.parallel.parallelize_module`
(`ColwiseParallel`, `RowwiseParallel`), then keeps each DTensor's local shard as a plain `nn.Parameter`
under the same name and rebuilds the DTensor (`DTensor.from_local`, differentiable, a view) inside the
module's forward. See [Note: local shards as parameters].

[Note: local shards as parameters] ZeRO (flat buckets at stages 0-2, units at stage 3), optimizers and
checkpoints see ordinary tensors: the TP shard is what ZeRO shards further over the data-parallel ranks, so
TP x ZeRO 1, 2 and 3 need no DTensor support in ZeRO. The DTensor is rebuilt in the module's own forward
(an instance attribute wrapping the class's), which runs after every forward pre-hook, so at stage 3 it
views the gathered parameter (whose storage is regathered in place for the backward). Gradients flow from
the DTensor to the local parameter through `from_local`'s backward, which reduces a replicated parameter's
partial gradient over the group first.

[Note: uneven whole-head splits] DTensor's `Shard` placement, when it redistributes, assumes `torch.chunk`'s
layout (ceil-sized pieces), which cuts heads when the TP size does not divide the head count. A DTensor itself
may hold pieces of any width (`from_local` with the global `shape`), and the ops of a column- or row-parallel
linear never redistribute along the split dim: the matmul is computed on the local pieces, and only the
replicated input's gradient (column) or the partial output (row) is reduced, over full-size tensors. So the
projections of such an attention module are sliced here by whole heads (not by `parallelize_module`), carry
their per-rank widths in their `ShardSpec.sizes`, and their forward does what ColwiseParallel /
RowwiseParallel's hooks do, with the global shape given, around a 2-D matmul (DTensor's views compute local
shapes by `torch.chunk` too): the input, flattened to rows, made a Replicate (column) or a Shard(1) DTensor of
the whole width (row), the output returned local (row: reduced first) in the input's leading shape. Global tensors of such
pieces (checkpoints, `full_tensor`) are gathered by the widths, not by DTensor's redistribution.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from slipstream.utils.logging import warn_once
from slipstream.utils.torch_versions import require_torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "ShardSpec",
    "TensorParallelError",
    "TensorParallelModel",
    "apply_tensor_parallel",
    "plan_tensor_parallel",
    "whole_head_widths",
]

COLUMN, ROW, VOCAB, GATHERED, SKIP = "column", "row", "vocab", "gathered", "skip"
_COLUMN_NAMES = frozenset(
    "q_proj k_proj v_proj query key value wq wk wv up_proj gate_proj w1 w3 fc1 c_fc fc_in dense_h_to_4h".split()
)
_ROW_NAMES = frozenset("o_proj out_proj wo down_proj w2 fc2 c_proj fc_out dense_4h_to_h".split())
_HEAD_NAMES = frozenset("q_proj k_proj v_proj query key value wq wk wv o_proj out_proj wo".split())
_VOCAB_NAMES = frozenset("embed_tokens wte word_embeddings tok_embeddings tok_emb embed_in".split())
_HEAD_OUT_NAMES = frozenset("lm_head embed_out output head".split())


class TensorParallelError(ValueError):
    """A model that cannot be split as asked (a head count the TP size does not divide, a bad rule)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
    pattern: re.Pattern[str]
    kind: str


def _default_kind(name: str, module: nn.Module, tied: bool) -> str | None:
    """The built-in rule for module `name`, or None when it does not recognise it."""
    last = name.rsplit(".", 1)[-1]
    if isinstance(module, nn.Embedding):
        return VOCAB if last in _VOCAB_NAMES and not tied else SKIP
    if last in _COLUMN_NAMES:
        return COLUMN
    if last in _ROW_NAMES:
        return ROW
    if last in _HEAD_OUT_NAMES:
        return SKIP if tied else GATHERED
    return None


def _head_size(parent: nn.Module | None, root: nn.Module) -> int | None:
    """Head size declared by an attention module (or the model's config), None when it says nothing."""
    for owner in (parent, getattr(root, "config", None)):
        if owner is None:
            continue
        size = getattr(owner, "head_dim", None)
        if isinstance(size, int) and size > 0:
            return size
        heads = getattr(owner, "num_heads", None) or getattr(owner, "num_attention_heads", None)
        hidden = getattr(owner, "hidden_size", None) or getattr(owner, "embed_dim", None)
        if isinstance(heads, int) and isinstance(hidden, int) and heads > 0 and hidden % heads == 0:
            return hidden // heads
    return None


def plan_tensor_parallel(
    model: nn.Module,
    tp_size: int,
    *,
    rules: Sequence[tuple[str, str]] = (),
    use_default_specs: bool = True,
) -> dict[str, str]:
    """Module name -> how it is split ("column", "row", "vocab", "gathered"); layers left replicated are not
    listed. Reports each unrecognised `nn.Linear` once and raises TensorParallelError for attention modules
    that cannot be split by whole heads (fewer KV heads than TP ranks)."""
    compiled = [Rule(re.compile(p), k) for p, k in rules]
    modules = dict(model.named_modules())
    decisions: dict[str, str] = {}
    unrecognised: list[str] = []
    for name, module in modules.items():
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            continue
        weight_name = f"{name}.weight"
        kind = next((r.kind for r in compiled if r.pattern.search(weight_name) or r.pattern.search(name)), None)
        if kind is None and use_default_specs:
            kind = _default_kind(name, module, _shares_weight(module, modules))
        if kind is None and isinstance(module, nn.Linear):
            unrecognised.append(name)
        if kind in (None, SKIP):
            continue
        decisions[name] = kind
    if unrecognised:
        warn_once(
            f"tp-unrecognised:{','.join(unrecognised)}",
            "slipstream: tensor parallelism left these layers replicated (no rule matched): "
            + ", ".join(unrecognised)
            + "; name a rule for them in tensor_parallel.partition_config",
        )
    whole_head_widths(model, decisions, tp_size)  # refuses what cannot be split by whole heads
    return decisions


def _shares_weight(module: nn.Module, modules: Mapping[str, nn.Module]) -> bool:
    """True when `module`'s weight is also another layer's (tied embedding and LM head)."""
    weight = getattr(module, "weight", None)
    return any(m is not module and getattr(m, "weight", None) is weight for m in modules.values())


_KV_NAMES = frozenset("k_proj v_proj key value wk wv".split())


def whole_head_widths(model: nn.Module, decisions: Mapping[str, str], tp: int) -> dict[str, tuple[int, ...]]:
    """Per attention projection whose heads the TP size does not divide: its width on each rank, by whole KV
    groups (each KV head with its query heads), the first `groups % tp` ranks taking one group more. Evenly
    divided heads are not listed (`torch.chunk`'s pieces are then whole heads). Raises TensorParallelError when
    an attention module has fewer KV heads than TP ranks."""
    modules = dict(model.named_modules())
    by_parent: dict[str, dict[str, str]] = {}
    for name, kind in decisions.items():
        last = name.rsplit(".", 1)[-1]
        if last in _HEAD_NAMES and isinstance(modules[name], nn.Linear):
            by_parent.setdefault(name.rsplit(".", 1)[0] if "." in name else "", {})[name] = kind
    widths: dict[str, tuple[int, ...]] = {}
    for parent_name, projections in by_parent.items():
        head_size = _head_size(modules[parent_name], model)
        if head_size is None:
            continue
        heads = {}  # projection -> its head count (column: output features; row: input features)
        for name, kind in projections.items():
            layer = modules[name]
            width = layer.out_features if kind == COLUMN else layer.in_features  # type: ignore[union-attr]
            if kind in (COLUMN, ROW) and width % head_size == 0:
                heads[name] = width // head_size
        kv = [n for n in heads if n.rsplit(".", 1)[-1] in _KV_NAMES]
        groups = min((heads[n] for n in kv), default=0) or max(heads.values(), default=0)
        if groups == 0 or all(h % tp == 0 for h in heads.values()):
            continue
        named = kv[0] if kv else next(iter(heads))
        if groups < tp:
            raise TensorParallelError(
                f"tensor parallelism: layer '{named}' has {groups} {'KV' if kv else 'attention'} heads (head size "
                f"{head_size}), fewer than the TP size {tp}: heads are never cut and each rank needs a whole one; "
                f"use a TP size of at most {groups} (or name another rule in partition_config)"
            )
        for name, count in heads.items():
            if count % groups:
                raise TensorParallelError(
                    f"tensor parallelism: layer '{name}' has {count} attention heads, not a multiple of the "
                    f"{groups} KV heads of '{named}', so they cannot be split by whole KV groups over the TP size "
                    f"{tp}; use a TP size that divides both (or name another rule in partition_config)"
                )
        per_rank = [groups // tp + (r < groups % tp) for r in range(tp)]
        for name, count in heads.items():
            widths[name] = tuple(g * (count // groups) * head_size for g in per_rank)
    return widths


@dataclasses.dataclass(frozen=True, slots=True)
class ShardSpec:
    """How a local parameter maps onto its global tensor."""

    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    sizes: tuple[int, ...] | None = None
    """Each rank's width along the shard dim when it is not `torch.chunk`'s (uneven whole-head splits)."""

    @property
    def sharded(self) -> bool:
        return any(p.is_shard() for p in self.placements)

    @property
    def shard_dim(self) -> int | None:
        return next((p.dim for p in self.placements if p.is_shard()), None)

    def extent(self, rank: int, ranks: int) -> tuple[int, int]:
        """(first index, width) of rank `rank`'s piece along the shard dim; (0, 0) when replicated."""
        dim = self.shard_dim
        if dim is None:
            return 0, 0
        if self.sizes is not None:
            return sum(self.sizes[:rank]), self.sizes[rank]
        whole = self.shape[dim]
        step = -(-whole // ranks)
        start = min(rank * step, whole)
        return start, min(step, whole - start)


@dataclasses.dataclass
class TensorParallelModel:
    """What `apply_tensor_parallel` did: the TP mesh, and per module the specs of its local parameters."""

    mesh: DeviceMesh
    decisions: dict[str, str]
    specs: dict[str, dict[str, ShardSpec]]
    """module name -> parameter name -> spec."""
    replaced: list[tuple[nn.Parameter, nn.Parameter]] = dataclasses.field(default_factory=list)
    """(unsplit parameter, the local parameter now in its place): for an optimizer built before the split
    (`slipstream.engine.parallel` points it at the local ones, then clears this list)."""

    def param_specs(self, model: nn.Module) -> Iterator[tuple[str, nn.Parameter, ShardSpec]]:
        modules = dict(model.named_modules())
        for module_name, params in self.specs.items():
            for param_name, spec in params.items():
                full = f"{module_name}.{param_name}" if module_name else param_name
                yield full, modules[module_name]._parameters[param_name], spec  # type: ignore[misc]

    def replicated_param_ids(self, model: nn.Module) -> set[int]:
        sharded = {id(p) for _, p, spec in self.param_specs(model) if spec.sharded}
        return {id(p) for p in model.parameters() if id(p) not in sharded}

    def full_tensor(self, name: str, local: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
        """The global tensor of a local shard (an all-gather over the TP group)."""
        from torch.distributed.tensor import DTensor

        if spec.sizes is not None and spec.shard_dim is not None:
            return _gather_widths(local.detach(), spec.shard_dim, spec.sizes, self.mesh)
        value = DTensor.from_local(local.detach(), self.mesh, spec.placements, shape=spec.shape, stride=spec.stride)
        return value.full_tensor()


def _gather_widths(local: torch.Tensor, dim: int, sizes: tuple[int, ...], mesh: DeviceMesh) -> torch.Tensor:
    """The global tensor of pieces of unequal widths along `dim`: each padded to the widest, gathered, and cut
    back (see [Note: uneven whole-head splits]). Through slipstream.comm, which keeps the tensors it hands to
    gloo until the backend lets go of them ([Note: handing tensors to gloo] in comm/inflight.py)."""
    from slipstream.comm import collectives

    padded = local.new_zeros(local.shape[:dim] + (max(sizes),) + local.shape[dim + 1 :])
    padded.narrow(dim, 0, local.shape[dim]).copy_(local)
    gathered = padded.new_empty((len(sizes) * padded.numel(),))
    collectives.all_gather(gathered, padded.reshape(-1), group=mesh.get_group())
    pieces = gathered.view(len(sizes), *padded.shape).unbind(0)
    return torch.cat([piece.narrow(dim, 0, width) for piece, width in zip(pieces, sizes)], dim=dim)


def _styles(kind: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if kind == COLUMN:
        return ColwiseParallel()
    if kind == ROW:
        return RowwiseParallel()
    if kind == VOCAB:
        return RowwiseParallel(input_layouts=Replicate())
    return ColwiseParallel(output_layouts=Replicate())


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, decisions: Mapping[str, str]) -> TensorParallelModel:
    """Shard `model` in place over the 1-D TP `mesh` as `decisions` says (see the module doc)."""
    require_torch("2.5", "tensor parallelism (tensor_parallel.autotp_size > 1; DTensor's public API)")
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    uneven = whole_head_widths(model, decisions, mesh.size())
    plan = {name: _styles(kind) for name, kind in decisions.items() if name not in uneven}
    modules = dict(model.named_modules())
    unsplit = {(m, n): p for m in decisions for n, p in modules[m]._parameters.items() if p is not None}
    parallelize_module(model, mesh, plan)
    specs: dict[str, dict[str, ShardSpec]] = {}
    for module_name, module in modules.items():
        if module_name in uneven:
            found = _slice_by_widths(module, decisions[module_name], uneven[module_name], mesh)
            io = decisions[module_name]
        else:
            found, io = {}, None
            for param_name, param in list(module._parameters.items()):
                if not isinstance(param, DTensor):
                    continue
                found[param_name] = ShardSpec(tuple(param.placements), param.shape, tuple(param.stride()))
                module._parameters[param_name] = nn.Parameter(param.to_local(), requires_grad=param.requires_grad)
        if found:
            specs[module_name] = found
            original = module.forward  # bound, or an instance attribute someone else installed
            module.forward = functools.partial(_forward_with_dtensors, module, original, mesh, found, io)  # type: ignore[method-assign]
    now = {key: modules[key[0]]._parameters[key[1]] for key in unsplit}
    replaced = [(old, new) for key, old in unsplit.items() if (new := now[key]) is not None and new is not old]
    return TensorParallelModel(mesh=mesh, decisions=dict(decisions), specs=specs, replaced=replaced)


def _slice_by_widths(module: nn.Module, kind: str, widths: tuple[int, ...], mesh: DeviceMesh) -> dict[str, ShardSpec]:
    """Keep this rank's whole heads of a column- (weight rows, bias) or row-parallel (weight columns; the bias
    replicated) linear as its parameters; their specs carry the widths."""
    from torch.distributed.tensor import Replicate, Shard

    rank = mesh.get_local_rank()
    start, width = sum(widths[:rank]), widths[rank]
    found: dict[str, ShardSpec] = {}
    for param_name, param in list(module._parameters.items()):
        if param is None:
            continue
        dim = 0 if kind == COLUMN else 1 if param.dim() == 2 else None
        placements = (Replicate(),) if dim is None else (Shard(dim),)
        found[param_name] = ShardSpec(placements, param.shape, tuple(param.stride()), None if dim is None else widths)
        local = param.detach() if dim is None else param.detach().narrow(dim, start, width).clone()
        module._parameters[param_name] = nn.Parameter(local, requires_grad=param.requires_grad)
    return found


def _forward_with_dtensors(
    module: nn.Module,
    forward: Callable[..., Any],
    mesh: DeviceMesh,
    specs: Mapping[str, ShardSpec],
    io: str | None,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """The module's forward with its local parameters seen as DTensors (see [Note: local shards as parameters]).
    `io` ("column" / "row") for a layer sliced by whole heads: its input and output are converted here, as
    ColwiseParallel / RowwiseParallel's hooks do for the others (see [Note: uneven whole-head splits])."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    params = module._parameters
    local: dict[str, Any] = {name: params[name] for name in specs}
    try:
        for name, spec in specs.items():
            params[name] = DTensor.from_local(  # type: ignore[assignment]
                local[name], mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
            )
        if io is None:
            return forward(*args, **kwargs)
        # 2-D around the matmul: DTensor's view ops compute local shapes by torch.chunk's layout
        x, *rest = args
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        if io == COLUMN:
            y = forward(DTensor.from_local(flat, mesh, (Replicate(),), run_check=False), *rest, **kwargs)
            return y.to_local().view(*lead, -1)
        whole = (flat.shape[0], specs["weight"].shape[1])
        flat = DTensor.from_local(
            flat, mesh, (Shard(1),), run_check=False, shape=torch.Size(whole), stride=(whole[1], 1)
        )
        y = forward(flat, *rest, **kwargs).redistribute(mesh, (Replicate(),)).to_local()
        return y.view(*lead, -1)
    finally:
        params.update(local)
