"""Pipeline parallelism with DeepSpeed's `deepspeed.pipe` API (docs/pipeline.md)."""

from __future__ import annotations

from slipstream.pipe.module import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec
from slipstream.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid, ProcessTopology

__all__ = [
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipelineEngine",
    "PipelineError",
    "PipelineModule",
    "PipelineParallelGrid",
    "ProcessTopology",
    "TiedLayerSpec",
]


def __getattr__(name: str) -> object:
    if name == "PipelineEngine":
        from slipstream.pipe import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'slipstream.pipe' has no attribute {name!r}")
