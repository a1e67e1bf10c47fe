"""The registry of every native op: `ALL_OPS` maps op name to its builder."""

from __future__ import annotations

from slipstream.ops.op_builder.async_io import AsyncIOBuilder
from slipstream.ops.op_builder.builder import OpBuilder
from slipstream.ops.op_builder.cpu_adam import CPUAdamBuilder
from slipstream.ops.op_builder.cpu_lamb import CPULambBuilder

_BUILDER_CLASSES: tuple[type[OpBuilder], ...] = (CPUAdamBuilder, CPULambBuilder, AsyncIOBuilder)

ALL_OPS: dict[str, OpBuilder] = {cls.NAME: cls() for cls in _BUILDER_CLASSES}


def get_builder(name: str) -> OpBuilder:
    """The builder of op `name`; unknown names are an error that lists the known ones."""
    try:
        return ALL_OPS[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r}; known ops: {', '.join(sorted(ALL_OPS))}") from None
