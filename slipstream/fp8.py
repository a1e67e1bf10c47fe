"""`slipstream.fp8`: FP8 training of linear layers (Slipstream's own API; see slipstream/precision/fp8.py)."""

from slipstream.precision.fp8 import RECIPES, Float8Linear, convert_to_float8_training, fp8_hardware

__all__ = ["RECIPES", "Float8Linear", "convert_to_float8_training", "fp8_hardware"]
