"""Pydantic models of DeepSpeed's JSON config, one module per section family: top (top level), zero,
precision, optim (optimizer/scheduler), monitors, misc (sections accepted but not implemented yet)."""

from __future__ import annotations

from slipstream.config.schema.top import DeepSpeedConfig

__all__ = ["DeepSpeedConfig"]
