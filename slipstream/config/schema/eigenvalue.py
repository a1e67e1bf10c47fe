"""`eigenvalue`: the top eigenvalue of each block's Hessian by power iteration (Hessian-vector products by double
backward), computed at every `gas_boundary_resolution`-th optimizer step and written to the monitors
(slipstream/profiling/eigenvalue.py). Defaults are DeepSpeed's."""

from __future__ import annotations

from pydantic import Field, model_validator

from slipstream.config.schema.base import DSBool, DSFloat, DSInt, OpenSection, plan_fields

__all__ = ["EigenvalueConfig"]


class EigenvalueConfig(OpenSection):
    """`eigenvalue`."""

    IMPLEMENTED = plan_fields(
        "eigenvalue",
        "verbose",
        "max_iter",
        "tol",
        "stability",
        "layer_name",
        "layer_num",
        enabled="eigenvalue",
        gas_boundary_resolution="eigenvalue.every_steps",
    )

    enabled: DSBool = False
    """Compute the block eigenvalues during training."""
    verbose: DSBool = False
    """Log each block's iteration count and eigenvalue (rank 0)."""
    max_iter: DSInt = Field(100, ge=1)
    """Power iterations per block at most."""
    tol: DSFloat = Field(1e-2, gt=0)
    """Stop when the eigenvalue's relative change is below this."""
    stability: DSFloat = Field(1e-6, ge=0)
    """Added to the vector's norm before dividing by it."""
    gas_boundary_resolution: DSInt = Field(1, ge=1)
    """Compute at every this-many-th optimizer step (accumulation boundary)."""
    layer_name: str = "bert.encoder.layer"
    """Dotted attribute path of the model's block list (an nn.ModuleList or nn.Sequential)."""
    layer_num: DSInt = Field(0, ge=0)
    """How many blocks of that list, from the first (must be > 0 when enabled)."""

    @model_validator(mode="after")
    def _blocks_named(self) -> EigenvalueConfig:
        """DeepSpeed asserts a layer name and a positive layer count when the section is enabled."""
        if self.enabled and (self.layer_num < 1 or not self.layer_name):
            raise ValueError(
                f"eigenvalue is enabled but layer_num is {self.layer_num} and layer_name {self.layer_name!r}: name "
                'the model\'s list of blocks (e.g. "layer_name": "encoder.layers") and how many of its blocks to '
                'probe ("layer_num": 12)'
            )
        return self
