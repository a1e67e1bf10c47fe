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
`num_heads`/`num_attention_heads` with the projection's width) is split by whole heads; a head count (grouped
KV heads included) that the TP size does not divide is refused with `TensorParallelError` naming both numbers.
(Splitting such counts unevenly by whole heads would need shards of unequal width, which DTensor's `Shard`
cannot express.)

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
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from slipstream.utils.logging import warn_once

__all__ = [
    "ShardSpec",
    "TensorParallelError",
    "TensorParallelModel",
    "apply_tensor_parallel",
    "plan_tensor_parallel",
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
    listed. Reports each unrecognised `nn.Linear` once and raises TensorParallelError for heads cut in half."""
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
        parent = modules.get(name.rsplit(".", 1)[0]) if "." in name else model
        _check_heads(name, module, kind, _head_size(parent, model), tp_size)
        decisions[name] = kind
    if unrecognised:
        warn_once(
            f"tp-unrecognised:{','.join(unrecognised)}",
            "slipstream: tensor parallelism left these layers replicated (no rule matched): "
            + ", ".join(unrecognised)
            + "; name a rule for them in tensor_parallel.partition_config",
        )
    return decisions


def _shares_weight(module: nn.Module, modules: Mapping[str, nn.Module]) -> bool:
    """True when `module`'s weight is also another layer's (tied embedding and LM head)."""
    weight = getattr(module, "weight", None)
    return any(m is not module and getattr(m, "weight", None) is weight for m in modules.values())


def _check_heads(name: str, module: nn.Module, kind: str, head_size: int | None, tp: int) -> None:
    if not isinstance(module, nn.Linear) or name.rsplit(".", 1)[-1] not in _HEAD_NAMES or head_size is None:
        return
    width = module.out_features if kind == COLUMN else module.in_features
    if width % head_size:
        return
    heads = width // head_size
    if heads % tp:
        raise TensorParallelError(
            f"tensor parallelism: layer '{name}' has {heads} attention heads (head size {head_size}), which the "
            f"TP size {tp} does not divide; heads are never cut, and uneven whole-head splits are not "
            f"supported: use a TP size that divides {heads} (or name another rule in partition_config)"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class ShardSpec:
    """How a local parameter maps onto its global tensor."""

    placements: tuple[Any, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    @property
    def sharded(self) -> bool:
        return any(p.is_shard() for p in self.placements)

    @property
    def shard_dim(self) -> int | None:
        return next((p.dim for p in self.placements if p.is_shard()), None)


@dataclasses.dataclass
class TensorParallelModel:
    """What `apply_tensor_parallel` did: the TP mesh, and per module the specs of its local parameters."""

    mesh: Any
    decisions: dict[str, str]
    specs: dict[str, dict[str, ShardSpec]]
    """module name -> parameter name -> spec."""

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

        value = DTensor.from_local(local.detach(), self.mesh, spec.placements, shape=spec.shape, stride=spec.stride)
        return value.full_tensor()

    def local_piece(self, full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
        """This rank's shard of a global tensor (no communication)."""
        dim = spec.shard_dim
        if dim is None:
            return full
        size, rank = self.mesh.size(), self.mesh.get_local_rank()
        chunks = full.chunk(size, dim=dim)
        return chunks[rank] if rank < len(chunks) else full.narrow(dim, 0, 0)


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


def apply_tensor_parallel(model: nn.Module, mesh: Any, decisions: Mapping[str, str]) -> TensorParallelModel:
    """Shard `model` in place over the 1-D TP `mesh` as `decisions` says (see the module doc)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh, {name: _styles(kind) for name, kind in decisions.items()})
    specs: dict[str, dict[str, ShardSpec]] = {}
    for module_name, module in model.named_modules():
        found: dict[str, ShardSpec] = {}
        for param_name, param in list(module._parameters.items()):
            if not isinstance(param, DTensor):
                continue
            found[param_name] = ShardSpec(tuple(param.placements), param.shape, tuple(param.stride()))
            module._parameters[param_name] = nn.Parameter(param.to_local(), requires_grad=param.requires_grad)
        if found:
            specs[module_name] = found
            original = module.forward  # bound, or an instance attribute someone else installed
            module.forward = functools.partial(_forward_with_dtensors, module, original, mesh, found)  # type: ignore[method-assign]
    return TensorParallelModel(mesh=mesh, decisions=dict(decisions), specs=specs)


def _forward_with_dtensors(
    module: nn.Module, forward: Any, mesh: Any, specs: Mapping[str, ShardSpec], *args: Any, **kwargs: Any
) -> Any:
    """The module's forward with its local parameters seen as DTensors (see [Note: local shards as parameters])."""
    from torch.distributed.tensor import DTensor

    params = module._parameters
    local: dict[str, Any] = {name: params[name] for name in specs}
    try:
        for name, spec in specs.items():
            params[name] = DTensor.from_local(  # type: ignore[assignment]
                local[name], mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
            )
        return forward(*args, **kwargs)
    finally:
        params.update(local)
