"""Inference: `init_inference` and `InferenceEngine` (engine.py), checkpoint weights for it (weights.py).

DeepSpeed's `deepspeed.inference.config.DeepSpeedInferenceConfig` is the schema in config/schema/inference.py.
"""

from __future__ import annotations

from torch import nn

from slipstream.config.inference_plans import resolve_inference
from slipstream.config.schema.inference import DeepSpeedInferenceConfig
from slipstream.inference.engine import InferenceEngine

__all__ = ["DeepSpeedInferenceConfig", "InferenceEngine", "init_inference"]


def init_inference(model: nn.Module, config: object = None, **kwargs: object) -> InferenceEngine:
    """DeepSpeed's `deepspeed.init_inference(model, config=None, **kwargs)`: `model` prepared for inference as
    `config` (a dict, a JSON file's path or a DeepSpeedInferenceConfig) and the keyword arguments (which win)
    say: dtype, tensor_parallel.tp_size, checkpoint, max_out_tokens (docs/inference.md)."""
    return InferenceEngine(model, resolve_inference(config, **kwargs))
