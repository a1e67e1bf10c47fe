"""The engine's weight hand-off, mixed into the engine: `iter_full_weights()` (whole parameters a bucket at a
time, zero/full_weights.py) and `generate()` (the hybrid engine's: at ZeRO-3 with `hybrid_engine.enabled` the
whole model is gathered once per call, LoRA layers fused into it, generated from with the model's own KV cache,
unfused and released after) with `fuse_lora_weight()` / `unfuse_lora_weight()` (inference/lora.py)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator

import torch
from torch import nn

from slipstream.config.plan import EnginePlan
from slipstream.inference.hybrid_tp import TensorParallelGenerator, WholeWeights
from slipstream.inference.limits import check_max_out_tokens
from slipstream.inference.lora import fuse_lora, lora_layers, unfuse_lora
from slipstream.zero.full_weights import DEFAULT_BUCKET_BYTES, iter_full_weights
from slipstream.zero.gathered import GatheredParameters, unwrap_model_for_generation
from slipstream.zero.stage3.generation import ShardedWeights, plain_while_held
from slipstream.zero.stage3.model import ZeroModel
from slipstream.zero.stage3.sharded_param import internal_access


def _takes(call: Callable[..., object], name: str) -> bool:
    """`call` has a parameter `name`. Hugging Face's `generate` takes `synced_gpus`, and when it is not given turns
    it on under its DeepSpeed ZeRO-3 integration (Trainer, TRL) with more than one rank: then every token ends with
    an all-reduce, so that ranks whose sequences finished keep running forwards whose hooks gather. With the whole
    model held for the call nothing is gathered during it, so the hybrid generate passes False."""
    try:
        return name in inspect.signature(call).parameters
    except (TypeError, ValueError):
        return False


class WeightHandOff:
    """Attributes it reads are the engine's."""

    module: nn.Module
    zero_model: ZeroModel | None
    plan: EnginePlan

    def iter_full_weights(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, whole value) of every parameter, as `module.named_parameters()` names them; at ZeRO-3 gathered
        `bucket_bytes` of units at a time (collective: every rank iterates to the end). The values stay valid
        while kept; at stages 0-2 they are the live parameters, changed by the next step."""
        return iter_full_weights(self.module, self.zero_model, bucket_bytes=bucket_bytes)

    def generate(self, *inputs: object, **kwargs: object) -> object:
        """The model's `generate`. With `hybrid_engine.enabled` a call whose prompt plus new tokens exceeds
        `max_out_tokens` is refused (inference/limits.py), and the LoRA layers are fused for the call and unfused
        after; at ZeRO-3 the units are also gathered once for the whole call (not per layer and token by the
        module hooks), run as a plain model, and released when it returns, unless `pin_parameters` is false
        (then the hooks gather layer by layer and LoRA stays unfused). Without the hybrid engine the model's
        `generate` runs as it is."""
        generate = getattr(self.module, "generate", None)
        if not callable(generate):
            raise AttributeError(
                f"engine.generate(): {type(self.module).__name__} has no generate(); call the engine for its forward"
            )
        if not self.plan.hybrid.generate:
            return generate(*inputs, **kwargs)
        check_max_out_tokens(
            inputs, kwargs, getattr(self.module, "generation_config", None), self.plan.hybrid.max_out_tokens
        )
        if self.zero_model is not None and not self.plan.hybrid.pin_parameters:
            return generate(*inputs, **kwargs)
        layers = lora_layers(self.module)
        if self.zero_model is not None and "synced_gpus" not in kwargs and _takes(generate, "synced_gpus"):
            kwargs["synced_gpus"] = False  # nothing left to gather: no rank waits for another (see _takes)
        if self.plan.hybrid.inference_tp_size > 1:  # groups of ranks generate on a split copy (hybrid_tp.py)
            return self._tensor_parallel_generator().generate(inputs, kwargs)
        with self._held_for_generate():  # at ZeRO-3 the fuse works on the gathered copies, released after
            with internal_access():
                fuse_lora(layers)
            try:
                return generate(*inputs, **kwargs)
            finally:
                with internal_access():
                    unfuse_lora(layers)

    def _tensor_parallel_generator(self) -> TensorParallelGenerator:
        """The engine's inference copy for `hybrid_engine.inference_tp_size` > 1, made at the first call."""
        generator = self.__dict__.get("_hybrid_tp_generator")
        if generator is None:
            weights = WholeWeights() if self.zero_model is None else ShardedWeights(self.zero_model)
            generator = TensorParallelGenerator(self.module, plan=self.plan.hybrid, weights=weights)
            self.__dict__["_hybrid_tp_generator"] = generator
        return generator

    @contextlib.contextmanager
    def _held_for_generate(self) -> Iterator[None]:
        """At ZeRO-3 every unit gathered once and held, with the hooks paused and the parameters plain for the
        call (zero/stage3/generation.py); below stage 3 nothing to do."""
        if self.zero_model is None:
            yield
            return
        with unwrap_model_for_generation(self.module), plain_while_held(self.zero_model):
            yield

    def fuse_lora_weight(self) -> None:
        """DeepSpeed's hybrid engine `fuse_lora_weight()`: every LoRA layer's `scaling * B @ A` added into its base
        weight, its LoRA path off (inference/lora.py). At ZeRO-3 on the gathered weights, written back to the
        shards (collective: every rank calls it)."""
        self._lora_in_place(fuse_lora)

    def unfuse_lora_weight(self) -> None:
        """DeepSpeed's hybrid engine `unfuse_lora_weight()`: the LoRA deltas subtracted again (fp32 rounding)."""
        self._lora_in_place(unfuse_lora)

    def _lora_in_place(self, change: Callable[[list[nn.Module]], None]) -> None:
        layers = lora_layers(self.module)
        params = [p for layer in layers for p in layer.parameters()]
        held = GatheredParameters(params, modifier_rank=0) if self.zero_model else contextlib.nullcontext()
        with held, internal_access():
            change(layers)
