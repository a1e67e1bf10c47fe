"""`InferenceEngine`: a model prepared for inference by `init_inference` (DeepSpeed's `deepspeed.inference.engine`).

Built in this order from an `InferencePlan` (config/inference_plans.py):
1. the checkpoint's weights, if one is named, copied in one tensor at a time (weights.py);
2. the parameters cast to the plan's dtype and moved to the accelerator's device (int8: every linear layer's
   weight quantized to int8 per output row, the rest in fp16; quantize.py);
3. with `tensor_parallel.tp_size > 1`, the attention and MLP layers split over the TP group by the training
   AutoTP rules (slipstream/parallel/tensor.py, on DTensor): every rank must pass the same model.
No kernels are injected: `replace_with_kernel_inject` is accepted and the model's own PyTorch attention runs
(scaled_dot_product_attention where the model uses it). `engine(...)` is the model's forward, `engine.generate`
the model's generate (Hugging Face's, with its KV cache), refusing prompts longer than `max_out_tokens` as
DeepSpeed does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from slipstream.accelerator import get_accelerator
from slipstream.config import notices
from slipstream.config.inference_plans import InferencePlan
from slipstream.inference.quantize import COMPUTE_DTYPE, quantize_linears
from slipstream.inference.weights import load_checkpoint_into
from slipstream.parallel import TensorParallelModel, apply_tensor_parallel, build_topology, plan_tensor_parallel
from slipstream.utils.logging import log_rank0
from slipstream.utils.torch_versions import require_torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _refuse_unbuilt(plan: InferencePlan, device: torch.device) -> None:
    if plan.dtype == "int8" and plan.tp_size > 1:
        raise ValueError(
            f"init_inference(dtype=int8, tensor_parallel.tp_size={plan.tp_size}): int8 weights are not split over "
            "ranks yet; use tp_size 1 with int8, or fp16 / bf16 with tensor parallelism"
        )
    if plan.cuda_graph:
        raise ValueError(
            "init_inference(enable_cuda_graph=True): capturing the forward in a CUDA graph is not built in "
            f"Slipstream, and on a device without CUDA graphs (this run's is {device}; the CPU has none) it cannot "
            "work at all; leave it False (the model runs eagerly, with its own KV cache in generate)"
        )


class InferenceEngine(nn.Module):
    """DeepSpeed's `InferenceEngine` (see the module doc). Build it with `slipstream.init_inference`."""

    def __init__(self, model: nn.Module, plan: InferencePlan) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"init_inference(model=...): expected a torch.nn.Module, got {type(model).__name__}")
        self.plan = plan
        self.device = get_accelerator().device(get_accelerator().current_device())
        _refuse_unbuilt(plan, self.device)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        notices.report_unimplemented(plan.unimplemented, rank=self.rank)
        if plan.checkpoint is not None:
            load_checkpoint_into(model, plan.checkpoint)
        if plan.dtype == "int8":  # quantized from the weights as given, before the rest is cast to fp16
            model = quantize_linears(model)
        model.to(device=self.device, dtype=DTYPES.get(plan.dtype, COMPUTE_DTYPE))
        model.eval()
        self.mp_world_size = plan.tp_size
        self.tp_model: TensorParallelModel | None = self._split(model) if plan.tp_size > 1 else None
        self.module = model
        if plan.kernel_inject:
            log_rank0("inference: no kernels are injected; the model's own PyTorch attention runs", rank=self.rank)

    def _split(self, model: nn.Module) -> TensorParallelModel:
        """The model split over its TP group (the world is a multiple of tp_size; groups of neighbours)."""
        require_torch("2.5", f"init_inference(tensor_parallel.tp_size={self.plan.tp_size}) (DTensor's public API)")
        if not dist.is_initialized():
            raise RuntimeError(
                f"init_inference(tensor_parallel.tp_size={self.plan.tp_size}) needs the process group: launch "
                "with `deepspeed` / `slipstream run` (or call deepspeed.init_distributed() first)"
            )
        topology = build_topology(tp=self.plan.tp_size, sp=1, device_type=self.device.type)
        decisions = plan_tensor_parallel(model, self.plan.tp_size)
        return apply_tensor_parallel(model, topology.tp_mesh, decisions)

    def forward(self, *inputs: object, **kwargs: object) -> object:
        return self.module(*inputs, **kwargs)

    def generate(self, *inputs: object, **kwargs: object) -> object:
        """The model's `generate`; a prompt longer than `max_out_tokens` is refused (DeepSpeed's check)."""
        prompt = inputs[0] if inputs else kwargs.get("input_ids")
        if isinstance(prompt, torch.Tensor) and prompt.shape[-1] > self.plan.max_out_tokens:
            raise RuntimeError(
                f"generate: the prompt has {prompt.shape[-1]} tokens, more than max_out_tokens "
                f"({self.plan.max_out_tokens}); raise max_out_tokens (max_tokens) in the inference config"
            )
        generate = getattr(self.module, "generate", None)
        if generate is None:
            raise AttributeError(f"{type(self.module).__name__} has no generate(); call the engine for its forward")
        return generate(*inputs, **kwargs)
