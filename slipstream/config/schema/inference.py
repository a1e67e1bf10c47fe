"""`DeepSpeedInferenceConfig`: the keys of `deepspeed.init_inference(model, config=..., **kwargs)`, with DeepSpeed
0.19's names, aliases and defaults (`deepspeed/inference/config.py`). Parsed by config/inference_plans.py into an
`InferencePlan`; the keys outside `IMPLEMENTED` are accepted and reported by name when set."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field, field_validator

from slipstream.config.schema.base import DSBool, DSInt, DSModel, aliased, plan_fields
from slipstream.config.schema.precision import canonical_dtype


def _dtype_name(value: object) -> Any:
    """A torch dtype or any DeepSpeed spelling ("half", "torch.bfloat16", "float") as "fp32" / "fp16" / "bf16" /
    "int8"; anything else is left to fail the check. (torch is not imported here: the schema stays light.)"""
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        value = str(value)
    if isinstance(value, str):
        name = value.lower().removeprefix("torch.")
        if name == "int8":
            return "int8"
        return canonical_dtype({"float": "fp32", "bfloat": "bf16"}.get(name, name))
    return value


InferenceDtype = Annotated[str, BeforeValidator(_dtype_name)]


class InferenceTPConfig(DSModel):
    """`tensor_parallel` (alias `tp`): split the model's attention and MLP over ranks (AutoTP rules)."""

    IMPLEMENTED = plan_fields("inference", "tp_size", enabled="inference.tp_size")
    enabled: DSBool = True
    """Split the model (False: tp_size is taken as 1)."""
    tp_size: DSInt = Field(1, ge=1)
    """Ranks a model is split over; the world size must be a multiple of it."""
    tp_grain_size: DSInt = 64
    """Granularity of uneven splits (DeepSpeed's kernel path); Slipstream splits by whole heads."""
    mpu: object = None
    """A model-parallel unit giving the TP group."""
    tp_group: object = None
    """The TP process group to use."""


class InferenceCheckpointConfig(DSModel):
    """`checkpoint_config` (alias `ckpt_config`)."""

    checkpoint_dir: str | None = None
    save_mp_checkpoint_path: str | None = None
    base_dir: str | None = None


class DeepSpeedInferenceConfig(DSModel):
    """The inference engine's configuration (see the module doc)."""

    IMPLEMENTED = plan_fields(
        "inference",
        "dtype",
        "checkpoint",
        "max_out_tokens",
        "enable_cuda_graph",
        replace_with_kernel_inject="inference.kernel_inject",
        tensor_parallel="inference.tp_size",
        mp_size="inference.tp_size",
    )
    replace_with_kernel_inject: DSBool = aliased(False, "replace_with_kernel_inject", "kernel_inject")
    """Inject DeepSpeed's fused kernels. Accepted: the model's own PyTorch attention (SDPA where it uses it) runs."""
    dtype: InferenceDtype = "fp16"
    """The parameters' dtype: fp32, fp16 or bf16 (torch dtypes and DeepSpeed's spellings accepted)."""
    tensor_parallel: InferenceTPConfig = aliased(InferenceTPConfig(), "tensor_parallel", "tp")
    """Tensor parallelism."""
    enable_cuda_graph: DSBool = False
    """Capture the forward in a CUDA graph (CUDA only)."""
    use_triton: DSBool = False
    triton_autotune: DSBool = False
    zero: dict[str, Any] = Field(default_factory=dict)
    """ZeRO-Inference settings."""
    triangular_masking: DSBool = aliased(True, "triangular_masking", "tm")
    moe: DSBool | dict[str, Any] = Field(default_factory=dict)
    keep_module_on_host: DSBool = False
    quant: dict[str, Any] = Field(default_factory=dict)
    """Weight / activation quantization (int8 weight-only among them)."""
    checkpoint: str | dict[str, Any] | None = None
    """Weights to load: a Slipstream checkpoint folder or a Hugging Face safetensors folder (a path)."""
    base_dir: str = ""
    set_empty_params: DSBool = False
    save_mp_checkpoint_path: str | None = None
    checkpoint_config: InferenceCheckpointConfig = aliased(
        InferenceCheckpointConfig(), "checkpoint_config", "ckpt_config"
    )
    return_tuple: DSBool = True
    training_mp_size: DSInt = 1
    replace_method: str = "auto"
    injection_policy: dict[Any, Any] | None = aliased(None, "injection_policy", "injection_dict")
    injection_policy_tuple: tuple[Any, ...] | None = None
    config: dict[str, Any] | None = aliased(None, "config", "args")
    max_out_tokens: DSInt = aliased(1024, "max_out_tokens", "max_tokens", gt=0)
    """The longest prompt `generate()` takes."""
    min_out_tokens: DSInt = aliased(1, "min_out_tokens", "min_tokens")
    transposed_mode: DSBool = False
    mp_size: DSInt = 1
    """Deprecated spelling of tensor_parallel.tp_size."""
    mpu: object = None
    ep_size: DSInt = 1
    ep_group: object = None
    ep_mp_group: object = None
    moe_experts: list[int] = Field(default_factory=lambda: [1])
    moe_type: str = "standard"


class HybridEngineConfig(DSModel):
    """`hybrid_engine` of the training config (RLHF): `engine.generate()` at ZeRO-3 gathers the model once per call
    and generates with the model's own generate (its KV cache), then releases it; training goes on unchanged."""

    IMPLEMENTED = {
        "enabled": "hybrid.generate",
        "pin_parameters": "hybrid.pin_parameters",
        "max_out_tokens": "hybrid.max_out_tokens",
        "inference_tp_size": "hybrid.inference_tp_size",
        "tp_gather_partition_size": "hybrid.tp_gather_partition_size",
        "release_inference_cache": "hybrid.release_inference_cache",
    }
    enabled: DSBool = False
    """Gather the whole model once per `engine.generate()` call (ZeRO-3)."""
    max_out_tokens: DSInt = Field(512, gt=0)
    """The most positions (prompt plus new tokens) one `generate` call may use; a longer call is refused."""
    inference_tp_size: DSInt = Field(1, gt=0)
    """Ranks per tensor-parallel generation group: groups of this many consecutive ranks generate their
    gathered prompts together, each rank holding its slice of every layer (inference/hybrid_tp.py)."""
    release_inference_cache: DSBool = False
    """With inference_tp_size > 1: free the inference copy of the weights after each generate (else kept)."""
    pin_parameters: DSBool = True
    """Gather every layer once for the whole generate call (False: layer by layer, as the hooks do)."""
    tp_gather_partition_size: DSInt = Field(8, gt=0)
    """ZeRO-3 units (layers) gathered together to refill the inference copy with inference_tp_size > 1."""
    enable_cuda_graph: DSBool = False
    """Capture generation in CUDA graphs: refused when true (see the validator)."""

    @field_validator("enable_cuda_graph")
    @classmethod
    def _no_cuda_graph(cls, value: bool) -> bool:
        if value:
            raise ValueError(
                "hybrid_engine.enable_cuda_graph=true: capturing the decode step in a CUDA graph is not built in "
                "Slipstream, and on a device without CUDA graphs (the CPU) it cannot work at all; set it to false "
                "(generation runs eagerly with the model's own KV cache)"
            )
        return value
