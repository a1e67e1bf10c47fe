"""The hybrid engine's tensor-parallel generate: `hybrid_engine.inference_tp_size` = t > 1.

The ranks form generation groups of t consecutive ranks. Each rank keeps an *inference copy* of the training
model: the same module tree (module_copy.py) with every attention and MLP layer cut by the AutoTP rules that
`init_inference` uses (slipstream/parallel/tensor.py), so it holds only its slice of each layer. The copy is
built at the first `generate` (its parameters allocated once) and refilled from the training weights at every
call. A call runs in phases:
1. refill: the training weights are read a chunk at a time (at ZeRO-3 `tp_gather_partition_size` units are
   gathered, copied from and released before the next chunk; at stages 0-2 the parameters are whole) and each
   rank copies its slice of every parameter into the copy. A LoRA layer is a plain linear in the copy
   (inference/lora.py `linear_stand_in`): its slice of the base weight gets the layer's delta `scaling * B @ A`
   (that slice of it only) as soon as the chunk holding its factors is read (lora.py `SliceFusion`);
2. prompts: the group's prompts are gathered into one left-padded batch (group_prompts.py);
3. generate: the copy's own `generate` (Hugging Face's, with its KV cache) runs the batch over the group, every
   row-parallel layer ending in an all-reduce per token;
4. each rank takes back its own rows; with `release_inference_cache` the copy's memory is freed (its storages
   shrink to 0 bytes and grow again at the next call), else it stays for the next call.
The training model is only read (LoRA is fused into the copy, never into the training weights): training goes on
bit-equal. Not built (refused by name): per-row tensors other than input_ids and attention_mask,
`return_dict_in_generate`, and PEFT LoRA layers the copy cannot fuse (variants such as DoRA, `lora_bias`,
`fan_in_fan_out`, layers that wrap something other than a linear).
With `do_sample` the group's ranks must share their random state (the same seed), or their tokens differ.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch import nn

from slipstream.accelerator import get_accelerator
from slipstream.config.plan import HybridPlan
from slipstream.inference.group_prompts import gather_prompts
from slipstream.inference.lora import FusedSlice, SliceFusion, base_parameters, linear_stand_in, lora_layers
from slipstream.inference.module_copy import structural_copy
from slipstream.parallel import TensorParallelModel, apply_tensor_parallel, plan_tensor_parallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["TensorParallelGenerator", "WeightSource", "WholeWeights"]


class WeightSource(Protocol):
    """Where the refill reads whole parameter values (zero/stage3/generation.py ShardedWeights at ZeRO-3)."""

    def shape(self, param: nn.Parameter) -> torch.Size: ...

    def chunks(self, params: list[nn.Parameter], units_per_chunk: int) -> Iterator[list[nn.Parameter]]: ...


class WholeWeights:
    """Stages 0-2: every parameter is whole already; one chunk."""

    def shape(self, param: nn.Parameter) -> torch.Size:
        return param.shape

    def chunks(self, params: list[nn.Parameter], units_per_chunk: int) -> Iterator[list[nn.Parameter]]:
        yield params


@dataclasses.dataclass(frozen=True, slots=True)
class SliceCopy:
    """One parameter of the inference copy and where its values come from."""

    source: nn.Parameter
    target: nn.Parameter
    dim: int | None
    """The dim this rank's slice is cut along; None: the whole parameter (replicated)."""
    start: int
    nbytes: int
    lora: nn.Module | None = None
    """The training model's LoRA layer whose base weight `source` is (its deltas go into `target`)."""
    name: str = ""
    """The module's qualified name."""


def _tp_mesh(tp: int, device_type: str) -> DeviceMesh:
    """The 1-D mesh of this rank's generation group: ranks [g * tp, (g + 1) * tp) (collective: every rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world % tp:
        raise ValueError(
            f"hybrid_engine.inference_tp_size={tp} does not divide the world size {world}; use a divisor of {world}"
        )
    return init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("hybrid_data", "hybrid_tp"))["hybrid_tp"]


class TensorParallelGenerator:
    """The inference copy of one engine's model and its generate (see the module doc)."""

    def __init__(self, module: nn.Module, *, plan: HybridPlan, weights: WeightSource) -> None:
        self.module, self.plan, self.weights = module, plan, weights
        self.device = get_accelerator().device(get_accelerator().current_device())
        self.copy: nn.Module | None = None
        self.slices: list[SliceCopy] = []
        self.mesh: DeviceMesh | None = None
        self.held = False
        """Whether the copy's storages are allocated (False after a release)."""

    def held_bytes(self) -> int:
        """Bytes the inference copy holds now (0 before the first call and after a release)."""
        return sum(s.target.untyped_storage().nbytes() for s in self.slices)

    def generate(self, inputs: tuple[object, ...], kwargs: dict[str, object]) -> torch.Tensor:
        """The group's generate; this rank's rows (collective over the group, and at ZeRO-3 over the model's)."""
        ids, mask = _prompt_of(inputs, kwargs)
        self._refill()
        try:
            assert self.copy is not None and self.mesh is not None
            pad = _pad_id(self.copy, kwargs)
            prompts = gather_prompts(ids, mask, pad_id=pad, group=self.mesh.get_group())
            kwargs = {**kwargs, "attention_mask": prompts.attention_mask}
            with torch.no_grad():
                out = self.copy.generate(prompts.input_ids, *inputs[1:], **kwargs)  # type: ignore[operator]
        finally:
            if self.plan.release_inference_cache:
                self.release()
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                f"engine.generate with hybrid_engine.inference_tp_size > 1 got {type(out).__name__} from the "
                "model's generate; only the token tensor is split back to the ranks (leave "
                "return_dict_in_generate off)"
            )
        return prompts.own_rows(out)

    def release(self) -> None:
        """Free the copy's memory; the storages stay attached and grow again at the next refill."""
        for piece in self.slices:
            piece.target.untyped_storage().resize_(0)
        self.held = False

    def _refill(self) -> None:
        """Phase 1: every slice copied in from the training weights, a chunk of units at a time."""
        if self.copy is None:
            self._build()
        elif not self.held:
            for piece in self.slices:
                piece.target.untyped_storage().resize_(piece.nbytes)
        self.held = True
        by_source = {id(s.source): s for s in self.slices}
        fusion = SliceFusion(
            [FusedSlice(s.lora, s.name, s.source, s.target, s.dim, s.start) for s in self.slices if s.lora is not None]
        )
        sources = [s.source for s in self.slices] + [p for p in fusion.parameters() if id(p) not in by_source]
        with torch.no_grad():
            for chunk in self.weights.chunks(sources, self.plan.tp_gather_partition_size):
                for source in chunk:
                    slot = by_source.get(id(source))
                    if slot is None:
                        continue  # a LoRA factor: read by the fusion
                    value = source.detach()
                    if slot.dim is not None:
                        value = value.narrow(slot.dim, slot.start, slot.target.shape[slot.dim])
                    slot.target.copy_(value)
                fusion.add_ready(chunk)  # See [Note: fusing into a slice] in lora.py
        fusion.finish()

    def _build(self) -> None:
        """The copy: the module tree on the meta device, cut by the AutoTP rules, then allocated once."""
        tp = self.plan.inference_tp_size
        lora = {id(layer) for layer in lora_layers(self.module)}
        names = {id(m): name for name, m in self.module.named_modules()}
        self.mesh = _tp_mesh(tp, self.device.type)

        def placeholder(param: nn.Parameter) -> nn.Parameter:
            meta = torch.empty(self.weights.shape(param), dtype=param.dtype, device="meta")
            return nn.Parameter(meta, requires_grad=False)

        def stand_in(module: nn.Module, make: Callable[[nn.Parameter], nn.Parameter]) -> nn.Module | None:
            return linear_stand_in(module, make, names[id(module)]) if id(module) in lora else None

        copy = structural_copy(self.module, placeholder, stand_in)
        split = apply_tensor_parallel(copy, self.mesh, plan_tensor_parallel(copy, tp))
        _allocate(copy, self.device)
        self.slices = _slices(self.module, copy, split, self.mesh.get_local_rank(), tp, lora)
        self.copy = copy.eval()


def _allocate(copy: nn.Module, device: torch.device) -> None:
    """Every meta parameter of `copy` replaced by an allocated one of its shape (tied ones stay tied)."""
    made: dict[int, nn.Parameter] = {}
    for module in copy.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            if id(param) not in made:
                made[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device=device), False)
            module._parameters[name] = made[id(param)]


def _slices(
    model: nn.Module, copy: nn.Module, split: TensorParallelModel, rank: int, tp: int, lora: set[int]
) -> list[SliceCopy]:
    """For every parameter of `copy`: the training parameter it is read from and this rank's slice of it (a LoRA
    layer's stand-in reads the layer's base weight and bias; its weight's slice gets the layer's deltas)."""
    originals = dict(model.named_modules(remove_duplicate=False))
    seen: set[int] = set()
    slices = []
    for module_name, module in copy.named_modules(remove_duplicate=False):
        original = originals[module_name]
        layer = original if id(original) in lora else None
        sources = original._parameters if layer is None else base_parameters(layer, module_name)
        for name, target in module._parameters.items():
            source = sources.get(name)
            if source is None or target is None or id(target) in seen:
                continue
            seen.add(id(target))
            spec = split.specs.get(module_name, {}).get(name)
            dim = spec.shard_dim if spec is not None else None
            start = spec.extent(rank, tp)[0] if spec is not None else 0
            nbytes = target.untyped_storage().nbytes()
            fused = layer if name == "weight" else None
            slices.append(SliceCopy(source, target, dim, start, nbytes, lora=fused, name=module_name))
    return slices


def _prompt_of(inputs: tuple[object, ...], kwargs: dict[str, object]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input_ids, attention_mask) of a generate call, taken out of `kwargs`; refuses what is not split."""
    ids = inputs[0] if inputs else kwargs.pop("input_ids", kwargs.pop("inputs", None))
    mask = kwargs.pop("attention_mask", None)
    others = sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
    if not isinstance(ids, torch.Tensor) or others or kwargs.get("return_dict_in_generate"):
        raise ValueError(
            "engine.generate with hybrid_engine.inference_tp_size > 1 gathers the group's input_ids and "
            f"attention_mask only; got input_ids of type {type(ids).__name__}, other tensors {others}, "
            f"return_dict_in_generate={kwargs.get('return_dict_in_generate')}; pass input_ids (and "
            "attention_mask) as tensors and leave return_dict_in_generate off, or set inference_tp_size to 1"
        )
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise ValueError(f"engine.generate: attention_mask must be a tensor, got {type(mask).__name__}")
    return ids, mask


def _pad_id(copy: nn.Module, kwargs: dict[str, object]) -> int:
    """The id that left-pads the group's prompts: the call's pad_token_id, else the generation config's pad or
    eos id (Hugging Face's fallback), else 0. Masked out, so its value never changes an answer."""
    config = getattr(copy, "generation_config", None)
    given = kwargs.get("pad_token_id")
    for value in (given, getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if isinstance(value, int):
            return value
    return 0
