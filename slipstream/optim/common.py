"""What the optimizers here share: the math dtype, closures, and how each asks ZeRO for whole tensors.

An optimizer that needs a parameter whole (LAMB's trust ratio, Muon's orthogonalisation) sets
`wants_whole_tensors`; the ZeRO optimizer that wraps it then calls `attach_whole_tensors` with the map of its
pieces ([Note: whole-tensor map] in zero/whole_tensors.py). Without ZeRO the map is built from the optimizer's
own parameters, each one whole. `runs_on_host` says the class runs wherever its tensors live, so
offload_optimizer may step it on the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from slipstream.zero.whole_tensors import WholeTensorMap

__all__ = ["WholeTensorOptimizer", "closure_loss", "math_dtype"]


def math_dtype(p: torch.Tensor) -> torch.dtype:
    """fp32 for low-precision params (states and math), the param's own dtype when wider."""
    return torch.promote_types(p.dtype, torch.float32)


def closure_loss(closure: Callable[[], float] | None) -> float | None:
    """`closure()` with autograd on (the step itself runs under no_grad), or None without a closure."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class WholeTensorOptimizer(torch.optim.Optimizer):
    """A torch optimizer that steps pieces of parameters through a whole-tensor map."""

    wants_whole_tensors = True
    runs_on_host = True
    _whole: WholeTensorMap | None = None
    _scratch: dict[int, torch.Tensor]

    def attach_whole_tensors(self, whole: WholeTensorMap) -> None:
        """Called by the ZeRO optimizer once its pieces replaced this optimizer's parameters."""
        self._whole = whole
        self._scratch = {}

    def whole_tensors(self) -> WholeTensorMap:
        """The attached map, or (no ZeRO) the map of this optimizer's own parameters."""
        return self._whole if self._whole is not None else WholeTensorMap.of_params(self.param_groups)

    def scratch(self, p: torch.Tensor) -> torch.Tensor:
        """A buffer shaped like `p` in its math dtype, allocated on first use and reused every step."""
        if not hasattr(self, "_scratch"):
            self._scratch = {}
        found = self._scratch.get(id(p))
        if found is None or found.shape != p.shape:
            found = self._scratch[id(p)] = torch.empty_like(p, dtype=math_dtype(p))
        return found
