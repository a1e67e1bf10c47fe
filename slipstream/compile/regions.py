"""Which modules `engine.compile()` compiles, and the compiled `forward` each of them gets.

[Note: compiled regions]
- A region is one of the model's repeated blocks: the children of the first `nn.ModuleList`/`nn.ModuleDict`
  met on each path down from the root (the same walk that makes ZeRO-3's units, so at stage 3 every block is
  a unit). Each block is compiled on its own, so compile time grows with the number of distinct blocks, not
  with depth: blocks of one class share their code and, where dynamo inlines nn modules (torch >= 2.5), one
  graph. torch 2.4 traces each block object once instead (`fit_cache_to_regions` makes room for all).
- A model without such a container has one region: the whole model at stages 0-2; at stage 3 the modules
  of its units (the root's own forward calls them, and their hooks must stay eager).
- The compiled function is the module's `forward`, never `module.__call__`: module hooks (ZeRO-3's
  gather-before and release-after, the backward markers on the inputs) run eagerly around the compiled
  forward, and gradient hooks on parameters run in autograd. A region may not hold another hooked module
  (a ZeRO-3 unit inside a block, as an MoE expert group is): that would trace the hooks; compile() refuses.
- ZeRO-3's parameters are `ShardedParameter`s whose `__torch_function__` guards against reading freed values.
  Inside a region the unit is gathered, so the region's parameters take their plain type for the duration of
  the compiled call (dynamo then sees ordinary parameters and does not trace the guard) and get it back after.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from slipstream.compile.graph_breaks import GraphBreakLedger
from slipstream.zero.stage3.sharded_param import ShardedParameter, unshard_type

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def repeated_blocks(root: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    """(qualified name, module) of the children of the first ModuleList/ModuleDict on each path from `root`."""
    for name, child in root.named_children():
        path = f"{prefix}.{name}" if prefix else name
        if isinstance(child, _CONTAINERS):
            for index, block in child.named_children():
                yield f"{path}.{index}", block
        else:
            yield from repeated_blocks(child, path)


def choose_regions(root: nn.Module, hooked: dict[nn.Module, str]) -> list[tuple[str, nn.Module]]:
    """The modules to compile (see [Note: compiled regions]); `hooked` maps the modules that carry ZeRO-3
    hooks to their names (empty at stages 0-2). Raises when a region would hold a hooked module."""
    regions = list(repeated_blocks(root))
    if not regions:
        regions = [(name, m) for m, name in hooked.items() if m is not root] if hooked else [("<model>", root)]
    for name, module in regions:
        inner = [hooked[m] for m in module.modules() if m is not module and m in hooked]
        if inner:
            raise NotImplementedError(
                f"engine.compile(): the block '{name}' holds ZeRO-3 units of its own ({', '.join(inner)}), whose "
                "gather and release hooks cannot run inside a compiled region; compile at ZeRO stage 0-2, or "
                "let the block be one unit (no _z3_group_key / leaf marks inside it)"
            )
    return regions


@dataclasses.dataclass
class CompiledRegion:
    """One compiled module: its eager `forward` (kept to restore it) and the compiled one installed over it."""

    name: str
    module: nn.Module
    eager_forward: Callable[..., Any]

    def restore(self) -> None:
        """Give the module its eager forward back."""
        self.module.__dict__.pop("forward", None)


def _plain_while(params: list[ShardedParameter], call: Callable[[], Any]) -> Any:
    """Run `call` with ZeRO-3's gathered `params` in their plain type (see [Note: compiled regions])."""
    types = [type(p) for p in params]
    for param in params:
        unshard_type(param)
    try:
        return call()
    finally:
        for param, cls in zip(params, types):
            param.__class__ = cls


def compile_region(
    name: str, module: nn.Module, *, compiler: Callable[[Callable[..., Any]], Any], ledger: GraphBreakLedger
) -> CompiledRegion:
    """Install `compiler(module.forward)` as the module's forward; its graph breaks go to `ledger` under `name`."""
    eager = module.forward
    compiled = compiler(eager)
    sharded = [p for p in module.parameters() if isinstance(p, ShardedParameter)]

    @functools.wraps(eager)
    def forward(*args: Any, **kwargs: Any) -> Any:
        def call() -> Any:
            return compiled(*args, **kwargs)

        with ledger.watch(name), _named_checkpoint_failure(name):
            return _plain_while(sharded, call) if sharded else call()

    module.forward = forward  # type: ignore[method-assign]
    return CompiledRegion(name=name, module=module, eager_forward=eager)


# torch 2.4's AOT autograd, compiling a block called inside a non-reentrant checkpoint (torch's or Slipstream's),
# meets the checkpoint's dynamo-disabled frames and stops with this (torch 2.13 compiles it).
_CHECKPOINT_FAILURE = "symbolically trace a dynamo-optimized function"


@contextlib.contextmanager
def _named_checkpoint_failure(name: str) -> Iterator[None]:
    try:
        yield
    except RuntimeError as error:
        if _CHECKPOINT_FAILURE not in str(error):
            raise
        raise RuntimeError(
            f"engine.compile(): the compiled block {name} was called inside an activation checkpoint, which "
            f"torch {torch.__version__} cannot compile ({_CHECKPOINT_FAILURE}). Checkpoint inside the block "
            "instead (its forward calling slipstream.checkpointing.checkpoint or torch.utils.checkpoint on its "
            "parts), or use a newer torch (2.13 compiles a checkpointed block)"
        ) from error


def fit_cache_to_regions(count: int) -> int | None:
    """Where dynamo does not inline nn modules (torch 2.4; see [Note: compiled regions]) it keeps one graph per
    block object, all under one code object whose cache holds `cache_size_limit` entries: blocks past it would
    run eagerly. Raise the limit to `count` plus dynamo's default headroom there; returns the new limit, or None
    where blocks share their graph and nothing changes."""
    config = torch._dynamo.config
    with warnings.catch_warnings():  # torch >= 2.9 warns that the flag is always on now
        warnings.simplefilter("ignore", FutureWarning)
        inlined = getattr(config, "inline_inbuilt_nn_modules", True)
    if inlined:
        return None
    limit = max(int(config.cache_size_limit), count + 8)
    config.cache_size_limit = limit
    if hasattr(config, "accumulated_cache_size_limit"):
        config.accumulated_cache_size_limit = max(int(config.accumulated_cache_size_limit), limit)
    return limit


def torch_compiler(backend: str, options: dict[str, Any]) -> Callable[[Callable[..., Any]], Any]:
    """`torch.compile` with this backend and the caller's other keyword arguments (mode, fullgraph, dynamic,
    options)."""
    return functools.partial(torch.compile, backend=backend, **options)
