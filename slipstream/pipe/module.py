"""`PipelineModule`, `LayerSpec`, `TiedLayerSpec`: DeepSpeed's description of a model as a list of layers.

A PipelineModule is built on every rank from the same list; each rank builds only the layers of its own
stage(s) (a `LayerSpec` is a constructor call deferred until then), so no rank ever holds the whole model.
Parameter counts for the "parameters" partition come from building each layer once on the meta device.

Stages and chunks: with `stage_chunks` c > 1 (interleaved schedules) the layers are split into
`num_stages * c` *virtual stages*; virtual stage v lives on pipeline stage `owner(v)` ("loop": v % P, the
interleaved 1F1B layout; "v": v for v < P and 2P-1-v after, the ZBV layout). Local layers are registered as
children named by their global index (`"3"`), tied modules under `tied_modules.<key>`, so parameter names are
the same at every stage count: checkpoints are keyed by them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint as _torch_checkpoint

from slipstream.pipe.partition import partition
from slipstream.pipe.schedule import SCHEDULES
from slipstream.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid, ProcessTopology, group_of

__all__ = ["LayerSpec", "PipelineError", "PipelineModule", "TiedLayerSpec", "owner_of"]


class PipelineError(Exception):
    """A pipeline module or schedule that cannot be built as described."""


class LayerSpec:
    """`cls(*args, **kwargs)`, built only on the stage that owns the layer."""

    def __init__(self, typename: type, *module_args: object, **module_kwargs: object) -> None:
        if not isinstance(typename, type) or not issubclass(typename, nn.Module):
            raise RuntimeError(f"LayerSpec needs an nn.Module subclass; got {typename!r}")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose `tied_weight_attr` parameters are shared by every layer with the same `key` (embeddings and
    the output head): built once per stage that uses it, equal at start, gradients summed over those stages."""

    def __init__(
        self,
        key: str,
        typename: type,
        *module_args: object,
        forward_fn: Callable[..., object] | None = None,
        tied_weight_attr: str | Sequence[str] = "weight",
        **module_kwargs: object,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        self.key, self.forward_fn = key, forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


def owner_of(virtual: int, num_stages: int, style: str) -> int:
    """The pipeline stage that runs virtual stage `virtual`."""
    if style == "v":
        return virtual if virtual < num_stages else 2 * num_stages - 1 - virtual
    return virtual % num_stages


def _type_name(layer: object) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", type(layer).__name__)


def _get_attr(module: nn.Module, dotted: str) -> Any:
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


def _resolve_topology(num_stages: int | None, topology: ProcessTopology | None) -> ProcessTopology:
    """`topology`, else a pipe x data topology of `num_stages` stages (the process group started if need be)."""
    if num_stages is None and topology is None:
        raise RuntimeError("PipelineModule needs num_stages= or topology=")
    if not dist.is_initialized():
        from slipstream.comm.init import init_distributed

        init_distributed(verbose=False)
    world = dist.get_world_size()
    if topology is None:
        assert num_stages is not None
        if num_stages < 1 or world % num_stages:
            raise RuntimeError(f"num_stages={num_stages} must divide the world size {world}")
        topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)
    return topology


class PipelineModule(nn.Module):
    """DeepSpeed's `PipelineModule`. Slipstream adds `schedule` ("1f1b", DeepSpeed's; "interleaved_1f1b",
    "interleaved_zero_bubble", "zbv_zero_bubble") and `stage_chunks` (virtual stages per stage; 2 by default
    for the interleaved ones), which decide how the layers are laid out; `dynamic_shape` defaults to True."""

    def __init__(
        self,
        layers: Sequence[object],
        num_stages: int | None = None,
        topology: ProcessTopology | None = None,
        loss_fn: Callable[..., object] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], object] | None = None,
        base_seed: int = 1234,
        partition_method: str | Sequence[int] = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., object] | None = None,
        checkpointable_layers: Sequence[str] | None = None,
        dynamic_shape: bool = True,
        *,
        schedule: str = "1f1b",
        stage_chunks: int | None = None,
    ) -> None:
        super().__init__()
        topology = _resolve_topology(num_stages, topology)
        if schedule not in SCHEDULES:
            raise ValueError(f"PipelineModule(schedule={schedule!r}) is not known; use one of {sorted(SCHEDULES)}")
        _, default_chunks, chunk_style = SCHEDULES[schedule]
        self.schedule = schedule
        self._topo = topology
        self._grid = PipelineParallelGrid(topology)
        self.num_stages = self._grid.pipe_parallel_size
        self.stage_id = self._grid.stage_id
        self.global_rank = dist.get_rank()
        self.stage_chunks, self.chunk_style = int(stage_chunks or default_chunks), chunk_style
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.activation_checkpoint_interval = int(activation_checkpoint_interval)
        self.activation_checkpoint_func = activation_checkpoint_func or functools.partial(
            _torch_checkpoint, use_reentrant=False
        )
        self.checkpointable_layers = checkpointable_layers
        self.dynamic_shape = bool(dynamic_shape)
        """True (default): each transfer carries the activation's description (structure, shapes, dtypes); False:
        only when it differs from the previous one on that link (one message less per transfer)."""
        self._layer_specs = list(layers)
        self.partition_method = partition_method
        self._build_local_layers()

    # ---- build ----
    def _build_local_layers(self) -> None:
        """Partition the layers into virtual stages and build this stage's own, with the tied modules."""
        self.layer_params = self._count_layer_params()
        virtual = self.num_stages * self.stage_chunks
        self.parts = partition(
            self.partition_method,
            num_layers=len(self._layer_specs),
            num_parts=virtual,
            param_counts=self.layer_params,
            type_names=[_type_name(x) for x in self._layer_specs],
        )
        self.local_virtual = [
            v for v in range(virtual) if owner_of(v, self.num_stages, self.chunk_style) == self.stage_id
        ]
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.chunk_funcs: dict[int, list[tuple[int, Callable[..., Any]]]] = {}
        for v in self.local_virtual:
            self.chunk_funcs[v] = [(i, self._build_layer(i)) for i in range(self.parts[v], self.parts[v + 1])]
        self.tied_stages = self._tied_stages()
        self.tied_groups = self._make_tied_groups()

    def _count_layer_params(self) -> list[int]:
        counts = []
        for layer in self._layer_specs:
            if isinstance(layer, LayerSpec):
                with torch.device("meta"):
                    built = layer.build()
                counts.append(sum(p.numel() for p in built.parameters() if p.requires_grad))
            elif isinstance(layer, nn.Module):
                counts.append(sum(p.numel() for p in layer.parameters() if p.requires_grad))
            else:
                counts.append(0)
        return counts

    def _build_layer(self, index: int) -> Callable[..., Any]:
        layer = self._layer_specs[index]
        if self.seed_layers:
            (self.seed_fn or torch.manual_seed)(self.base_seed + index)
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied_modules:
                self.tied_modules[layer.key] = layer.build()
                self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
            module = self.tied_modules[layer.key]
            return module if layer.forward_fn is None else functools.partial(layer.forward_fn, module)
        if isinstance(layer, LayerSpec):
            module = layer.build()
        elif isinstance(layer, nn.Module):
            module = layer
        elif callable(layer):
            function: Callable[..., Any] = layer
            return function
        else:
            raise PipelineError(f"layer {index} is {type(layer).__name__}: use a LayerSpec, nn.Module or callable")
        self.add_module(str(index), module)
        return module

    def _tied_stages(self) -> dict[str, list[int]]:
        """key -> the pipeline stages that use it (computed from the specs: the same on every rank)."""
        found: dict[str, set[int]] = {}
        for v in range(self.num_stages * self.stage_chunks):
            for i in range(self.parts[v], self.parts[v + 1]):
                layer = self._layer_specs[i]
                if isinstance(layer, TiedLayerSpec):
                    found.setdefault(layer.key, set()).add(owner_of(v, self.num_stages, self.chunk_style))
        return {k: sorted(v) for k, v in sorted(found.items())}

    def _make_tied_groups(self) -> dict[str, Any]:
        """Per tied key used by two or more stages: the group of all ranks of those stages (gradients are summed
        over it, data-parallel replicas included), created in key order on every rank."""
        groups: dict[str, Any] = {}
        for key, stages in self.tied_stages.items():
            if len(stages) < 2 and self._grid.data_parallel_size == 1:
                continue
            ranks = sorted(r for s in stages for r in self._topo.filter_match(pipe=s))
            group = group_of(ranks)
            if self.stage_id in stages:
                groups[key] = (group, ranks)
        return groups

    def tied_parameters(self) -> list[tuple[str, nn.Parameter, Any, list[int]]]:
        """(key, parameter, group, ranks) of every tied weight this rank holds."""
        out = []
        for key, (group, ranks) in self.tied_groups.items():
            for attr in self.tied_weight_attrs.get(key, []):
                out.append((key, _get_attr(self.tied_modules[key], attr), group, ranks))
        return out

    def is_tied_owner(self, key: str) -> bool:
        """Whether this stage counts the tied weight in the gradient norm (the first stage that uses it)."""
        return self.tied_stages[key][0] == self.stage_id

    # ---- forward ----
    def run_chunk(self, virtual: int, x: object) -> Any:
        funcs = self.chunk_funcs[virtual]
        interval = self.activation_checkpoint_interval
        if interval <= 0 or not self.training:
            for _, func in funcs:
                x = func(x)
            return x
        for start in range(0, len(funcs), interval):
            block = funcs[start : start + interval]
            if self.checkpointable_layers is not None and not all(
                type(f).__name__ in self.checkpointable_layers for _, f in block
            ):
                for _, func in block:
                    x = func(x)
            else:
                x = self.activation_checkpoint_func(functools.partial(_run_block, block), x)
        return x

    def forward(self, forward_input: object) -> Any:
        """The layers of this stage, all chunks in order (DeepSpeed's forward of the local layers)."""
        x = forward_input
        for v in self.local_virtual:
            x = self.run_chunk(v, x)
        return x

    # ---- DeepSpeed's accessors ----
    def topology(self) -> ProcessTopology:
        return self._topo

    def mpu(self) -> PipelineParallelGrid:
        return self._grid

    def num_pipeline_stages(self) -> int:
        return self.num_stages

    def stage_owner(self, virtual: int) -> int:
        return owner_of(virtual, self.num_stages, self.chunk_style)

    @property
    def num_virtual_stages(self) -> int:
        return self.num_stages * self.stage_chunks

    def layer_names(self) -> list[str]:
        return [_type_name(layer) for layer in self._layer_specs]


def _run_block(block: list[tuple[int, Callable[..., object]]], x: object) -> Any:
    for _, func in block:
        x = func(x)
    return x
